"""StableLM (StableLmForCausalLM: StableLM 2, StableLM-3B-4E1T, StableLM Zephyr): Llama's
attention (GQA, q/k/v biases per `use_qkv_bias`) and SiLU-gated MLP with LayerNorm instead of
RMSNorm, rotary on the first `partial_rotary_factor` of each head, and optionally the parallel
residual (`use_parallel_residual`: x + attn(ln(x)) + mlp(ln(x)), one norm per layer). The
checkpoint names are Llama's."""

from __future__ import annotations

import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import HFModelConfig
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.rotary import RotaryEmbedding
from vllm_lite.model.models.causal_lm import DecoderForCausalLM, DecoderStack
from vllm_lite.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class StableLmDecoderLayer(nn.Module):
    def __init__(self, config: HFModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        eps = config.raw["layer_norm_eps"]
        self.self_attn = LlamaAttention(config, rotary, backend, tp, qk_norm=False, o_proj_bias=False)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.parallel_residual = bool(config.raw["use_parallel_residual"])
        # (transformers builds no second norm for the parallel residual)
        self.post_attention_layernorm = None if self.parallel_residual else nn.LayerNorm(config.hidden_size, eps=eps)

    def forward(self, positions, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        attended = self.self_attn(positions, normed, kv_cache, attn_metadata)
        if self.post_attention_layernorm is None:
            return hidden + attended + self.mlp(normed)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class StableLmForCausalLM(DecoderForCausalLM):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        rotary = RotaryEmbedding(config.rotary_dim, max_position, config.rope_theta, config.rope_scaling)
        layers = [StableLmDecoderLayer(config, rotary, backend, tp) for _ in range(config.num_hidden_layers)]
        norm = nn.LayerNorm(config.hidden_size, eps=config.raw["layer_norm_eps"])
        super().__init__(config, DecoderStack(config, layers, norm, tp), tp)
