"""Falcon (FalconForCausalLM: Falcon-7B / 40B / 180B / 11B): rotary attention whose fused
`query_key_value` is laid out one of three ways, LayerNorm blocks with attention and MLP side by
side (`parallel_attn`, one or two norms) or in sequence, a plain gelu MLP, biases per `bias`.

| config | key / value heads | query_key_value rows |
|---|---|---|
| new_decoder_architecture (40B, 180B, 11B) | num_kv_heads | per KV group: [its queries, k, v] |
| multi_query (7B) | 1 | [all queries; k; v] |
| neither | num_kv_heads (all heads) | per head: [q, k, v] |

They are read apart into the q / k / v shards of the attention's QKV layer, so tensor
parallelism slices them as any model's. ALiBi Falcons (falcon-rw) are refused by name."""

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
from vllm_lite.model.models.causal_lm import (DecoderForCausalLM, DecoderStack, mapped_name,
                                              refuse_checkpoint_quantization, split_fused_qkv)
from vllm_lite.model.models.gpt_neox import per_head_qkv
from vllm_lite.model.models.llama import LlamaAttention, LlamaForCausalLM

# checkpoint name fragment -> this model's (after the `transformer.` prefix became `model.`)
_RENAMES = ((".word_embeddings.", ".embed_tokens."), (".h.", ".layers."),
            (".self_attention.dense.", ".self_attn.o_proj."), (".self_attention.", ".self_attn."),
            (".ln_f.", ".norm."))


class FalconMLP(nn.Module):
    def __init__(self, config: HFModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        bias = config.attention_bias  # (`bias`, read for every projection)
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias, tp)
        self.dense_4h_to_h = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, tp)
        self.act = Gelu(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    def __init__(self, config: HFModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        raw, hidden, eps = config.raw, config.hidden_size, config.raw["layer_norm_epsilon"]
        self.new_architecture = bool(raw["new_decoder_architecture"])
        self.parallel = bool(raw["parallel_attn"])
        self.self_attn = LlamaAttention(config, rotary, backend, tp, qk_norm=False, o_proj_bias=True)
        self.mlp = FalconMLP(config, tp)
        two_norms = self.parallel and self.new_architecture and raw["num_ln_in_parallel_attn"] == 2
        self.ln_attn = nn.LayerNorm(hidden, eps=eps) if two_norms else None
        self.ln_mlp = nn.LayerNorm(hidden, eps=eps) if two_norms else None
        self.input_layernorm = None if two_norms else nn.LayerNorm(hidden, eps=eps)
        self.post_attention_layernorm = None if self.parallel else nn.LayerNorm(hidden, eps=eps)

    def forward(self, positions, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        if self.ln_attn is not None:
            attn_in, mlp_in = self.ln_attn(hidden), self.ln_mlp(hidden)
        else:
            attn_in = mlp_in = self.input_layernorm(hidden)
        attended = self.self_attn(positions, attn_in, kv_cache, attn_metadata)
        if self.post_attention_layernorm is None:  # attention and MLP side by side
            return hidden + attended + self.mlp(mlp_in)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class FalconForCausalLM(DecoderForCausalLM):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping[:3]  # q / k / v (the MLP is not gated)

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        refuse_checkpoint_quantization(config)
        rotary = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_scaling)
        layers = [FalconDecoderLayer(config, rotary, backend, tp) for _ in range(config.num_hidden_layers)]
        norm = nn.LayerNorm(config.hidden_size, eps=config.raw["layer_norm_epsilon"])
        super().__init__(config, DecoderStack(config, layers, norm, tp), tp)

    def split_checkpoint_tensor(self, name: str, weight: Any) -> list[tuple[str, Any]] | None:
        return split_fused_qkv(name, weight, "query_key_value", self._split_qkv)

    def _split_qkv(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        config = self.config
        heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        if config.raw["new_decoder_architecture"]:
            grouped = tensor.reshape(kv_heads, heads // kv_heads + 2, d, *tensor.shape[1:])
            q = grouped[:, :-2].reshape(-1, *tensor.shape[1:])
            return q, grouped[:, -2].reshape(-1, *tensor.shape[1:]), grouped[:, -1].reshape(-1, *tensor.shape[1:])
        if kv_heads == 1:  # multi_query
            return tensor.split([heads * d, d, d], dim=0)
        return per_head_qkv(tensor, heads, d)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        return mapped_name(name, _RENAMES, self.stacked_params_mapping)
