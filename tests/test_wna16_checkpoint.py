"""AWQ, GPTQ and compressed-tensors pack-quantized checkpoints, written here from the tiny models by
the packers' own rules (AutoAWQ's GEMM order; AutoGPTQ's packing along the input, its v1 zero
points stored minus one, act-order's g_idx; compressed-tensors' offset values packed along the
input, zero points along the output), read back as the float weights they stand for. The
compressed-tensors reading is also checked against the library's own packing and unpacking
(tests/data, written by tools/make_ct_pack_fixture.py). The reference is each tiny model with its
linear weights replaced by exactly those values, (q - z) * s: tokens and logprobs must be
identical, so any packing, order, group or zero-point slip shows.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_factory import make_llm
from quantized_checkpoints import assert_refused, assert_refused_without, write_quantized_pair
from test_int8_checkpoint import _run

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: word position k holds column AWQ_PACK_ORDER[k]
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
               "damp_percent": 0.01, "static_groups": False, "true_sequential": True, "checkpoint_format": "gptq",
               "lm_head": False, "model_name_or_path": None, "model_file_base_name": None}


def _quantize(weight: torch.Tensor, bits: int, groups: torch.Tensor, num_groups: int, sym: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [in, out], zeros [groups, out] (int), scales [groups, out] (fp16) of w [out, in]."""
    w = weight.float().t()  # [in, out]
    top = (1 << bits) - 1
    scales, zeros = [], []
    for g in range(num_groups):
        rows = w[groups == g]
        if sym:
            scale = (rows.abs().amax(0) / ((top + 1) // 2 - 1)).clamp_min(1e-4).half()
            zero = torch.full_like(scale, (top + 1) // 2, dtype=torch.int32)
        else:
            low, high = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scale = ((high - low) / top).clamp_min(1e-4).half()
            zero = torch.round(-low / scale.float()).clamp(1, top).to(torch.int32)  # (>= 1: v1 stores z - 1)
        scales.append(scale)
        zeros.append(zero)
    scales, zeros = torch.stack(scales), torch.stack(zeros)
    q = (torch.round(w / scales[groups].float()) + zeros[groups]).clamp(0, top).to(torch.int32)
    return q, zeros, scales


def _pack_along_input(values: torch.Tensor, bits: int) -> torch.Tensor:
    per_word = 32 // bits
    words = values.view(values.shape[0] // per_word, per_word, values.shape[1])
    return sum(words[:, k, :] << (bits * k) for k in range(per_word)).to(torch.int32)


def _pack_along_output(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    per_word = 32 // bits
    order = order or tuple(range(per_word))
    words = values.view(values.shape[0], values.shape[1] // per_word, per_word)
    return sum(words[:, :, order[k]] << (bits * k) for k in range(per_word)).to(torch.int32)


def write_quantized(model_dir: Path, out_dir: Path, config: dict[str, Any], act_order: bool = False
                    ) -> tuple[Path, Path]:
    """(the quantized checkpoint, the float checkpoint of the weights it stands for)."""
    method, bits, group = config["quant_method"], config["bits"], config["group_size"]
    generator = torch.Generator().manual_seed(0)

    def pack(prefix: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        in_features = weight.shape[1]
        groups = torch.arange(in_features) // group
        if act_order:  # GPTQ's act-order: groups follow a permutation of the input features
            groups = groups[torch.argsort(torch.randperm(in_features, generator=generator))]
        q, zeros, scales = _quantize(weight, bits, groups, in_features // group, config.get("sym", False))
        dequantized = ((q - zeros[groups]).float() * scales[groups].float()).t()
        if method == "awq":
            return {f"{prefix}.qweight": _pack_along_output(q, 4, AWQ_PACK_ORDER),
                    f"{prefix}.qzeros": _pack_along_output(zeros, 4, AWQ_PACK_ORDER),
                    f"{prefix}.scales": scales}, dequantized
        stored = zeros - 1 if config.get("checkpoint_format", "gptq") == "gptq" else zeros
        return {f"{prefix}.qweight": _pack_along_input(q, bits), f"{prefix}.qzeros": _pack_along_output(stored, bits),
                f"{prefix}.g_idx": groups.to(torch.int32), f"{prefix}.scales": scales}, dequantized

    return write_quantized_pair(model_dir, out_dir, config, pack)


# compressed-tensors' W4A16 preset as the library (0.17) writes it, group size 32 for the tiny models
CT_W4A16_CONFIG = {
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 32, "strategy": "group",
                    "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": None,
                    "zp_dtype": None, "observer": "memoryless_minmax", "observer_kwargs": {}},
        "input_activations": None, "output_activations": None, "format": None}},
    "quant_method": "compressed-tensors", "kv_cache_scheme": None, "format": "pack-quantized",
    "quantization_status": "compressed", "global_compression_ratio": None, "ignore": ["lm_head"]}


def _ct_config(symmetric: bool = True, bits: int = 4, strategy: str = "group",
               actorder: str | None = None) -> dict[str, Any]:
    config = copy.deepcopy(CT_W4A16_CONFIG)
    config["config_groups"]["group_0"]["weights"].update(
        num_bits=bits, symmetric=symmetric, strategy=strategy, actorder=actorder,
        group_size=32 if strategy == "group" else None)
    return config


def write_compressed_tensors(model_dir: Path, out_dir: Path, config: dict[str, Any]) -> tuple[Path, Path]:
    """compressed-tensors stores a signed value v as v + 2^(bits-1) and a signed zero point the
    same way: exactly the unsigned q and z of `_quantize` (its symmetric zero is 2^(bits-1))."""
    weights = config["config_groups"]["group_0"]["weights"]
    bits, symmetric = weights["num_bits"], weights["symmetric"]
    generator = torch.Generator().manual_seed(0)

    def pack(prefix: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        in_features = weight.shape[1]
        group = weights["group_size"] or in_features
        groups = torch.arange(in_features) // group
        if weights["actorder"] == "group":
            groups = groups[torch.argsort(torch.randperm(in_features, generator=generator))]
        q, zeros, scales = _quantize(weight, bits, groups, in_features // group, symmetric)
        dequantized = ((q - zeros[groups]).float() * scales[groups].float()).t()
        tensors = {f"{prefix}.weight_packed": _pack_along_input(q.contiguous(), bits).t(),
                   f"{prefix}.weight_scale": scales.t(), f"{prefix}.weight_shape": torch.tensor(list(weight.shape))}
        if not symmetric:  # signed zero points, stored with the values' offset, packed along the output
            tensors[f"{prefix}.weight_zero_point"] = _pack_along_input(zeros.t().contiguous(), bits)
        if weights["actorder"] == "group":
            tensors[f"{prefix}.weight_g_idx"] = groups.to(torch.int32)
        return tensors, dequantized

    return write_quantized_pair(model_dir, out_dir, config, pack)


@pytest.mark.parametrize("name, config, act_order", [
    ("tiny_llama", AWQ_CONFIG, False),
    ("tiny_phi3", AWQ_CONFIG, False),  # fused qkv / gate_up tensors, split after dequantizing
    ("tiny_qwen2", GPTQ_CONFIG, False),  # q / k / v biases beside the quantized weights
    ("tiny_llama", GPTQ_CONFIG, True),
    ("tiny_llama", {**GPTQ_CONFIG, "sym": True, "bits": 8}, False),
    ("tiny_llama", {**GPTQ_CONFIG, "checkpoint_format": "gptq_v2", "desc_act": True}, True),
    ("tiny_llama", _ct_config(), False),
    ("tiny_qwen2", _ct_config(symmetric=False, strategy="channel"), False),
    ("tiny_phi3", _ct_config(symmetric=False, bits=8), False),
    ("tiny_llama", _ct_config(actorder="group"), True),
    # multimodal checkpoints (their language model; the vision side's packed tensors are not read)
    ("tiny_qwen2_5_vl", AWQ_CONFIG, False),
    ("tiny_gemma3_mm", _ct_config(), False),
])
def test_the_checkpoint_runs_as_the_weights_it_stands_for(name: str, config: dict[str, Any], act_order: bool,
                                                          request: pytest.FixtureRequest, tmp_path: Path,
                                                          prompts_token_ids: list[list[int]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer dequantized (the path of layers that do not fit Q4_1 blocks, and of TP > 1)."""
    monkeypatch.setattr("vllm_lite.model.loader.fits_q4_1", lambda *args: False)
    quantized, dequantized = _write(request.getfixturevalue(name), tmp_path, config, act_order)
    prompts = prompts_token_ids[:4]
    assert _run(quantized, prompts, device="auto") == _run(dequantized, prompts, device="auto")  # (CUDA too)


@pytest.mark.parametrize("name, config", [("tiny_llama", AWQ_CONFIG), ("tiny_phi3", AWQ_CONFIG),
                                          ("tiny_qwen2", {**GPTQ_CONFIG, "group_size": 64}),
                                          ("tiny_qwen3", _ct_config(symmetric=False)),
                                          ("tiny_qwen2_5_vl", _ct_config())])
def test_4_bit_layers_stay_in_q4_1_blocks(name: str, config: dict[str, Any], request: pytest.FixtureRequest,
                                          tmp_path: Path, prompts_token_ids: list[list[int]]) -> None:
    """On one rank, 4-bit weights in consecutive groups of a multiple of 32 features stay 4-bit
    (GGUF's Q4_1 blocks and kernels): a sixth of float32's bytes. Their zero points become
    fp16 minimums (m = -z * s), off by under 2^-12 of z * s, so the check is teacher-forced
    logprobs against the exact weights (measured: mean |dlogprob| 0.0026-0.0030; a close greedy step
    may flip on these random models)."""
    from test_reduced_precision import greedy, teacher_forced_logprobs

    from vllm_lite.model.layers.gguf_quant import GGML_TYPE_Q4_1, GGUFWeight
    from vllm_lite.model.layers.linear import LinearBase
    from vllm_lite.model.loader import weight_bytes

    quantized, dequantized = _write(request.getfixturevalue(name), tmp_path, config)
    prompts = prompts_token_ids
    skip = [len(p) for p in prompts]
    reference_llm, kept_llm = make_llm(dequantized, device="cpu"), make_llm(quantized, device="cpu")
    try:
        models = [llm.llm_engine.engine_core.executor.worker.model_runner.model for llm in (reference_llm, kept_llm)]
        linears = [m for m in models[1].modules() if isinstance(m, LinearBase)]
        assert linears and all(isinstance(m.packed_weight, GGUFWeight) and m.packed_weight.qtype == GGML_TYPE_Q4_1
                               for m in linears)
        assert weight_bytes(models[1]) < weight_bytes(models[0])
        reference = greedy(reference_llm, prompts)
        sequences = [p + r for p, r in zip(prompts, reference)]
        diffs = [abs(a - b) for ra, rb in zip(teacher_forced_logprobs(reference_llm, sequences, skip),
                                              teacher_forced_logprobs(kept_llm, sequences, skip))
                 for a, b in zip(ra, rb)]
        print(f"{name}: mean |dlogprob| {sum(diffs) / len(diffs):.5f}")
        assert sum(diffs) / len(diffs) < 0.01, diffs
    finally:
        reference_llm.shutdown()
        kept_llm.shutdown()


def _write(model_dir: Path, out_dir: Path, config: dict[str, Any], act_order: bool = False) -> tuple[Path, Path]:
    if config["quant_method"] == "compressed-tensors":
        return write_compressed_tensors(model_dir, out_dir, config)
    return write_quantized(model_dir, out_dir, config, act_order)


@pytest.mark.parametrize("case", ["sym4_g32", "asym4_g32", "asym4_channel", "sym8_g64", "sym4_g32_actorder"])
def test_compressed_tensors_packing_is_read_as_the_library_unpacks_it(case: str) -> None:
    """tests/data holds layers packed by compressed-tensors' own compressor and its own
    decompression of them (tools/make_ct_pack_fixture.py): the same floats, bit for bit."""
    from safetensors.torch import load_file

    from vllm_lite.model.layers.wna16 import PART_NAMES, WNA16Scheme, dequantize

    stored = load_file(str(Path(__file__).parent / "data" / "compressed_tensors_pack_quantized.safetensors"))
    roles = PART_NAMES["compressed-tensors"]
    parts = {roles[key.split(".", 1)[1]]: value for key, value in stored.items()
             if key.startswith(f"{case}.") and key.split(".", 1)[1] in roles}
    scheme = WNA16Scheme("compressed-tensors", 8 if case.startswith("sym8") else 4, sym=case.startswith("sym"))
    assert torch.equal(dequantize(scheme, parts, case), stored[f"{case}.reference"])


def test_q4_1_blocks_hold_the_checkpoints_values() -> None:
    """The blocks widen (GGUF's own dequantization) to (q - z) * s, up to the fp16 rounding of
    -z * s; an AWQ layer of 2 groups of 64 features."""
    from vllm_lite.model.layers.gguf_quant import GGML_TYPE_Q4_1, dequantize_torch
    from vllm_lite.model.layers.wna16 import WNA16Scheme, dequantize, q4_1_blocks

    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(16, 128, generator=generator)
    q, zeros, scales = _quantize(weight, 4, torch.arange(128) // 64, 2, sym=False)
    parts = {"values": _pack_along_output(q, 4, AWQ_PACK_ORDER), "zeros": _pack_along_output(zeros, 4, AWQ_PACK_ORDER),
             "scales": scales}
    scheme = WNA16Scheme("awq", 4)
    exact = dequantize(scheme, parts, "layer")
    widened = dequantize_torch(q4_1_blocks(scheme, parts, "layer"), GGML_TYPE_Q4_1)
    step = scales.float().repeat_interleave(64, 0).t()
    assert ((widened - exact).abs() <= step / 128).all()
    assert not torch.equal(widened, torch.zeros_like(widened))


def test_the_configs_transformers_saves_are_read(tiny_llama: Path, tmp_path: Path,
                                                prompts_token_ids: list[list[int]]) -> None:
    """transformers 5's AwqConfig / GPTQConfig as save_pretrained writes them (its AWQ config
    carries GPTQ's settings, `sym: true` beside `zero_point: true`): every key classified."""
    import json

    from transformers import AwqConfig, GPTQConfig

    from quantized_checkpoints import set_quantization_config

    for ours, theirs in ((AWQ_CONFIG, AwqConfig(bits=4, group_size=32)),
                         (GPTQ_CONFIG, GPTQConfig(bits=4, group_size=32, sym=False, desc_act=False))):
        quantized, _ = write_quantized(tiny_llama, tmp_path / ours["quant_method"], ours)
        prompts = prompts_token_ids[:1]
        expected = _run(quantized, prompts)
        set_quantization_config(quantized, json.loads(theirs.to_json_string()))
        assert _run(quantized, prompts) == expected


def test_gptq_s_zero_biases_for_layers_without_bias_are_skipped(tiny_llama: Path, tmp_path: Path,
                                                                prompts_token_ids: list[list[int]]) -> None:
    """AutoGPTQ saved a bias for every quantized layer, zeros where the model has none (vLLM's
    loaders skip them); a non-zero one would change the output, so it is refused."""
    from safetensors.torch import load_file, save_file

    quantized, _ = write_quantized(tiny_llama, tmp_path, GPTQ_CONFIG)
    prompts = prompts_token_ids[:2]
    without_biases = _run(quantized, prompts)
    tensors = load_file(str(quantized / "model.safetensors"))
    scales = [name for name in tensors if name.endswith(".scales")]
    tensors.update({name.replace(".scales", ".bias"): torch.zeros(tensors[name].shape[1], dtype=torch.float16)
                    for name in scales})
    save_file(tensors, str(quantized / "model.safetensors"))
    assert _run(quantized, prompts) == without_biases
    tensors[scales[0].replace(".scales", ".bias")][0] = 1.0
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint tensor '.*\.bias' has no matching model parameter"):
        make_llm(quantized, device="cpu")


def test_tensor_parallel_slices_the_dequantized_weights(tiny_llama: Path, tmp_path: Path,
                                                        prompts_token_ids: list[list[int]]) -> None:
    quantized, dequantized = write_quantized(tiny_llama, tmp_path, AWQ_CONFIG)
    tp2 = {"tensor_parallel_size": 2, "multiprocess": True}
    prompts = prompts_token_ids[:2]
    assert _run(quantized, prompts, **tp2) == _run(dequantized, prompts, **tp2)


def _config(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    config = copy.deepcopy(base)
    config.update(changes)
    return config


@pytest.mark.parametrize("config, message", [
    (_config(AWQ_CONFIG, version="gemv"), "quantization_config.version='gemv' is not supported"),
    (_config(AWQ_CONFIG, zero_point=False), "quantization_config.zero_point=False is not supported"),
    (_config(AWQ_CONFIG, bits=3), "quantization_config.bits=3 is not supported"),
    (_config(AWQ_CONFIG, group_size=0), "quantization_config.group_size must be a positive integer or -1"),
    (_config(GPTQ_CONFIG, bits=3), "quantization_config.bits=3 is not supported"),
    (_config(GPTQ_CONFIG, lm_head=True), "quantization_config.lm_head=True is not supported"),
    (_config(GPTQ_CONFIG, checkpoint_format="marlin"), "quantization_config.checkpoint_format='marlin'"),
    (_config(GPTQ_CONFIG, quantize_everything_twice=True), "quantization_config.quantize_everything_twice is not"),
    (_config(GPTQ_CONFIG, quant_method="hqq"), "quantization_config.quant_method='hqq' is not"),
])
def test_what_this_engine_does_not_run_is_refused_by_name(tiny_llama: Path, tmp_path: Path, config: dict[str, Any],
                                                          message: str) -> None:
    assert_refused(write_quantized(tiny_llama, tmp_path, AWQ_CONFIG)[0], config, message)


def test_the_quantization_argument_and_a_missing_part(tiny_llama: Path, tmp_path: Path) -> None:
    quantized, _ = write_quantized(tiny_llama, tmp_path, AWQ_CONFIG)
    make_llm(quantized, device="cpu", quantization="awq_marlin").shutdown()  # vLLM's name for its kernel
    with pytest.raises(ValueError, match="quantization='gptq': the checkpoint is quantized already"):
        make_llm(quantized, device="cpu", quantization="gptq")
    assert_refused_without(quantized, "down_proj.qzeros", r"down_proj lacks \['qzeros'\] beside its other awq tensors")


def test_off_the_cpu_checkpoints_load_as_float_weights_and_int8_kernels_are_refused(tiny_llama: Path,
                                                                                   tmp_path: Path) -> None:
    """On CUDA a quantized checkpoint runs on the float weights it stands for (no Q4_1 blocks:
    those kernels are the CPU's; the dequantize-everything load is the one tensor-parallel ranks
    take, tested above); what needs the CPU's int8 matmuls is refused by name. The config alone:
    no GPU needed."""
    from test_fp8_checkpoint import write_fp8
    from test_int8_checkpoint import write_w8a8

    from vllm_lite.config import EngineArgs

    def quantization_on_cuda(model: Path, **args: Any) -> str | None:
        return EngineArgs(model=str(model), device="cuda", **args).create_engine_config().model_config.quantization

    assert quantization_on_cuda(write_quantized(tiny_llama, tmp_path / "awq", AWQ_CONFIG)[0]) == "awq"
    assert quantization_on_cuda(write_fp8(tiny_llama, tmp_path / "fp8", "fp8 blocks")[0]) == "fp8"
    with pytest.raises(ValueError, match=r"int-quantized \(W8A8 int8\) checkpoint runs on CPU only here"):
        quantization_on_cuda(write_w8a8(tiny_llama, tmp_path / "w8a8")[0])
    with pytest.raises(ValueError, match="quantization='int8' runs on CPU only here"):
        quantization_on_cuda(tiny_llama, quantization="int8")
