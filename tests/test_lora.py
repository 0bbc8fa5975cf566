"""LoRA adapters (vLLM's enable_lora / LoRARequest), held to PEFT on the same weights: fp32, CPU,
adapters with random A and B written by PEFT's own save_pretrained. Greedy tokens and prompt
logprobs per family (fused q/k/v and gate/up layers, Phi-3's fused checkpoint modules, biases);
requests with different adapters (and none) in one batch; chunked, preempted, prefix-cached and
async steps; max_loras; the workers' adapter cache; tensor parallelism; and the refusals."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_reference import build_tiny_model, hf_greedy
from llm_factory import make_llm
from lora_adapters import edit_adapter_config, make_adapter, peft_greedy, peft_prompt_logprobs
from scheduler_fakes import distinct_prompt
from vllm_lite import LLM, SamplingParams
from vllm_lite.config import CacheConfig, EngineArgs, SchedulerConfig
from vllm_lite.core.request import Request
from vllm_lite.core.scheduler import Scheduler
from vllm_lite.exceptions import VLLMValidationError
from vllm_lite.lora.request import LoRARequest

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
FAMILIES = ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_phi3", "tiny_opt", "tiny_starcoder2", "tiny_gemma2",
            "tiny_gpt_neox", "tiny_phi2", "tiny_stablelm", "tiny_gpt_bigcode_mha", "tiny_bloom", "tiny_falcon_40b",
            "tiny_olmo", "tiny_gptj"]


def greedy(llm: LLM, prompts: list[list[int]], lora: LoRARequest | list | None,
           params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def runner_of(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


@pytest.fixture(scope="module")
def llama_adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two adapters of tiny_llama: a plain one on every linear layer, and one with rsLoRA, a
    rank_pattern and an alpha_pattern on some of them."""
    folder = tmp_path_factory.mktemp("llama_adapters")
    return {
        "a": make_adapter(tiny_llama, folder / "a", seed=1),
        "b": make_adapter(tiny_llama, folder / "b", seed=2, r=4, alpha=8, use_rslora=True,
                          target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                          rank_pattern={"o_proj": 2}, alpha_pattern={"down_proj": 3.0}),
    }


@pytest.mark.parametrize("fixture", FAMILIES)
def test_family_with_adapter_matches_peft(fixture: str, request: pytest.FixtureRequest, tmp_path: Path,
                                          prompts_token_ids: list[list[int]]) -> None:
    base: Path = request.getfixturevalue(fixture)
    adapter = make_adapter(base, tmp_path / "adapter", seed=3)
    lora = LoRARequest("adapter", 1, str(adapter))
    prompts = prompts_token_ids[:3]
    llm = make_llm(base, enable_lora=True)
    try:
        with_adapter = greedy(llm, prompts, lora)
        assert with_adapter == peft_greedy(base, adapter, prompts, NEW_TOKENS)
        assert with_adapter != greedy(llm, prompts, None)  # (the adapter changes the tokens)
        prompt = prompts_token_ids[4]
        output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                              lora_request=lora, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    got = torch.tensor([entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])])
    torch.testing.assert_close(got, peft_prompt_logprobs(base, adapter, prompt), atol=2e-4, rtol=0)
    assert output.lora_request == lora


def _expected(tiny_llama: Path, adapters: dict[str, Path], prompts: list[list[int]],
              names: list[str | None]) -> list[list[int]]:
    by_name = {name: (hf_greedy(tiny_llama, prompts, NEW_TOKENS) if name is None
                      else peft_greedy(tiny_llama, adapters[name], prompts, NEW_TOKENS))
               for name in set(names)}
    return [by_name[name][i] for i, name in enumerate(names)]


def test_requests_with_different_adapters_share_steps(tiny_llama: Path, llama_adapters: dict[str, Path],
                                                      prompts_token_ids: list[list[int]]) -> None:
    """Adapters a and b and the base model, interleaved in one batch (each adapter's tokens are
    not consecutive: the gathered path), then chunked into 16-token steps under a cache small
    enough to preempt, with async scheduling and a second pass over prefix-cache hits."""
    prompts = prompts_token_ids[:6]
    names = ["a", None, "b", "a", "b", None]
    loras = {"a": LoRARequest("a", 1, str(llama_adapters["a"])), "b": LoRARequest("b", 2, str(llama_adapters["b"]))}
    requests = [loras[name] if name else None for name in names]
    expected = _expected(tiny_llama, llama_adapters, prompts, names)
    llm = make_llm(tiny_llama, enable_lora=True, max_loras=2)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=requests,
                               use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert [o.lora_request for o in outputs] == requests
    finally:
        llm.shutdown()
    llm = make_llm(tiny_llama, enable_lora=True, max_loras=2, num_kv_blocks=14, block_size=16,
                   max_num_batched_tokens=16, async_scheduling=True)
    try:
        assert greedy(llm, prompts, requests) == expected
        assert greedy(llm, prompts, requests) == expected
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    finally:
        llm.shutdown()


