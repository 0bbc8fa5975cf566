"""How a checkpoint's tensor names map onto a model's parameters: the fused layers' shards
(`stacked_params_mapping`, a family's `map_checkpoint_name`) and the checkpoints that fuse what
the model keeps apart (`split_checkpoint_tensor`). The loader reads a checkpoint through them, and
weight updates (weight_updates.py) and LoRA adapters name their tensors the same way."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

# a checkpoint's buffers that are no weights (recomputed by the model)
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def split_fused(weights: Iterator[tuple[str, Any]], split: Any) -> Iterator[tuple[str, Any]]:
    """A checkpoint that fuses projections (Phi-3's qkv_proj, gate_up_proj) is read as the
    separate tensors the model's weight loaders take: `split(name, weight)` returns them, or
    None for a tensor that is not fused."""
    for name, weight in weights:
        parts = split(name, weight) if split is not None else None
        yield from parts if parts is not None else [(name, weight)]


def checkpoint_target(model: nn.Module, name: str) -> tuple[str, Any]:
    """The model parameter a checkpoint tensor loads into, and its shard id there (None: the
    whole parameter)."""
    hook = getattr(model, "map_checkpoint_name", None)
    mapped = hook(name) if hook is not None else None
    if mapped is not None:
        return mapped
    for ckpt_fragment, param_fragment, shard_id in getattr(model, "stacked_params_mapping", ()):
        if ckpt_fragment in name:
            return name.replace(ckpt_fragment, param_fragment), shard_id
    return name, None
