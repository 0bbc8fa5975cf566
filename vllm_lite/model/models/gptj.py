"""GPT-J (GPTJForCausalLM: GPT-J-6B and its fine-tunes): attention and MLP side by side on one
LayerNorm's output, rotary over the first `rotary_dim` dimensions of each head with neighbouring
pairs turned (GPT-J's rotate_every_two, on the torch path), no attention biases, a gelu MLP
(`fc_in` / `fc_out`) with biases, and an LM head with a bias."""

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

GPTJ_ROTARY_BASE = 10000.0  # (fixed in transformers' GPT-J)
_RENAMES = ((".wte.", ".embed_tokens."), (".h.", ".layers."), (".attn.out_proj.", ".self_attn.o_proj."),
            (".attn.", ".self_attn."), (".ln_f.", ".norm."))
# buffers older checkpoints saved beside the weights (the causal mask, its fill value)
_SKIPPED_BUFFERS = (".attn.bias", ".attn.masked_bias")


class GPTJMLP(nn.Module):
    def __init__(self, config: HFModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.fc_in = ColumnParallelLinear(config.hidden_size, config.intermediate_size, True, tp)
        self.fc_out = RowParallelLinear(config.intermediate_size, config.hidden_size, True, tp)
        self.act = Gelu(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class GPTJBlock(nn.Module):
    def __init__(self, config: HFModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.raw["layer_norm_epsilon"])
        self.self_attn = LlamaAttention(config, rotary, backend, tp, qk_norm=False, o_proj_bias=False)
        self.mlp = GPTJMLP(config, tp)

    def forward(self, positions, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        normed = self.ln_1(hidden)
        return hidden + self.self_attn(positions, normed, kv_cache, attn_metadata) + self.mlp(normed)


class GPTJForCausalLM(DecoderForCausalLM):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping[:3]  # q / k / v (the MLP is not gated)

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        rotary_dim = config.raw.get("rotary_dim") or config.head_dim
        if rotary_dim % 2 or rotary_dim > config.head_dim:
            raise ValueError(f"config.json: rotary_dim={rotary_dim} must be even and at most the head's "
                             f"{config.head_dim} dimensions")
        rotary = RotaryEmbedding(rotary_dim, max_position, GPTJ_ROTARY_BASE, None, interleaved=True)
        layers = [GPTJBlock(config, rotary, backend, tp) for _ in range(config.num_hidden_layers)]
        norm = nn.LayerNorm(config.hidden_size, eps=config.raw["layer_norm_epsilon"])
        super().__init__(config, DecoderStack(config, layers, norm, tp), tp, lm_head_bias=True)

    def split_checkpoint_tensor(self, name: str, weight: Any) -> list[tuple[str, Any]] | None:
        return [] if name.endswith(_SKIPPED_BUFFERS) else None

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        return mapped_name(name, _RENAMES, self.stacked_params_mapping)
