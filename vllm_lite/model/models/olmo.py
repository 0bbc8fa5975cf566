"""OLMo (OlmoForCausalLM: OLMo-1B / 7B, OLMo 1.7): Llama's attention and SiLU-gated MLP with
LayerNorms that have no weight or bias (computed in float32, eps 1e-5, as transformers' OLMo),
q / k / v optionally clamped (`clip_qkv`); the checkpoint names are Llama's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import HFModelConfig
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.rotary import RotaryEmbedding
from vllm_lite.model.models.causal_lm import DecoderForCausalLM, DecoderStack
from vllm_lite.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

OLMO_NORM_EPS = 1e-5  # (fixed in transformers' OlmoLayerNorm)


class OlmoLayerNorm(nn.Module):
    """LayerNorm without a learnable weight or bias, in float32."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.normalized_shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, eps=OLMO_NORM_EPS).to(x.dtype)


class OlmoDecoderLayer(nn.Module):
    def __init__(self, config: HFModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, backend, tp, qk_norm=False, o_proj_bias=True,
                                        clip_qkv=config.raw.get("clip_qkv"))
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = OlmoLayerNorm(config.hidden_size)
        self.post_attention_layernorm = OlmoLayerNorm(config.hidden_size)

    def forward(self, positions, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), kv_cache, attn_metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class OlmoForCausalLM(DecoderForCausalLM):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        rotary = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_scaling)
        layers = [OlmoDecoderLayer(config, rotary, backend, tp) for _ in range(config.num_hidden_layers)]
        super().__init__(config, DecoderStack(config, layers, OlmoLayerNorm(config.hidden_size), tp), tp)
