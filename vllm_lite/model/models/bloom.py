"""Bloom (BloomForCausalLM: BLOOM, BLOOMZ): no position embeddings but ALiBi (each head's scores
gain slope * key position), a LayerNorm right after the word embeddings, pre-norm LayerNorm blocks,
`query_key_value` fused per head ([head][q, k, v][head_dim], read apart as GPT-NeoX's), a plain
gelu-tanh MLP, biases everywhere, the LM head tied to the embeddings. ALiBi runs on the CPU
attention backends' torch paths (attention/torch_backend.py)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import HFModelConfig
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.activation import Gelu
from vllm_lite.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm_lite.model.models.causal_lm import (DecoderForCausalLM, DecoderStack, mapped_name,
                                              refuse_checkpoint_quantization, split_fused_qkv)
from vllm_lite.model.models.gpt_neox import per_head_qkv
from vllm_lite.model.models.llama import LlamaAttention, LlamaForCausalLM

# checkpoint name fragment -> this model's (after the `transformer.` prefix became `model.`)
_RENAMES = ((".word_embeddings.", ".embed_tokens."), (".word_embeddings_layernorm.", ".embed_layernorm."),
            (".h.", ".layers."), (".self_attention.dense.", ".self_attn.o_proj."),
            (".self_attention.", ".self_attn."), (".ln_f.", ".norm."))


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes (float32 [num_heads]): a geometric series from 2^(-8 / n) for the
    largest power of two n <= num_heads, then every other term of the next power's series."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 / closest * power) for power in range(1, closest + 1)]
    extra = [2.0 ** (-4.0 / closest * power) for power in range(1, 2 * (num_heads - closest), 2)]
    return torch.tensor(slopes + extra[: num_heads - closest], dtype=torch.float32)


class BloomMLP(nn.Module):
    def __init__(self, config: HFModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, 4 * config.hidden_size, True, tp)
        self.dense_4h_to_h = RowParallelLinear(4 * config.hidden_size, config.hidden_size, True, tp)
        self.act = Gelu("gelu_pytorch_tanh")  # (Bloom's own gelu: the tanh form)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class BloomBlock(nn.Module):
    def __init__(self, config: HFModelConfig, slopes: torch.Tensor, backend: AttentionBackend,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        eps = config.raw["layer_norm_epsilon"]
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = LlamaAttention(config, None, backend, tp, qk_norm=False, o_proj_bias=True,
                                        alibi_slopes=slopes)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = BloomMLP(config, tp)

    def forward(self, positions, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), kv_cache, attn_metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class BloomForCausalLM(DecoderForCausalLM):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping[:3]  # q / k / v (the MLP is not gated)

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        refuse_checkpoint_quantization(config)
        eps = config.raw["layer_norm_epsilon"]
        slopes = alibi_slopes(config.num_attention_heads)
        layers = [BloomBlock(config, slopes, backend, tp) for _ in range(config.num_hidden_layers)]
        stack = DecoderStack(config, layers, nn.LayerNorm(config.hidden_size, eps=eps), tp,
                             embed_layernorm=nn.LayerNorm(config.hidden_size, eps=eps))
        super().__init__(config, stack, tp)

    def split_checkpoint_tensor(self, name: str, weight: Any) -> list[tuple[str, Any]] | None:
        return split_fused_qkv(name, weight, "query_key_value",
                               lambda t: per_head_qkv(t, self.config.num_attention_heads, self.config.head_dim))

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name  # (bigscience's own checkpoints: a BloomModel's names)
        return mapped_name(name, _RENAMES, self.stacked_params_mapping)
