"""bitsandbytes 4-bit checkpoints (transformers' `BitsAndBytesConfig(load_in_4bit=True)`, as
QLoRA trainers and unsloth's "-bnb-4bit" releases save them), read into float weights.

A quantized linear layer's `weight` holds two 4-bit codes a byte (the first in the high nibble),
each an index into `weight.quant_map` (NF4's or FP4's 16 values), scaled per block of `blocksize`
values by `weight.absmax`; with double quantization (`bnb_4bit_use_double_quant`) the absmax are
themselves 8-bit codes into `weight.nested_quant_map`, scaled per block of `nested_blocksize` by
`weight.nested_absmax`, plus `nested_offset`. The rest of the state (quant type, block sizes, the
weight's shape and dtype) is JSON in `weight.quant_state.bitsandbytes__nf4` (or `__fp4`).
Dequantized at load, as bitsandbytes' own dequantize_4bit computes them (float32 products, then
the weight's dtype): the model then runs as the unquantized one, in its memory (vLLM keeps the
codes and dequantizes in its bitsandbytes kernels; the products it multiplies are these).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

QUANT_STATE_PART = "quant_state.bitsandbytes__"
STATE_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
QUANT_TYPES = ("nf4", "fp4")
STATE_KEYS = frozenset({"quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype",
                        "nested_offset"})


def dequantized_bnb_weights(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with each 4-bit weight and its state replaced by the float weight,
    yielded once the whole checkpoint has been read (a weight's state comes after it)."""
    packed: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, Any]] = {}
    for name, weight in weights:
        prefix, part = _state_part(name)
        if part is not None:
            states.setdefault(prefix, {})[part] = _tensor(weight)
        elif name.endswith(".weight") and _is_packed(weight):
            packed[name] = _tensor(weight)
        else:
            yield name, weight
    orphans = sorted(set(states) - set(packed))
    if orphans:
        raise ValueError(f"checkpoint: {orphans[0]} has a bitsandbytes quant state but no 4-bit weight")
    for name, codes in packed.items():
        yield name, dequantize_4bit(codes, states.get(name, {}), name)
    logger.info("bitsandbytes checkpoint: %d linear layers' 4-bit weights dequantized at load (memory and speed "
                "of the unquantized model)", len(packed))


def dequantize_4bit(codes: torch.Tensor, state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """One layer's float weight from its packed codes and its state tensors (`STATE_PARTS` and the
    `quant_state.bitsandbytes__*` JSON)."""
    meta = _meta(state, name)
    blocksize, shape = meta["blocksize"], tuple(meta["shape"])
    numel = math.prod(shape)
    flat = codes.reshape(-1).view(torch.uint8) if codes.dtype != torch.uint8 else codes.reshape(-1)
    if 2 * flat.numel() < numel:
        raise ValueError(f"checkpoint: {name} holds {2 * flat.numel()} 4-bit codes for a weight of shape {shape}")
    indices = torch.stack([flat >> 4, flat & 0xF], dim=1).reshape(-1)[:numel].long()
    values = _require(state, "quant_map", name).float()[indices]
    absmax = _absmax(state, meta, name)
    num_blocks = -(-numel // blocksize)
    if absmax.numel() != num_blocks:
        raise ValueError(f"checkpoint: {name}.absmax has {absmax.numel()} scales for {num_blocks} blocks of "
                         f"{blocksize}")
    scales = absmax.repeat_interleave(blocksize)[:numel]
    return (values * scales).reshape(shape).to(getattr(torch, meta["dtype"]))


def _absmax(state: dict[str, torch.Tensor], meta: dict[str, Any], name: str) -> torch.Tensor:
    absmax = _require(state, "absmax", name)
    if "nested_absmax" not in state:
        return absmax.float()
    nested_scales = state["nested_absmax"].float()
    nested_codes = _require(state, "nested_quant_map", name).float()[absmax.long()]
    blocks = nested_scales.repeat_interleave(meta["nested_blocksize"])[:absmax.numel()]
    if blocks.numel() != absmax.numel():
        raise ValueError(f"checkpoint: {name}.nested_absmax has too few scales for its {absmax.numel()} absmax")
    return nested_codes * blocks + float(meta["nested_offset"])


def _meta(state: dict[str, Any], name: str) -> dict[str, Any]:
    kinds = [part for part in state if part.startswith(QUANT_STATE_PART)]
    if len(kinds) != 1:
        raise ValueError(f"checkpoint: {name} needs one {name}.{QUANT_STATE_PART}nf4 (or fp4) tensor, found "
                         f"{len(kinds)}")
    meta = json.loads(bytes(state[kinds[0]].numpy()).decode("utf-8"))
    unknown = sorted(set(meta) - STATE_KEYS)
    if unknown:
        raise ValueError(f"checkpoint: {name}'s bitsandbytes quant state has {unknown[0]!r}, not implemented here")
    if meta.get("quant_type") not in QUANT_TYPES or kinds[0] != QUANT_STATE_PART + meta["quant_type"]:
        raise ValueError(f"checkpoint: {name}'s bitsandbytes quant_type {meta.get('quant_type')!r} is not nf4 or fp4")
    if not (isinstance(meta.get("blocksize"), int) and meta["blocksize"] > 0):
        raise ValueError(f"checkpoint: {name}'s bitsandbytes blocksize {meta.get('blocksize')!r} is not a positive int")
    if meta.get("dtype") not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"checkpoint: {name}'s bitsandbytes dtype {meta.get('dtype')!r} is not a float type")
    if ("nested_absmax" in state) != ("nested_blocksize" in meta):
        raise ValueError(f"checkpoint: {name}'s double quantization is incomplete (nested_absmax and "
                         "nested_blocksize go together)")
    return meta


def _state_part(name: str) -> tuple[str, str | None]:
    """(`<layer>.weight`, part) for a weight's state tensor, else (name, None)."""
    for part in STATE_PARTS:
        if name.endswith(".weight." + part):
            return name[: -len(part) - 1], part
    head, found, kind = name.rpartition("." + QUANT_STATE_PART)
    if found:
        return head, QUANT_STATE_PART + kind
    return name, None


def _require(state: dict[str, torch.Tensor], part: str, name: str) -> torch.Tensor:
    if part not in state:
        raise ValueError(f"checkpoint: {name}.{part} is missing (a bitsandbytes 4-bit weight needs it)")
    return state[part]


def _is_packed(weight: Any) -> bool:
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else weight.get_dtype()
    return str(dtype).removeprefix("torch.").upper() in ("UINT8", "U8")


def _tensor(weight: Any) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight[:]
