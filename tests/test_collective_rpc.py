"""vLLM's collective_rpc, worker_extension_cls, apply_model and the model's load_weights: an RL
trainer's weight updates, as vLLM's RLHF examples send them. An engine started on one checkpoint
and given another's tensors generates the other's tokens (transformers' greedy tokens of it);
a partial update of fused layers (k of qkv, up of gate_up) matches a checkpoint so mixed; the
packed CPU layouts (oneDNN, the LM head's panels, a tied head) are updated too; TP=2 ranks each
load their slice. Arguments and results cross processes as msgpack (tensors of any dtype); a
function only with VLLM_ALLOW_INSECURE_SERIALIZATION=1, as in vLLM."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_reference import build_tiny_model, hf_greedy
from llm_factory import make_llm
from vllm_lite import LLM, SamplingParams
from vllm_lite.config import EngineArgs
from vllm_lite.rpc import INSECURE_SERIALIZATION_ENV

EXTENSION = "worker_extensions.WeightSync"
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 200, 300, 400, 500, 600, 700]]
NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def greedy(llm: LLM) -> list[list[int]]:
    return [list(completion.token_ids) for completion in greedy_outputs(llm)]


def weights_of(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's shapes, other weights (what a trainer's step made)."""
    return build_tiny_model(tmp_path_factory.mktemp("other_llama"), "llama", tie_word_embeddings=False, seed=7)


@pytest.fixture(scope="module")
def mixed_llama(tiny_llama: Path, other_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with two fused layers' parts (layer 0's k_proj, layer 1's up_proj) and the
    LM head taken from the other: what a partial update of those tensors makes."""
    out = tmp_path_factory.mktemp("mixed_llama")
    for item in tiny_llama.iterdir():
        if item.is_file():
            shutil.copy(item, out / item.name)
    weights = weights_of(tiny_llama)
    weights.update({name: tensor for name, tensor in weights_of(other_llama).items() if name in PARTIAL})
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


PARTIAL = ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight", "lm_head.weight")


def packed_layers(model: torch.nn.Module) -> dict[str, str]:
    """Each layer's packed weight's kind (the CPU matmul's layouts), None where it runs unpacked."""
    return {name: type(module.packed_weight).__name__ for name, module in model.named_modules()
            if hasattr(module, "packed_weight")}


def test_a_weight_update_makes_the_engine_generate_the_new_checkpoints_tokens(tiny_llama: Path, other_llama: Path,
                                                                              mixed_llama: Path) -> None:
    llm = make_llm(tiny_llama, worker_extension_cls=EXTENSION)
    try:
        assert greedy(llm) == hf_greedy(tiny_llama, PROMPTS, NUM_TOKENS)
        packed = llm.apply_model(packed_layers)
        assert "NoneType" not in packed[0].values()
        partial = {name: tensor for name, tensor in weights_of(other_llama).items() if name in PARTIAL}
        loaded = llm.collective_rpc("update_weights", args=(partial,))
        assert loaded == [sorted(["model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight",
                                  "lm_head.weight"])]
        llm.reset_prefix_cache()
        assert greedy(llm) == hf_greedy(mixed_llama, PROMPTS, NUM_TOKENS)
        for name, tensor in weights_of(other_llama).items():  # one tensor a call, as vLLM's RLHF example sends
            llm.collective_rpc("update_weight", args=(name, tensor))
        llm.reset_prefix_cache()
        assert greedy(llm) == hf_greedy(other_llama, PROMPTS, NUM_TOKENS)
        assert llm.apply_model(packed_layers) == packed  # (every updated layer packed again)
    finally:
        llm.shutdown()


def test_a_tied_models_update_reaches_its_lm_head(tiny_llama_tied: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "other", "llama", tie_word_embeddings=True, attention_bias=True,
                             num_kv_heads=1, seed=11)
    llm = make_llm(tiny_llama_tied, worker_extension_cls=EXTENSION)
    try:
        llm.collective_rpc("update_weights", args=(weights_of(other),))
        llm.reset_prefix_cache()
        assert greedy(llm) == hf_greedy(other, PROMPTS, NUM_TOKENS)
    finally:
        llm.shutdown()


def test_bf16_engine_takes_float32_updates_as_it_loads_a_checkpoint(tiny_llama: Path, other_llama: Path) -> None:
    loaded = make_llm(other_llama, dtype="bfloat16")
    try:
        expected = greedy(loaded)
    finally:
        loaded.shutdown()
    llm = make_llm(tiny_llama, dtype="bfloat16", worker_extension_cls=EXTENSION)
    try:
        llm.collective_rpc("update_weights", args=(weights_of(other_llama),))
        llm.reset_prefix_cache()
        assert greedy(llm) == expected
    finally:
        llm.shutdown()


def test_spawned_engine_and_tensor_parallel_ranks_take_the_update(tiny_llama: Path, other_llama: Path) -> None:
    """Then vLLM's `reload_weights` on every rank: the model's own checkpoint again (each rank reads
    its part), and another checkpoint's folder."""
    expected = hf_greedy(other_llama, PROMPTS, NUM_TOKENS)
    original = hf_greedy(tiny_llama, PROMPTS, NUM_TOKENS)
    for tp in (1, 2):
        llm = make_llm(tiny_llama, multiprocess=True, tensor_parallel_size=tp, worker_extension_cls=EXTENSION)
        try:
            ranks = llm.collective_rpc("rank_and_device")
            assert ranks == [{"rank": r, "local_rank": r, "device": "cpu"} for r in range(tp)]
            llm.collective_rpc("update_weights", args=(weights_of(other_llama),))
            llm.reset_prefix_cache()
            assert greedy(llm) == expected
            assert llm.collective_rpc("reload_weights") == [None] * tp
            llm.reset_prefix_cache()
            assert greedy(llm) == original
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(other_llama)})
            llm.reset_prefix_cache()
            assert greedy(llm) == expected
            with pytest.raises(RuntimeError, match="is_checkpoint_format=False"):
                llm.collective_rpc("reload_weights", kwargs={"is_checkpoint_format": False})
        finally:
            llm.shutdown()


