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
from vllm_lite.model.layers.embedding import VocabParallelEmbedding
from vllm_lite.model.layers.linear import ColumnParallelLinear, RowParallelLinear, materialize
from vllm_lite.model.layers.rotary import RotaryEmbedding
from vllm_lite.model.models.causal_lm import DecoderForCausalLM
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


class FalconModel(nn.Module):
    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        rotary = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(FalconDecoderLayer(config, rotary, backend, tp)
                                    for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.raw["layer_norm_epsilon"])

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], attn_metadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, attn_metadata)
        return self.norm(hidden)


class FalconForCausalLM(DecoderForCausalLM):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping[:3]  # q / k / v (the MLP is not gated)

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        if config.quantization is not None:  # (their packed query_key_value is not read apart)
            raise ValueError(f"config.json: quantization_config ({config.quantization}) is not supported for "
                             "FalconForCausalLM; load the unquantized checkpoint (quantization='int8' quantizes "
                             "it here)")
        super().__init__(config, FalconModel(config, max_position, backend, tp), tp)

    def split_checkpoint_tensor(self, name: str, weight: Any) -> list[tuple[str, Any]] | None:
        prefix, _, kind = name.rpartition(".")
        if not prefix.endswith(".query_key_value"):
            return None
        pieces = self._split_qkv(materialize(weight))
        base = prefix.removesuffix(".query_key_value")
        return [(f"{base}.{part}.{kind}", piece) for part, piece in zip(("q_proj", "k_proj", "v_proj"), pieces)]

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
        if name.startswith("transformer."):
            name = "model." + name.removeprefix("transformer.")
        for fragment, ours in _RENAMES:
            name = name.replace(fragment, ours)
        for fragment, fused, shard in self.stacked_params_mapping:
            if fragment in name:
                return name.replace(fragment, fused), shard
        return name, None