def test_max_loras_bounds_the_adapters_of_a_step(tiny_llama: Path, llama_adapters: dict[str, Path],
                                                 prompts_token_ids: list[list[int]]) -> None:
    """With max_loras=1 the requests of the second adapter wait until the first one's are done
    (vLLM's rule), and all finish with their own adapter's tokens."""
    prompts = prompts_token_ids[:4]
    names = ["a", "b", "a", None]
    loras = {"a": LoRARequest("a", 1, str(llama_adapters["a"])), "b": LoRARequest("b", 2, str(llama_adapters["b"]))}
    llm = make_llm(tiny_llama, enable_lora=True, max_loras=1)
    runner = runner_of(llm)
    seen: list[set[int]] = []
    original = runner.lora.set_step

    def recording_set_step(lora_ids: np.ndarray, query_lens: np.ndarray) -> None:
        seen.append(set(lora_ids.tolist()) - {0})
        original(lora_ids, query_lens)

    runner.lora.set_step = recording_set_step
    try:
        got = greedy(llm, prompts, [loras[n] if n else None for n in names])
    finally:
        llm.shutdown()
    assert got == _expected(tiny_llama, llama_adapters, prompts, names)
    assert max(len(ids) for ids in seen) == 1 and set().union(*seen) == {1, 2}


def test_scheduler_passes_over_a_request_whose_adapter_is_one_too_many() -> None:
    scheduler = Scheduler(SchedulerConfig(8, 256, 256, True), CacheConfig(4, 64, None, True), 64, max_loras=1)
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    for request_id, lora in (("a1", a), ("b1", b), ("base", None), ("a2", a)):
        request = Request(request_id, distinct_prompt(request_id, 6), SamplingParams(ignore_eos=True), (7,), 4)
        request.lora_request = lora
        scheduler.add_request(request)
    first = scheduler.schedule()
    assert [new.req_id for new in first.scheduled_new_reqs] == ["a1", "base", "a2"]
    assert [r.request_id for r in scheduler.waiting] == ["b1"]
    assert first.scheduled_new_reqs[0].lora_request == a
    stats = scheduler.get_stats()  # (vllm:lora_requests_info's labels)
    assert (stats["max_lora"], stats["running_lora_adapters"], stats["waiting_lora_adapters"]) == (1, "a", "b")


def test_adapters_keep_their_own_prefix_cache_entries(tiny_llama: Path, llama_adapters: dict[str, Path],
                                                      prompts_token_ids: list[list[int]]) -> None:
    prompt = prompts_token_ids[-1]  # the longest: several full blocks of 16
    lora = LoRARequest("a", 1, str(llama_adapters["a"]))
    llm = make_llm(tiny_llama, enable_lora=True, block_size=16)
    try:
        run = lambda adapter: llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=adapter,
                                           use_tqdm=False)[0]
        base = run(None)
        first, second, base_again = run(lora), run(lora), run(None)
        samples = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=2, temperature=0.0, max_tokens=NEW_TOKENS,
                                                                            ignore_eos=True),
                               lora_request=lora, use_tqdm=False)[0]  # (n > 1: each sample runs with the adapter)
    finally:
        llm.shutdown()
    assert [c.token_ids for c in samples.outputs] == [first.outputs[0].token_ids] * 2
    assert len(prompt) >= 32
    assert first.num_cached_tokens == 0  # the base model's blocks are not the adapter's
    assert second.num_cached_tokens > 0 and base_again.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == peft_greedy(
        tiny_llama, llama_adapters["a"], [prompt], NEW_TOKENS)[0]
    assert base.outputs[0].token_ids == base_again.outputs[0].token_ids


