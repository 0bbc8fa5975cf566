"""FP8 checkpoints, written here from the tiny models in each layout a vLLM user brings: vLLM's
offline fp8 (one `weight_scale` per tensor, static `input_scale`), the block form of DeepSeek's
and Qwen's FP8 releases (`weight_scale_inv` per block of `weight_block_size`), and
compressed-tensors' float-quantized format (per channel, per block, weight-only). Each is read
back as the float weights it stands for, q * s: tokens and logprobs must equal those of the tiny
model with exactly those weights.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_factory import make_llm
from quantized_checkpoints import assert_refused, assert_refused_without, write_quantized_pair
from test_int8_checkpoint import W8A8_CONFIG, _run

E4M3_MAX = 448.0
BLOCK = (32, 32)


def _ct_config(strategy: str, inputs: dict[str, Any] | None) -> dict[str, Any]:
    config = copy.deepcopy(W8A8_CONFIG)
    config["format"] = "float-quantized"
    group = config["config_groups"]["group_0"]
    group["weights"].update(type="float", strategy=strategy,
                            block_structure=list(BLOCK) if strategy == "block" else None)
    group["input_activations"] = inputs
    return config


CT_TOKEN_INPUTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True,
                   "group_size": None, "block_structure": None, "actorder": None, "observer": None}
CT_GROUP_INPUTS = {**CT_TOKEN_INPUTS, "strategy": "group", "group_size": 128}
LAYOUTS: dict[str, tuple[dict[str, Any], str, str]] = {  # quantization_config, scale strategy, scale name
    "fp8 per tensor, static inputs": ({"quant_method": "fp8", "activation_scheme": "static", "fmt": "e4m3",
                                       "ignored_layers": ["lm_head"]}, "tensor", "weight_scale"),
    "fp8 blocks": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": list(BLOCK)}, "block", "weight_scale_inv"),
    "compressed-tensors per channel": (_ct_config("channel", CT_TOKEN_INPUTS), "channel", "weight_scale"),
    "compressed-tensors blocks": (_ct_config("block", CT_GROUP_INPUTS), "block", "weight_scale"),
    "compressed-tensors weight-only": (_ct_config("tensor", None), "tensor", "weight_scale"),
}


def _quantize(weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, its scale as stored, the float weight q * s)."""
    w = weight.float()
    out_features, in_features = w.shape
    if strategy == "tensor":
        scale = (w.abs().amax() / E4M3_MAX).reshape(1)
        expanded = scale.reshape(1, 1)
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        expanded = scale
    else:
        rows, columns = -(-out_features // BLOCK[0]), -(-in_features // BLOCK[1])
        padded = torch.zeros(rows * BLOCK[0], columns * BLOCK[1])
        padded[:out_features, :in_features] = w.abs()
        scale = padded.view(rows, BLOCK[0], columns, BLOCK[1]).amax(dim=(1, 3)) / E4M3_MAX
        expanded = scale.repeat_interleave(BLOCK[0], 0)[:out_features].repeat_interleave(BLOCK[1], 1)[:, :in_features]
    q = (w / expanded.clamp_min(1e-12)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.contiguous(), q.float() * expanded


def write_fp8(model_dir: Path, out_dir: Path, layout: str) -> tuple[Path, Path]:
    """(the FP8 checkpoint in `layout`, the float checkpoint of the weights it stands for)."""
    config, strategy, scale_name = LAYOUTS[layout]

    def pack(prefix: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q, scale, dequantized = _quantize(weight, strategy)
        tensors = {f"{prefix}.weight": q, f"{prefix}.{scale_name}": scale}
        if config.get("activation_scheme") == "static":
            tensors[f"{prefix}.input_scale"] = torch.tensor([0.05])
        return tensors, dequantized

    return write_quantized_pair(model_dir, out_dir, config, pack)


@pytest.mark.parametrize("name, layout", [
    ("tiny_llama", "fp8 per tensor, static inputs"),
    ("tiny_llama", "fp8 blocks"),
    ("tiny_phi3", "fp8 blocks"),  # fused qkv / gate_up: dequantized whole, then split
    ("tiny_qwen3", "compressed-tensors per channel"),
    ("tiny_qwen2", "compressed-tensors blocks"),
    ("tiny_llama", "compressed-tensors weight-only"),
])
def test_the_checkpoint_runs_as_the_weights_it_stands_for(name: str, layout: str, request: pytest.FixtureRequest,
                                                          tmp_path: Path, prompts_token_ids: list[list[int]]) -> None:
    quantized, dequantized = write_fp8(request.getfixturevalue(name), tmp_path, layout)
    prompts = prompts_token_ids[:4]
    assert _run(quantized, prompts, device="auto") == _run(dequantized, prompts, device="auto")  # (CUDA too)


def test_tensor_parallel_slices_the_dequantized_weights(tiny_llama: Path, tmp_path: Path,
                                                        prompts_token_ids: list[list[int]]) -> None:
    quantized, dequantized = write_fp8(tiny_llama, tmp_path, "fp8 blocks")
    tp2 = {"tensor_parallel_size": 2, "multiprocess": True}
    prompts = prompts_token_ids[:2]
    assert _run(quantized, prompts, **tp2) == _run(dequantized, prompts, **tp2)


def _edited(layout: str, path: tuple[str, ...], value: Any) -> dict[str, Any]:
    config = copy.deepcopy(LAYOUTS[layout][0])
    node = config
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return config


WEIGHTS = ("config_groups", "group_0", "weights")


@pytest.mark.parametrize("config, message", [
    (_edited("fp8 blocks", ("fmt",), "e5m2"), "quantization_config.fmt='e5m2' is not supported"),
    (_edited("fp8 blocks", ("weight_block_size",), [128]), "quantization_config.weight_block_size must be two"),
    (_edited("fp8 blocks", ("activation_scheme",), "per_head"), "quantization_config.activation_scheme='per_head'"),
    (_edited("fp8 blocks", ("kv_cache_quant_method",), "fp8"), "quantization_config.kv_cache_quant_method is not"),
    (_edited("compressed-tensors blocks", WEIGHTS + ("block_structure",), None),
     "weights.block_structure=None does not fit strategy 'block'"),
    (_edited("compressed-tensors per channel", WEIGHTS + ("strategy",), "group"), "weights.strategy='group'"),
    (_edited("compressed-tensors per channel", WEIGHTS + ("num_bits",), 4), "weights.num_bits=4 is not supported"),
    (_edited("compressed-tensors per channel", ("kv_cache_scheme",), {"type": "float"}), "kv_cache_scheme="),
])
def test_what_this_engine_does_not_run_is_refused_by_name(tiny_llama: Path, tmp_path: Path, config: dict[str, Any],
                                                          message: str) -> None:
    assert_refused(write_fp8(tiny_llama, tmp_path, "fp8 blocks")[0], config, message)


def test_quantization_fp8_needs_an_fp8_checkpoint_and_every_weight_its_scale(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization='fp8' needs a checkpoint whose config.json has a fp8"):
        make_llm(tiny_llama, device="cpu", quantization="fp8")
    quantized, _ = write_fp8(tiny_llama, tmp_path, "fp8 blocks")
    make_llm(quantized, device="cpu", quantization="fp8").shutdown()
    assert_refused_without(quantized, "o_proj.weight_scale_inv", r"o_proj.weight is fp8 without a weight_scale")
