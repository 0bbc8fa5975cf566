from __future__ import annotations

from vllm_lite.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with per-head RMSNorm on q and k before rotary (and an explicit head_dim)."""

    qk_norm = True