def test_workers_keep_at_most_max_cpu_loras(tiny_llama: Path, llama_adapters: dict[str, Path],
                                            prompts_token_ids: list[list[int]], tmp_path: Path) -> None:
    third = make_adapter(tiny_llama, tmp_path / "c", seed=4, r=2)
    paths = {**llama_adapters, "c": third}
    loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(paths.items())}
    prompts = prompts_token_ids[:2]
    llm = make_llm(tiny_llama, enable_lora=True, max_loras=1, max_cpu_loras=2)
    runner = runner_of(llm)
    try:
        for name in ["a", "b", "c", "a"]:
            assert greedy(llm, prompts, loras[name]) == peft_greedy(tiny_llama, paths[name], prompts, NEW_TOKENS)
            assert len(runner.lora.adapters) <= 2
        assert list(runner.lora.adapters) == [loras["c"].lora_int_id, loras["a"].lora_int_id]
    finally:
        llm.shutdown()


def test_lora_target_modules_leaves_other_layers_alone(tiny_llama: Path, llama_adapters: dict[str, Path],
                                                       prompts_token_ids: list[list[int]], tmp_path: Path) -> None:
    """lora_target_modules=["o_proj"] (vLLM's names) applies only the adapter's o_proj modules:
    the same as an adapter that has only those."""
    from safetensors.torch import load_file, save_file

    only_o = tmp_path / "only_o"
    shutil.copytree(llama_adapters["a"], only_o)
    tensors = load_file(only_o / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".o_proj." in k}, only_o / "adapter_model.safetensors")
    edit_adapter_config(only_o, target_modules=["o_proj"])  # (PEFT would draw the missing modules at random)
    prompts = prompts_token_ids[:2]
    llm = make_llm(tiny_llama, enable_lora=True, lora_target_modules=["o_proj"])
    try:
        got = greedy(llm, prompts, LoRARequest("a", 1, str(llama_adapters["a"])))
    finally:
        llm.shutdown()
    assert got == peft_greedy(tiny_llama, only_o, prompts, NEW_TOKENS)


@pytest.mark.parametrize("arch, num_kv_heads", [("llama", 2), ("llama", 1), ("phi3", 2)])
def test_tensor_parallel_adapter_matches_peft(arch: str, num_kv_heads: int, tmp_path: Path,
                                              prompts_token_ids: list[list[int]]) -> None:
    """TP=2: lora_B of q/k/v and gate/up split by output rows (k and v replicated when there is
    one KV head; Phi-3's fused modules split first), lora_A of o_proj and down_proj by input
    features, summed by the all-reduce."""
    base = build_tiny_model(tmp_path / "base", arch, tie_word_embeddings=False, num_kv_heads=num_kv_heads)
    adapter = make_adapter(base, tmp_path / "adapter", seed=5)
    prompts = prompts_token_ids[:3]
    lora = LoRARequest("a", 1, str(adapter))
    llm = make_llm(base, enable_lora=True, tensor_parallel_size=2, multiprocess=True)
    try:
        got = greedy(llm, prompts, [lora, None, lora])
    finally:
        llm.shutdown()
    with_adapter = peft_greedy(base, adapter, prompts, NEW_TOKENS)
    assert got == [with_adapter[0], hf_greedy(base, prompts, NEW_TOKENS)[1], with_adapter[2]]


# ---- refusals ----

def test_adapter_requests_are_refused_without_enable_lora(tiny_llama: Path, llama_adapters: dict[str, Path]) -> None:
    llm = make_llm(tiny_llama)
    try:
        with pytest.raises(VLLMValidationError, match="LoRA is not enabled"):
            llm.generate("hello", lora_request=LoRARequest("a", 1, str(llama_adapters["a"])), use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kwargs, message", [
    (dict(lora_name="", lora_int_id=1, lora_path="/x"), "lora_name must be a non-empty string"),
    (dict(lora_name="a", lora_int_id=0, lora_path="/x"), "lora_int_id must be an int > 0"),
    (dict(lora_name="a", lora_int_id=1, lora_path=""), "lora_path must name"),
    (dict(lora_name="a", lora_int_id=1, lora_path="/x", load_inplace=True), "load_inplace=True is not supported"),
])
def test_lora_request_fields_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(VLLMValidationError, match=message):
        LoRARequest(**kwargs)


@pytest.mark.parametrize("args, message", [
    (dict(enable_lora=True, max_lora_rank=7), "max_lora_rank must be one of"),
    (dict(enable_lora=True, max_loras=0), "max_loras must be >= 1"),
    (dict(enable_lora=True, max_loras=2, max_cpu_loras=1), r"max_cpu_loras \(1\) must be >= max_loras \(2\)"),
    (dict(enable_lora=True, lora_dtype="bfloat16", dtype="float32"), "adapters run in the model's dtype"),
    (dict(max_cpu_loras=4), "set without enable_lora"),
])
def test_lora_engine_arguments_are_checked(tiny_llama: Path, args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tiny_llama), **{"dtype": "float32", **args}).create_engine_config()


