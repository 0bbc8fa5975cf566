"""MPT (MptForCausalLM, and MosaicML's own `MPTForCausalLM` name: MPT-7B / 30B and their
instruct / chat models): ALiBi (MPT's slope series), LayerNorm without biases, `Wqkv` fused as
[q; k; v] rows, a plain exact-gelu MLP 4x wide, no biases, the LM head tied to the embeddings.
The `attn_config` keys are checked here (config_fields.py classifies the top level)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import HFModelConfig
from vllm_lite.config_fields import COMMON_IGNORED, COMMON_RESTRICTED
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.activation import Gelu
from vllm_lite.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm_lite.model.models.causal_lm import (DecoderForCausalLM, DecoderStack, mapped_name,
                                              refuse_checkpoint_quantization, split_fused_qkv)
from vllm_lite.model.models.llama import LlamaAttention, LlamaForCausalLM

# attn_config key -> the values implemented (None: any value, read or without effect on the math)
ATTN_CONFIG: dict[str, tuple[Any, ...] | None] = {
    "attn_type": ("multihead_attention",), "alibi": (True,), "alibi_bias_max": None, "clip_qkv": (None,),
    "softmax_scale": None, "prefix_lm": (False, None), "qk_ln": (False,), "attn_uses_sequence_id": (False,),
    "attn_pdrop": None, "attn_impl": None,  # (dropout is training-only; attn_impl picks a kernel)
}
_RENAMES = ((".wte.", ".embed_tokens."), (".blocks.", ".layers."), (".attn.out_proj.", ".self_attn.o_proj."),
            (".attn.", ".self_attn."), (".norm_f.", ".norm."))


def check_attn_config(attn_config: dict[str, Any]) -> None:
    """(transformers 5 saves the sub-config whole: its generic keys are the top level's.)"""
    for key, value in attn_config.items():
        if key in COMMON_IGNORED or key in COMMON_RESTRICTED:
            if key in COMMON_RESTRICTED and value not in COMMON_RESTRICTED[key]:
                raise ValueError(f"config.json: attn_config.{key}={value!r} is not supported for MPT")
            continue
        if key not in ATTN_CONFIG:
            raise ValueError(f"config.json: attn_config.{key} is not implemented for MPT; refusing to load "
                             "rather than ignore it")
        allowed = ATTN_CONFIG[key]
        if allowed is not None and value not in allowed:
            raise ValueError(f"config.json: attn_config.{key}={value!r} is not supported for MPT "
                             f"(supported: {', '.join(map(repr, allowed))})")


def mpt_alibi_slopes(num_heads: int, bias_max: float) -> torch.Tensor:
    """MPT's ALiBi slopes (float32 [num_heads]): 2^(-bias_max * i / n) for i = 1..n, n the power
    of two at or above num_heads; when n is larger, the odd terms, then the even ones."""
    n = 2 ** math.ceil(math.log2(num_heads))
    slopes = [2.0 ** (-bias_max * i / n) for i in range(1, n + 1)]
    if n != num_heads:
        slopes = (slopes[1::2] + slopes[::2])[:num_heads]
    return torch.tensor(slopes, dtype=torch.float32)


class MptMLP(nn.Module):
    def __init__(self, config: HFModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(config.hidden_size, 4 * config.hidden_size, False, tp)
        self.down_proj = RowParallelLinear(4 * config.hidden_size, config.hidden_size, False, tp)
        self.act = Gelu("gelu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class MptBlock(nn.Module):
    def __init__(self, config: HFModelConfig, slopes: torch.Tensor, scale: float | None,
                 backend: AttentionBackend, tp: TensorParallelGroup) -> None:
        super().__init__()
        eps = config.raw["layer_norm_epsilon"]
        self.norm_1 = nn.LayerNorm(config.hidden_size, eps=eps, bias=False)
        self.self_attn = LlamaAttention(config, None, backend, tp, qk_norm=False, o_proj_bias=False, scale=scale,
                                        alibi_slopes=slopes)
        self.norm_2 = nn.LayerNorm(config.hidden_size, eps=eps, bias=False)
        self.ffn = MptMLP(config, tp)

    def forward(self, positions, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.norm_1(hidden), kv_cache, attn_metadata)
        return hidden + self.ffn(self.norm_2(hidden))


class MptForCausalLM(DecoderForCausalLM):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping[:3]  # q / k / v (the MLP is not gated)

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        refuse_checkpoint_quantization(config)
        attn_config = config.raw.get("attn_config") or {}
        check_attn_config(attn_config)
        slopes = mpt_alibi_slopes(config.num_attention_heads, attn_config.get("alibi_bias_max", 8))
        scale = attn_config.get("softmax_scale")
        layers = [MptBlock(config, slopes, scale, backend, tp) for _ in range(config.num_hidden_layers)]
        norm = nn.LayerNorm(config.hidden_size, eps=config.raw["layer_norm_epsilon"], bias=False)
        super().__init__(config, DecoderStack(config, layers, norm, tp), tp)

    def split_checkpoint_tensor(self, name: str, weight: Any) -> list[tuple[str, Any]] | None:
        return split_fused_qkv(name, weight, "Wqkv", lambda t: t.chunk(3, dim=0))

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        return mapped_name(name, _RENAMES, self.stacked_params_mapping)
