"""Phi-1.5 / Phi-2 (PhiForCausalLM): attention and MLP side by side on one LayerNorm's output,
x + attn(ln(x)) + mlp(ln(x)); q / k / v / dense with biases, rotary on the first
`partial_rotary_factor` of each head, a plain gelu MLP (`fc1` / `fc2`), a final LayerNorm and an
LM head with a bias."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import HFModelConfig
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.activation import Gelu
from vllm_lite.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm_lite.model.layers.rotary import RotaryEmbedding
from vllm_lite.model.models.causal_lm import DecoderForCausalLM, DecoderStack, mapped_name
from vllm_lite.model.models.llama import LlamaAttention, LlamaForCausalLM

# checkpoint name fragment -> this model's
_RENAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".final_layernorm.", ".norm."))


class PhiMLP(nn.Module):
    def __init__(self, config: HFModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, True, tp)
        self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, True, tp)
        self.act = Gelu(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class PhiDecoderLayer(nn.Module):
    def __init__(self, config: HFModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, backend, tp, qk_norm=False, o_proj_bias=True)
        self.mlp = PhiMLP(config, tp)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.raw["layer_norm_eps"])

    def forward(self, positions, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        return hidden + self.self_attn(positions, normed, kv_cache, attn_metadata) + self.mlp(normed)


class PhiForCausalLM(DecoderForCausalLM):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping[:3]  # q / k / v (the MLP is not gated)

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        rotary = RotaryEmbedding(config.rotary_dim, max_position, config.rope_theta, config.rope_scaling)
        layers = [PhiDecoderLayer(config, rotary, backend, tp) for _ in range(config.num_hidden_layers)]
        norm = nn.LayerNorm(config.hidden_size, eps=config.raw["layer_norm_eps"])
        super().__init__(config, DecoderStack(config, layers, norm, tp), tp, lm_head_bias=True)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        return mapped_name(name, _RENAMES, self.stacked_params_mapping)
