"""GPT-NeoX (Pythia, Dolly v2, RedPajama-INCITE, StableLM-Alpha): multi-head attention whose
rotary turns only the first `rotary_pct` of each head, LayerNorm with biases before attention and
before a plain MLP (`dense_h_to_4h` -> gelu -> `dense_4h_to_h`), and by default the parallel
residual: both branches read the same input, x + attn(ln1(x)) + mlp(ln2(x)).

The checkpoint fuses q, k and v per head (`query_key_value` rows are [head][q, k, v][head_dim]);
they are read apart into the q / k / v shards of the attention's QKV layer, so tensor
parallelism slices them as any model's."""

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
from vllm_lite.model.models.llama import LlamaAttention, LlamaForCausalLM

# checkpoint name fragment -> this model's (the rest of the names are the checkpoint's own)
_RENAMES = (("embed_out.", "lm_head."), (".embed_in.", ".embed_tokens."),
            (".attention.dense.", ".self_attn.o_proj."), (".attention.", ".self_attn."),
            (".final_layer_norm.", ".norm."))
# buffers older checkpoints saved beside the weights (the causal mask, its fill value)
_SKIPPED_BUFFERS = (".attention.bias", ".attention.masked_bias")


def per_head_qkv(tensor: torch.Tensor, num_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """q, k, v of a projection whose rows are [head][q, k, v][head_dim] (GPT-NeoX's, Bloom's and
    multi-head GPTBigCode's query_key_value / c_attn), each [num_heads * head_dim, ...]."""
    per_head = tensor.reshape(num_heads, 3, head_dim, *tensor.shape[1:])
    return tuple(per_head[:, i].reshape(-1, *tensor.shape[1:]) for i in range(3))


class GPTNeoXMLP(nn.Module):
    def __init__(self, config: HFModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, config.intermediate_size, True, tp)
        self.dense_4h_to_h = RowParallelLinear(config.intermediate_size, config.hidden_size, True, tp)
        self.act = Gelu(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config: HFModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        eps = config.raw["layer_norm_eps"]
        self.parallel_residual = bool(config.raw["use_parallel_residual"])
        self.self_attn = LlamaAttention(config, rotary, backend, tp, qk_norm=False, o_proj_bias=True)
        self.mlp = GPTNeoXMLP(config, tp)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)

    def forward(self, positions, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, attn_metadata)
        if self.parallel_residual:
            return hidden + attended + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class GPTNeoXForCausalLM(DecoderForCausalLM):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping[:3]  # q / k / v (the MLP is not gated)

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        refuse_checkpoint_quantization(config)
        rotary = RotaryEmbedding(config.rotary_dim, max_position, config.rope_theta, config.rope_scaling)
        layers = [GPTNeoXLayer(config, rotary, backend, tp) for _ in range(config.num_hidden_layers)]
        norm = nn.LayerNorm(config.hidden_size, eps=config.raw["layer_norm_eps"])
        super().__init__(config, DecoderStack(config, layers, norm, tp), tp)

    def split_checkpoint_tensor(self, name: str, weight: Any) -> list[tuple[str, Any]] | None:
        """query_key_value's rows, [heads][q, k, v][head_dim], as the q / k / v tensors; older
        checkpoints' attention-mask buffers dropped."""
        if name.endswith(_SKIPPED_BUFFERS):
            return []
        return split_fused_qkv(name, weight, "query_key_value",
                               lambda t: per_head_qkv(t, self.config.num_attention_heads, self.config.head_dim))

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        return mapped_name(name.replace("gpt_neox.", "model.", 1), _RENAMES, self.stacked_params_mapping)
