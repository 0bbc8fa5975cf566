"""Checkpoints quantized already: compressed-tensors W8A8 int8 (what llm-compressor writes for
"W8A8" and vLLM runs as CompressedTensorsW8A8Int8 on CPU), loaded as the int8 linear layers that
quantization="int8" builds. The checkpoints are written here from the tiny models by
compressed-tensors' rule (symmetric int8 per output channel or per tensor, scale = max|w| / 127).

- per-channel: the same int8 values and scales as quantization="int8" makes from the float
  model, so the tokens and logprobs must be identical to that run (Llama's separate q/k/v and
  gate/up tensors into fused layers, Phi-3's fused tensors split, TP=2 slicing the scales with
  the rows);
- per-tensor: close to the float model of the dequantized weights (activation rounding only);
- every scheme, format or key this engine does not run is refused naming it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from llm_factory import make_llm
from quantized_checkpoints import assert_refused, write_quantized_pair
from test_reduced_precision import greedy, teacher_forced_logprobs
from vllm_lite import LLM, SamplingParams

W8A8_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
                    "observer_kwargs": {}},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True, "group_size": None, "block_structure": None, "actorder": None,
                              "observer": None, "observer_kwargs": {}},
        "output_activations": None,
    }},
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "sparsity_config": {},
    "global_compression_ratio": 1.5,
    "version": "0.9.2",
}


def _quantize(weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = (amax / 127.0).clamp_min(1e-12)
    return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale


def write_w8a8(model_dir: Path, out_dir: Path, strategy: str = "channel") -> tuple[Path, Path]:
    """(`model_dir`'s checkpoint with its linear layers' weights as compressed-tensors W8A8 int8,
    the float checkpoint of the weights they stand for)."""
    def pack(prefix: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q, scale = _quantize(weight, strategy)
        return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale}, (q.float() * scale).to(weight.dtype)

    config = copy.deepcopy(W8A8_CONFIG)
    config["config_groups"]["group_0"]["weights"]["strategy"] = strategy
    return write_quantized_pair(model_dir, out_dir, config, pack)


def _tokens_and_logprobs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [next(iter(step.values())).logprob for step in o.outputs[0].logprobs])
            for o in outputs]


def _run(model: Path, prompts: list[list[int]], **engine_args: Any) -> list[tuple[list[int], list[float]]]:
    """Tokens and logprobs, on the CPU unless `device` says otherwise (int8 runs there only)."""
    engine_args.setdefault("device", "cpu")
    llm = make_llm(model, **engine_args)
    try:
        return _tokens_and_logprobs(llm, prompts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_phi3", "tiny_qwen3_moe", "tiny_qwen2_moe"])  # (MoE: int8 experts)
def test_a_per_channel_checkpoint_runs_as_quantization_int8(name: str, request: pytest.FixtureRequest,
                                                            tmp_path: Path, prompts_token_ids: list[list[int]]) -> None:
    model = request.getfixturevalue(name)
    checkpoint, _ = write_w8a8(model, tmp_path)
    prompts = prompts_token_ids[:4]
    loaded = make_llm(checkpoint, device="cpu")
    try:
        assert loaded.llm_engine.vllm_config.model_config.quantization == "compressed-tensors"
        from_checkpoint = _tokens_and_logprobs(loaded, prompts)
    finally:
        loaded.shutdown()
    assert from_checkpoint == _run(model, prompts, quantization="int8")
    assert from_checkpoint != _run(model, prompts)  # (int8 really ran: the float model differs)


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen3_moe"])
def test_tensor_parallel_ranks_take_their_rows_of_the_scales(name: str, request: pytest.FixtureRequest,
                                                            tmp_path: Path, prompts_token_ids: list[list[int]]) -> None:
    """Not equal to TP=1: each rank quantizes its own activations (a row-parallel layer's half of
    the features; quantization="int8" at TP=2 differs again, its row-parallel weights scaled per
    half row), and a close step may flip a greedy token. So the check is teacher-forced, as in
    test_reduced_precision: a rank holding another's scale rows would be far off (an expert's gate
    and up rows are split across ranks, its down rows whole on each)."""
    checkpoint, _ = write_w8a8(request.getfixturevalue(name), tmp_path)
    prompts = prompts_token_ids[:4]
    skip = [len(p) for p in prompts]
    logprobs = []
    for engine_args in ({}, {"tensor_parallel_size": 2, "multiprocess": True}):
        llm = make_llm(checkpoint, device="cpu", **engine_args)
        try:
            if not logprobs:
                sequences = [p + r for p, r in zip(prompts, greedy(llm, prompts))]
            logprobs.append(teacher_forced_logprobs(llm, sequences, skip))
        finally:
            llm.shutdown()
    diffs = [abs(a - b) for ra, rb in zip(*logprobs) for a, b in zip(ra, rb)]
    assert sum(diffs) / len(diffs) < 0.05, diffs


def test_a_per_tensor_checkpoint_is_close_to_its_dequantized_weights(tiny_qwen3: Path, tmp_path: Path,
                                                                     prompts_token_ids: list[list[int]]) -> None:
    """Teacher-forced logprobs (test_reduced_precision's check): the weights are the same numbers,
    the activations' per-token rounding is the difference. Measured 0.031 (per channel: 0.030;
    quantization="int8" against the float model: 0.039)."""
    checkpoint, dequantized = write_w8a8(tiny_qwen3, tmp_path, strategy="tensor")
    reference_llm = make_llm(dequantized)
    int8_llm = make_llm(checkpoint, device="cpu")
    try:
        reference = greedy(reference_llm, prompts_token_ids)
        sequences = [p + r for p, r in zip(prompts_token_ids, reference)]
        skip = [len(p) for p in prompts_token_ids]
        diffs = [abs(a - b) for ra, rb in zip(teacher_forced_logprobs(reference_llm, sequences, skip),
                                              teacher_forced_logprobs(int8_llm, sequences, skip))
                 for a, b in zip(ra, rb)]
        assert 0.0 < sum(diffs) / len(diffs) < 0.1
    finally:
        reference_llm.shutdown()
        int8_llm.shutdown()


def _with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    config = copy.deepcopy(W8A8_CONFIG)
    node = config
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return config


_DELETE = object()
WEIGHTS = ("config_groups", "group_0", "weights")
INPUTS = ("config_groups", "group_0", "input_activations")


@pytest.mark.parametrize("config, message", [
    (_with(("quant_method",), "hqq"), "quantization_config.quant_method='hqq' is not supported"),
    (_with(("format",), "naive-quantized"), "quantization_config.format='naive-quantized' is not supported"),
    (_with(("format",), "pack-quantized"), "input_activations is not supported with pack-quantized weights"),
    (_with(("kv_cache_scheme",), {"num_bits": 8, "type": "float"}), "quantization_config.kv_cache_scheme="),
    (_with(("sparsity_config",), {"format": "sparse-24"}), "quantization_config.sparsity_config="),
    (_with(("calibration_shortcut",), True), "quantization_config.calibration_shortcut is not implemented"),
    (_with(WEIGHTS + ("num_bits",), 4), "config_groups.group_0.weights.num_bits=4 is not supported"),
    (_with(WEIGHTS + ("strategy",), "group"), "config_groups.group_0.weights.strategy='group'"),
    (_with(WEIGHTS + ("group_size",), 128), "config_groups.group_0.weights.group_size=128"),
    (_with(WEIGHTS + ("symmetric",), False), "config_groups.group_0.weights.symmetric=False"),
    (_with(INPUTS + ("dynamic",), False), "config_groups.group_0.input_activations.dynamic=False"),
    (_with(INPUTS + ("strategy",), "tensor"), "config_groups.group_0.input_activations.strategy='tensor'"),
    (_with(INPUTS + ("symmetric",), False), "config_groups.group_0.input_activations.symmetric=False"),
    (_with(INPUTS + ("type",), "float"), "config_groups.group_0.input_activations.type='float'"),
    (_with(INPUTS, None), "config_groups.group_0.input_activations is None: int8 is supported as W8A8 only"),
    (_with(("format",), "float-quantized"), "quantization_config: format 'float-quantized' and the groups' weight"),
    (_with(("config_groups", "group_0", "output_activations"), {"num_bits": 8}), "output_activations"),
])
def test_checkpoint_quantization_this_engine_does_not_run_is_refused_by_name(
        tiny_llama: Path, tmp_path: Path, config: dict[str, Any], message: str) -> None:
    assert_refused(write_w8a8(tiny_llama, tmp_path)[0], config, message)


def test_the_quantization_argument_must_agree_with_the_checkpoint(tiny_llama: Path, tmp_path: Path) -> None:
    checkpoint, _ = write_w8a8(tiny_llama, tmp_path)
    with pytest.raises(ValueError, match="quantization='int8': the checkpoint is quantized already"):
        make_llm(checkpoint, device="cpu", quantization="int8")
    with pytest.raises(ValueError, match="quantization='compressed-tensors' needs a checkpoint whose config.json"):
        make_llm(tiny_llama, device="cpu", quantization="compressed-tensors")
    with pytest.raises(ValueError, match="quantization_config=.* is not supported"):
        make_llm(checkpoint, device="cpu", model_impl="transformers")
    llm = make_llm(checkpoint, device="cpu", quantization="compressed-tensors")  # vLLM's explicit form
    llm.shutdown()


def test_a_checkpoint_whose_scales_do_not_match_its_weights_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    checkpoint, _ = write_w8a8(tiny_llama, tmp_path)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("k_proj.weight"))
    tensors[name] = tensors[name].float()  # k_proj unquantized beside int8 q_proj / v_proj
    save_file(tensors, str(checkpoint / "model.safetensors"))
    with pytest.raises(ValueError, match="qkv_proj.weight is int8 but mixes int8 and unquantized parts"):
        make_llm(checkpoint, device="cpu")
    tensors[name] = _quantize(tensors[name], "channel")[0]
    del tensors[name + "_scale"]
    save_file(tensors, str(checkpoint / "model.safetensors"))
    with pytest.raises(ValueError, match=r"qkv_proj.weight \(part k\) needs a weight_scale of 1 or \d+ values, "
                                         r"got None"):
        make_llm(checkpoint, device="cpu")