def test_lora_on_the_transformers_fallback_is_refused(tiny_cohere: Path) -> None:
    with pytest.raises(ValueError, match="LoRA adapters run on the native models only"):
        EngineArgs(model=str(tiny_cohere), enable_lora=True).create_engine_config()


def _broken(adapter: Path, tmp_path: Path, name: str) -> Path:
    copy = tmp_path / name
    shutil.copytree(adapter, copy)
    return copy


def test_bad_adapters_are_refused_by_name_and_the_engine_goes_on(
        tiny_llama: Path, tiny_opt: Path, tiny_mixtral: Path, llama_adapters: dict[str, Path], tmp_path: Path,
        prompts_token_ids: list[list[int]]) -> None:
    """Each bad adapter fails its own request with a message naming what is wrong; the requests
    around it (and after it) are served."""
    from safetensors.torch import load_file, save_file

    good = llama_adapters["a"]
    dora = _broken(good, tmp_path, "dora")
    edit_adapter_config(dora, use_dora=True)
    unknown = _broken(good, tmp_path, "unknown")
    edit_adapter_config(unknown, future_feature={"on": True})
    saved_modules = _broken(good, tmp_path, "saved_modules")
    edit_adapter_config(saved_modules, modules_to_save=["lm_head"])
    saved_head = _broken(good, tmp_path, "saved_head")  # (a SEQ_CLS adapter's head, on a generating model)
    head_tensors = load_file(saved_head / "adapter_model.safetensors")
    save_file({**head_tensors, "base_model.model.score.weight": torch.zeros(3, 64)},
              saved_head / "adapter_model.safetensors")
    pickled = _broken(good, tmp_path, "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    rank16 = make_adapter(tiny_llama, tmp_path / "rank16", r=16)
    other_model = make_adapter(tiny_opt, tmp_path / "opt_adapter")
    narrower = build_tiny_model(tmp_path / "narrow_llama", "llama", tie_word_embeddings=False, hidden_size=32)
    other_shapes = make_adapter(narrower, tmp_path / "narrow_adapter")
    experts = _broken(good, tmp_path, "experts")  # one module: an MoE expert's w1
    save_file({f"base_model.model.model.layers.0.block_sparse_moe.experts.0.w1.lora_{part}.weight": tensor
               for part, tensor in (("A", torch.zeros(8, 64)), ("B", torch.zeros(128, 8)))},
              experts / "adapter_model.safetensors")
    cases = [
        (dora, "does not yet support DoRA"),
        (unknown, "future_feature"),
        (saved_modules, r"only supports modules_to_save being None or \['classifier', 'score'\] \(got \['lm_head'\]\)"),
        (saved_head, "saves a classifier head \\[3, 64\\], and this model is no classification model"),
        (pickled, "pickled .bin weights are not read"),
        (rank16, "LoRA rank 16 is greater than max_lora_rank 8"),
        (tmp_path / "missing", "Loading lora bad6 failed: No adapter found for"),
        (other_model, "module 'model.decoder.layers.0.fc1' is not a weight of the base model"),
        (other_shapes, r"down_proj' maps 64 -> 32 features; the base model's weight is \[64, 128\]"),
    ]
    prompts = prompts_token_ids[:2]
    llm = make_llm(tiny_llama, enable_lora=True, max_lora_rank=8, max_loras=2)
    try:
        expected = greedy(llm, prompts, None)
        for i, (path, message) in enumerate(cases):
            with pytest.raises(ValueError, match=message):
                greedy(llm, prompts, [None, LoRARequest(f"bad{i}", 10 + i, str(path))])
            assert greedy(llm, prompts, None) == expected
        with pytest.raises(VLLMValidationError, match="lora_request has 1 entries but there are 2 prompts"):
            greedy(llm, prompts, [None])
        assert greedy(llm, prompts, LoRARequest("a", 1, str(good))) == peft_greedy(tiny_llama, good, prompts,
                                                                                   NEW_TOKENS)
        with pytest.raises(VLLMValidationError, match="lora_int_id 1 is adapter .* needs an id of its own"):
            greedy(llm, prompts, LoRARequest("again", 1, str(other_shapes)))
    finally:
        llm.shutdown()
    llm = make_llm(tiny_mixtral, enable_lora=True)
    try:
        with pytest.raises(ValueError, match="is not a linear layer of this model"):
            greedy(llm, prompts, LoRARequest("experts", 1, str(experts)))
    finally:
        llm.shutdown()


def test_beam_search_runs_each_prompt_with_its_adapter(tiny_llama: Path, llama_adapters: dict[str, Path],
                                                       prompts_token_ids: list[list[int]]) -> None:
    """LLM.beam_search's lora_request (vLLM's third argument): width 1 is the greedy search, so
    each prompt's tokens are its adapter's greedy ones; concurrency_limit changes nothing."""
    from vllm_lite.entrypoints.beam_search import BeamSearchParams

    prompts = prompts_token_ids[:3]
    names = ["a", None, "b"]
    loras = {"a": LoRARequest("a", 1, str(llama_adapters["a"])), "b": LoRARequest("b", 2, str(llama_adapters["b"]))}
    params = BeamSearchParams(beam_width=1, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = make_llm(tiny_llama, enable_lora=True, max_loras=2)
    try:
        requests = [loras[n] if n else None for n in names]
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, requests)
        one_at_a_time = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, requests,
                                        concurrency_limit=1)
    finally:
        llm.shutdown()
    got = [output.sequences[0].tokens[len(prompt):] for output, prompt in zip(outputs, prompts)]
    assert got == _expected(tiny_llama, llama_adapters, prompts, names)
    assert [o.sequences[0].tokens for o in one_at_a_time] == [o.sequences[0].tokens for o in outputs]


