from __future__ import annotations

from vllm_lite.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v biases (`attention_bias` is read as True for Qwen2 configs) and no
    o_proj bias."""

    o_proj_bias = False