def test_bad_updates_and_failing_methods_fail_the_call_not_the_engine(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, multiprocess=True, worker_extension_cls=EXTENSION)
    try:
        expected = greedy(llm)
        weight = weights_of(tiny_llama)["model.layers.0.self_attn.q_proj.weight"]
        cases = {
            "has no matching model parameter": {"model.layers.9.self_attn.q_proj.weight": weight},
            "does not fit the parameter": {"model.layers.0.self_attn.q_proj.weight": weight[:1]},
            "has shape": {"model.layers.0.self_attn.q_proj.weight": weight.t().reshape(-1)},
        }
        for message, weights in cases.items():
            with pytest.raises(RuntimeError, match=message):
                llm.collective_rpc("update_weights", args=(weights,))
        with pytest.raises(RuntimeError, match="boom"):
            llm.collective_rpc("fail", args=("boom",))
        with pytest.raises(RuntimeError, match="has no method 'no_such_method'"):
            llm.collective_rpc("no_such_method")
        with pytest.raises(ValueError, match="'_private' is not a worker method"):
            llm.collective_rpc("_private")
        with pytest.raises(TypeError, match=INSECURE_SERIALIZATION_ENV):
            llm.collective_rpc(lambda worker: worker.rank)
        with pytest.raises(TypeError, match=INSECURE_SERIALIZATION_ENV):
            llm.collective_rpc("rank_and_device", args=(object(),))
        with pytest.raises(TimeoutError, match="within 0.2 s"):
            llm.collective_rpc("sleep_for", timeout=0.2, args=(1.5,))
        assert llm.collective_rpc("rank_and_device")[0]["rank"] == 0  # (the late answer was dropped)
        assert greedy(llm) == expected
    finally:
        llm.shutdown()


def test_functions_and_apply_model_with_insecure_serialization(tiny_llama: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INSECURE_SERIALIZATION_ENV, "1")
    for multiprocess in (False, True):
        llm = make_llm(tiny_llama, multiprocess=multiprocess)
        try:
            assert llm.collective_rpc(lambda worker, offset: worker.rank + offset, args=(3,)) == [3]
            counts = llm.apply_model(lambda model: sum(p.numel() for p in model.parameters()))
            assert counts == [sum(t.numel() for t in weights_of(tiny_llama).values())]
            # (a tensor of another dtype comes back as it went)
            echoed = llm.collective_rpc(lambda worker, t: t * 2, args=(torch.ones(3, dtype=torch.bfloat16),))[0]
            assert echoed.dtype == torch.bfloat16 and echoed.tolist() == [2.0, 2.0, 2.0]
        finally:
            llm.shutdown()


def test_in_process_calls_take_functions_but_no_timeout(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    try:
        assert llm.collective_rpc(lambda worker: type(worker).__name__) == ["Worker"]
        with pytest.raises(ValueError, match="timeout needs the engine core in its own process"):
            llm.collective_rpc("get_model", timeout=1.0)
    finally:
        llm.shutdown()


def test_trainers_reach_the_model_through_vllms_attributes(tiny_llama: Path, other_llama: Path) -> None:
    """TRL's and verl's colocated weight sync, with the engine in the trainer's process:
    `llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.load_weights(...)`."""
    llm = make_llm(tiny_llama)
    try:
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        model.load_weights(weights_of(other_llama).items())
        llm.reset_prefix_cache()
        assert greedy(llm) == hf_greedy(other_llama, PROMPTS, NUM_TOKENS)
    finally:
        llm.shutdown()
    spawned = make_llm(tiny_llama, multiprocess=True)
    try:
        assert not hasattr(spawned.llm_engine, "model_executor")  # (vLLM's: only in process)
    finally:
        spawned.shutdown()


def test_async_llm_collective_rpc(tiny_llama: Path) -> None:
    from vllm_lite.engine.async_llm import AsyncLLM

    async def go() -> list:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llama), max_model_len=128, dtype="float32",
                                                      worker_extension_cls=EXTENSION))
        try:
            return await engine.collective_rpc("rank_and_device")
        finally:
            engine.shutdown()

    assert asyncio.run(go()) == [{"rank": 0, "local_rank": 0, "device": "cpu"}]


