"""Writes quantized checkpoints of the tiny models (and of the demo model, for
benchmarks/quantized_checkpoints.py): each linear layer's float weight handed to a packer that
follows the format's own rules, beside a float checkpoint of exactly the weights the quantized
one stands for (the reference the loaders must reproduce)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                "gate_up_proj")
# (a linear layer's checkpoint prefix, its float weight) -> (the layer's tensors in the quantized
# checkpoint, the float weight they stand for)
Packer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def write_quantized_pair(model_dir: Path, out_dir: Path, config: dict[str, Any], pack: Packer
                         ) -> tuple[Path, Path]:
    """(`out_dir/quantized`: the checkpoint with `config` as its quantization_config,
    `out_dir/float`: the float checkpoint of the weights it stands for)."""
    quantized_dir, float_dir = out_dir / "quantized", out_dir / "float"
    for directory in (quantized_dir, float_dir):
        shutil.copytree(model_dir, directory)
        for path in directory.glob("*.safetensors"):
            path.unlink()
        (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            prefix, _, kind = name.rpartition(".")
            if prefix.rpartition(".")[2] in LINEAR_NAMES and kind == "weight":
                tensors, dequantized[name] = pack(prefix, tensor)
                quantized.update({key: value.contiguous() for key, value in tensors.items()})
            else:
                quantized[name] = dequantized[name] = tensor
    save_file(quantized, str(quantized_dir / "model.safetensors"))
    save_file(dequantized, str(float_dir / "model.safetensors"))
    set_quantization_config(quantized_dir, config)
    return quantized_dir, float_dir


def set_quantization_config(checkpoint: Path, config: dict[str, Any]) -> None:
    raw = json.loads((checkpoint / "config.json").read_text())
    raw["quantization_config"] = config
    (checkpoint / "config.json").write_text(json.dumps(raw))


def assert_refused(checkpoint: Path, config: dict[str, Any], message: str) -> None:
    """Loading `checkpoint` with `config` as its quantization_config stops with `message`."""
    from llm_factory import make_llm

    set_quantization_config(checkpoint, config)
    with pytest.raises(ValueError, match=f"config.json: .*{re.escape(message)}"):
        make_llm(checkpoint, device="cpu")


def assert_refused_without(checkpoint: Path, suffix: str, message: str) -> None:
    """Loading `checkpoint` with its first tensor whose name ends in `suffix` removed stops with
    `message` (a regular expression)."""
    from llm_factory import make_llm

    tensors = load_file(str(checkpoint / "model.safetensors"))
    del tensors[next(name for name in tensors if name.endswith(suffix))]
    save_file(tensors, str(checkpoint / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        make_llm(checkpoint, device="cpu")


# MXFP4's e2m1 values by their 4-bit code (OCP Microscaling: sign bit, 2 exponent bits, 1 mantissa bit)
FP4_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                    "model.layers.*.mlp.router",
                                                                    "model.embed_tokens", "lm_head"]}


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-oss's expert weight [experts, in, out] as its released checkpoints store it: blocks
    [experts, out, in / 32, 16] (two codes a byte, the even element in the low nibble) and scales
    [experts, out, in / 32] (e8m0: the exponent + 127), each group of 32 scaled so its largest
    value fits 6.0; and the float weight they stand for."""
    rows = weight.transpose(1, 2).float()
    experts, out, width = rows.shape
    groups = rows.reshape(experts, out, width // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(2.0 ** -100) / 6.0)).clamp(-127, 127)
    scale = torch.pow(2.0, exponent).unsqueeze(-1)
    codes = ((groups / scale).unsqueeze(-1) - FP4_E2M1).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    dequantized = (FP4_E2M1[codes.long()] * scale).reshape(experts, out, width).transpose(1, 2)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous(), dequantized.contiguous()


def write_mxfp4_pair(model_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    """A gpt-oss checkpoint's experts in MXFP4 (`out_dir/quantized`, MXFP4_CONFIG) and the float
    checkpoint of the weights they stand for (`out_dir/float`)."""
    quantized_dir, float_dir = out_dir / "quantized", out_dir / "float"
    for directory in (quantized_dir, float_dir):
        shutil.copytree(model_dir, directory)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, dequantized[name] = pack_mxfp4(tensor)
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        else:
            quantized[name] = dequantized[name] = tensor
    save_file(quantized, str(quantized_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(float_dir / "model.safetensors"), metadata={"format": "pt"})
    set_quantization_config(quantized_dir, MXFP4_CONFIG)
    return quantized_dir, float_dir
