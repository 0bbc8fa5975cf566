"""Phi-3: the Llama block with fused checkpoint tensors (`qkv_proj` = [q; k; v] rows,
`gate_up_proj` = [gate; up] rows), LongRoPE scaling and an optional sliding window."""

from __future__ import annotations

from typing import Any

from vllm_lite.model.layers.linear import materialize
from vllm_lite.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def split_checkpoint_tensor(self, name: str, weight: Any) -> list[tuple[str, Any]] | None:
        config = self.config
        parts = name.rsplit(".", 2)
        # (an int8 checkpoint's scales: one per row, split as the rows; or one for the whole tensor)
        if len(parts) < 3 or parts[2] not in ("weight", "weight_scale"):
            return None
        prefix, fused, kind = parts
        if fused == "qkv_proj":
            q = config.num_attention_heads * config.head_dim
            kv = config.num_key_value_heads * config.head_dim
            sizes, names = [q, kv, kv], ["q_proj", "k_proj", "v_proj"]
        elif fused == "gate_up_proj":
            sizes, names = [config.intermediate_size] * 2, ["gate_proj", "up_proj"]
        else:
            return None
        tensor = materialize(weight)
        pieces = [tensor] * len(sizes) if tensor.numel() == 1 else tensor.split(sizes, dim=0)
        return [(f"{prefix}.{part_name}.{kind}", piece) for part_name, piece in zip(names, pieces)]
