"""Phi-3: the Llama block with fused checkpoint tensors (`qkv_proj` = [q; k; v] rows,
`gate_up_proj` = [gate; up] rows), LongRoPE scaling and an optional sliding window."""

from __future__ import annotations

from typing import Any

from vllm_lite.model.layers.linear import materialize
from vllm_lite.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def split_checkpoint_tensor(self, name: str, weight: Any) -> list[tuple[str, Any]] | None:
        config = self.config
        if name.endswith(".qkv_proj.weight"):
            q = config.num_attention_heads * config.head_dim
            kv = config.num_key_value_heads * config.head_dim
            sizes, names = [q, kv, kv], ["q_proj", "k_proj", "v_proj"]
        elif name.endswith(".gate_up_proj.weight"):
            sizes, names = [config.intermediate_size] * 2, ["gate_proj", "up_proj"]
        else:
            return None
        prefix = name.rsplit(".", 2)[0]
        parts = materialize(weight).split(sizes, dim=0)
        return [(f"{prefix}.{part_name}.weight", part) for part_name, part in zip(names, parts)]
