"""OLMo 2: the Llama projections and MLP in a post-norm block (the attention and the MLP each
read the residual stream as it is, and their outputs are normalized before they join it), with
q and k normalized over their whole projection (all heads at once) before rotary."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import HFModelConfig
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.attention import Attention
from vllm_lite.model.layers.linear import QKVParallelLinear, RowParallelLinear, materialize, narrow_loaded
from vllm_lite.model.layers.norm import RMSNorm
from vllm_lite.model.layers.rotary import RotaryEmbedding
from vllm_lite.model.models.causal_lm import DecoderForCausalLM, DecoderStack
from vllm_lite.model.models.llama import LlamaForCausalLM, LlamaMLP


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a projection's full width, which tensor parallelism splits by heads: each rank
    holds its heads' slice of the weight, and the mean square is summed over the ranks."""

    def __init__(self, full_size: int, eps: float, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.full_size, self.eps, self.tp = full_size, eps, tp
        self.weight = nn.Parameter(torch.ones(full_size // tp.size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        size = param.shape[0]
        param.data.copy_(materialize(narrow_loaded(loaded, 0, self.tp.rank * size, size)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        square_sum = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True))
        x32 = x32 * torch.rsqrt(square_sum / self.full_size + self.eps)
        return self.weight * x32.to(x.dtype)


class Olmo2Attention(nn.Module):
    def __init__(self, config: HFModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        d, heads, kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        if kv_heads % tp.size:
            raise ValueError(f"OLMo 2 under tensor_parallel_size={tp.size} needs num_key_value_heads divisible by "
                             f"it (k's norm spans every KV head), got {kv_heads}")
        bias = config.attention_bias
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, heads, kv_heads, bias, tp)
        self.o_proj = RowParallelLinear(heads * d, config.hidden_size, bias, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size, self.head_dim = self.qkv_proj.q_size, self.qkv_proj.kv_size, d
        self.q_norm = ProjectionRMSNorm(heads * d, config.rms_norm_eps, tp)
        self.k_norm = ProjectionRMSNorm(kv_heads * d, config.rms_norm_eps, tp)
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, backend)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(k).view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: HFModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, rotary, backend, tp)
        self.mlp = LlamaMLP(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, attn_metadata))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class Olmo2ForCausalLM(DecoderForCausalLM):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        rotary = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_scaling)
        layers = [Olmo2DecoderLayer(config, rotary, backend, tp) for _ in range(config.num_hidden_layers)]
        super().__init__(config, DecoderStack(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps), tp), tp)