def test_embedding_model_with_adapter_matches_peft(tiny_qwen3: Path, tmp_path: Path,
                                                   prompts_token_ids: list[list[int]]) -> None:
    """An embedding model (a `Qwen3Model` checkpoint, LAST pooling) with an adapter PEFT wrote on
    transformers' AutoModel: the pooled, normalized vectors are PEFT's; LLM.encode gives the same
    as a tensor; requests without the adapter are the base model's."""
    from lora_adapters import peft_hidden_states
    from test_embeddings import decoder_only_checkpoint, hf_embedding

    checkpoint = decoder_only_checkpoint(tiny_qwen3, tmp_path)
    adapter = make_adapter(checkpoint, tmp_path / "adapter", seed=6, decoder_only=True)
    lora = LoRARequest("embed", 1, str(adapter))
    prompts = prompts_token_ids[:3]
    llm = make_llm(checkpoint, enable_lora=True)
    try:
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], lora_request=[lora, None, lora],
                            use_tqdm=False)
        encoded = llm.encode({"prompt_token_ids": prompts[0]}, pooling_task="embed", lora_request=lora,
                             use_tqdm=False)
    finally:
        llm.shutdown()
    expected = [torch.nn.functional.normalize(peft_hidden_states(checkpoint, adapter, prompts[0])[-1], dim=-1),
                hf_embedding(tiny_qwen3, prompts[1], "LAST"),
                torch.nn.functional.normalize(peft_hidden_states(checkpoint, adapter, prompts[2])[-1], dim=-1)]
    for output, want in zip(outputs, expected):
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(encoded[0].outputs.data, torch.tensor(outputs[0].outputs.embedding))
    assert not torch.allclose(expected[0], hf_embedding(tiny_qwen3, prompts[0], "LAST"), atol=1e-3)


def test_adapter_over_gguf_blocks_equals_the_dequantized_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                prompts_token_ids: list[list[int]]) -> None:
    """The demo model is a GGUF kept in its blocks: an adapter's update is added to those layers'
    output as to any other's. A Q8_0 tiny Llama with an adapter gives the tokens of the same
    weights widened to fp32 with the adapter (the GGUF test's own standard, without LoRA)."""
    from model.gguf_export import export_gguf
    from vllm_lite.gguf_convert import gguf_model_dir

    monkeypatch.setenv("VLLM_LITE_CACHE", str(tmp_path / "cache"))
    base = build_tiny_model(tmp_path / "base", "llama", tie_word_embeddings=True, seed=3)
    gguf_file = export_gguf(base, tmp_path / "tiny-q8_0.gguf", "llama", quant="Q8_0")
    dequantized = gguf_model_dir(gguf_file)
    adapter = make_adapter(dequantized, tmp_path / "adapter", seed=7)
    lora = LoRARequest("a", 1, str(adapter))
    prompts = prompts_token_ids[:4]
    results = []
    for model in (gguf_file, dequantized):
        llm = make_llm(model, enable_lora=True)
        try:
            assert (llm.llm_engine.vllm_config.model_config.quantization == "gguf") == (model == gguf_file)
            results.append((greedy(llm, prompts, lora), greedy(llm, prompts, None)))
        finally:
            llm.shutdown()
    (kept, kept_base), (widened, widened_base) = results
    assert kept == widened and kept_base == widened_base and kept != kept_base