@pytest.mark.parametrize("name, message", [
    ("worker_extensions.ClashingExtension", r"defines \['execute_model'\], which the worker has already"),
    ("worker_extensions.not_a_class", "is not a class"),
    ("worker_extensions.Missing", "cannot be imported"),
    ("no_such_module.Extension", "cannot be imported"),
    ("Extension", "is not a qualified name"),
])
def test_bad_worker_extensions_are_refused_before_the_engine_starts(tiny_llama: Path, name: str,
                                                                    message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_llama, worker_extension_cls=name)


@pytest.mark.parametrize("model_name, model_impl, tensor", [
    ("tiny_llama", "vllm", "model.layers.0.mlp.down_proj.weight"),
    ("tiny_llama", "transformers", "model.layers.0.mlp.down_proj.weight"),
    ("tiny_mixtral", "vllm", "model.layers.0.block_sparse_moe.experts.1.w2.weight"),  # (an MoE expert's)
])
def test_quantized_layers_refuse_updates_by_name(model_name: str, model_impl: str, tensor: str,
                                                 request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(model_name)
    llm = make_llm(model, quantization="int8", model_impl=model_impl, worker_extension_cls=EXTENSION)
    try:
        before = greedy(llm)
        weight = weights_of(model)[tensor]
        with pytest.raises(ValueError, match=f"'{tensor}' belongs to a layer kept quantized"):
            llm.collective_rpc("update_weights", args=({tensor: weight},))
        llm.reset_prefix_cache()
        assert greedy(llm) == before  # (the layers as they were)
    finally:
        llm.shutdown()


def test_the_transformers_fallback_takes_updates_by_its_parameter_names(tiny_llama: Path, other_llama: Path) -> None:
    llm = make_llm(tiny_llama, model_impl="transformers", worker_extension_cls=EXTENSION)
    try:
        llm.collective_rpc("update_weights", args=(weights_of(other_llama),))
        llm.reset_prefix_cache()
        assert greedy(llm) == hf_greedy(other_llama, PROMPTS, NUM_TOKENS)
        with pytest.raises(ValueError, match="has no matching model parameter"):
            llm.collective_rpc("update_weights", args=({"model.nope.weight": torch.zeros(1)},))
    finally:
        llm.shutdown()


def test_weight_versions_label_the_tokens_each_weights_sampled(tiny_llama: Path) -> None:
    """vLLM's update_weight_version: each finished output says which label's weights sampled
    which of its tokens; a label set while a request is paused mid-generation ("keep") splits it."""
    from vllm_lite import WeightVersionSpan
    from vllm_lite.engine.async_llm import AsyncLLM

    for multiprocess in (False, True):
        llm = make_llm(tiny_llama, multiprocess=multiprocess)
        try:
            assert llm.get_weight_version() == "default"
            assert greedy_outputs(llm)[0].weight_versions == [WeightVersionSpan("default", 0, NUM_TOKENS)]
            llm.update_weight_version("step-1")
            assert llm.get_weight_version() == "step-1"
            assert greedy_outputs(llm)[0].weight_versions == [WeightVersionSpan("step-1", 0, NUM_TOKENS)]
            with pytest.raises((ValueError, RuntimeError), match="weight_version must be a non-empty string"):
                llm.update_weight_version("")
        finally:
            llm.shutdown()

    async def go() -> list:
        from async_streams import stream_to_end

        engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llama), max_model_len=256, dtype="float32"))
        try:
            started = asyncio.Event()
            task = asyncio.create_task(stream_to_end(engine, "r", PROMPTS[0], 120, started))
            await started.wait()
            await engine.pause_generation(mode="keep")
            await engine.update_weight_version("step-2")
            await engine.resume_generation()
            return (await task).weight_versions
        finally:
            engine.shutdown()

    spans = asyncio.run(go())
    assert [span.version for span in spans] == ["default", "step-2"]
    assert spans[0].start == 0 and 0 < spans[0].end == spans[1].start < spans[1].end == 120



def test_a_step_of_several_tokens_a_row_keeps_its_weight_version() -> None:
    """Speculative decoding's steps are handed to the client as steps of one token a row: each
    keeps the step's label (else the client would see the label change and change back)."""
    import numpy as np

    from vllm_lite.wire import EngineCoreOutputs, split_token_columns

    outputs = EngineCoreOutputs(["a", "b"], np.array([1, 2], dtype=np.int32), weight_version="step-3",
                                more_token_ids=np.array([[3, 4], [5, -1]], dtype=np.int32))
    assert [part.weight_version for part in split_token_columns(outputs)] == ["step-3"] * 3


def greedy_outputs(llm: LLM) -> list:
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
