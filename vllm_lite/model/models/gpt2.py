"""GPT-2 (GPT2LMHeadModel) and GPTBigCode (SantaCoder, StarCoder 1, tiny_starcoder): learned
absolute positions (`wpe`), pre-norm LayerNorm blocks, attention without rotary and a plain gelu
MLP (`c_fc` / `c_proj`), biases everywhere, the LM head tied to `wte`. GPTBigCode's attention is
multi-query when `multi_query` (one key / value head).

The checkpoints fuse q, k and v in `c_attn`: GPT-2 as [q; k; v] rows of a Conv1D (stored
[in, out], as all its projections, so they are transposed on reading), GPTBigCode as [q; k; v]
rows (multi-query) or per head [head][q, k, v][head_dim]. They are read apart into the q / k / v
shards of the attention's QKV layer, so tensor parallelism slices them as any model's. GPT-2's
own checkpoints name tensors without the `transformer.` prefix."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import HFModelConfig
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.activation import Gelu
from vllm_lite.model.layers.linear import ColumnParallelLinear, RowParallelLinear, materialize
from vllm_lite.model.models.causal_lm import (DecoderForCausalLM, DecoderStack, mapped_name,
                                              refuse_checkpoint_quantization, split_fused_qkv)
from vllm_lite.model.models.gpt_neox import per_head_qkv
from vllm_lite.model.models.llama import LlamaAttention, LlamaForCausalLM

# checkpoint name fragment -> this model's (after the `transformer.` prefix became `model.`)
_RENAMES = ((".wte.", ".embed_tokens."), (".wpe.weight", ".embed_positions"), (".h.", ".layers."),
            (".attn.c_proj.", ".self_attn.o_proj."), (".attn.", ".self_attn."), (".ln_f.", ".norm."))
# buffers older checkpoints saved beside the weights (the causal mask, its fill value)
_SKIPPED_BUFFERS = (".attn.bias", ".attn.masked_bias")
_CONV1D_LAYERS = (".attn.c_attn", ".attn.c_proj", ".mlp.c_fc", ".mlp.c_proj")


class GPTMLP(nn.Module):
    def __init__(self, config: HFModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(config.hidden_size, config.intermediate_size, True, tp)
        self.c_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, True, tp)
        self.act = Gelu(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, config: HFModelConfig, backend: AttentionBackend, tp: TensorParallelGroup) -> None:
        super().__init__()
        eps = config.raw["layer_norm_epsilon"]
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = LlamaAttention(config, None, backend, tp, qk_norm=False, o_proj_bias=True)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPTMLP(config, tp)

    def forward(self, positions, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.ln_1(hidden), kv_cache, attn_metadata)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2LMHeadModel(DecoderForCausalLM):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping[:3]  # q / k / v (the MLP is not gated)
    conv1d = True  # GPT-2 stores its projections [in, out]

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        refuse_checkpoint_quantization(config)
        layers = [GPTBlock(config, backend, tp) for _ in range(config.num_hidden_layers)]
        norm = nn.LayerNorm(config.hidden_size, eps=config.raw["layer_norm_epsilon"])
        super().__init__(config, DecoderStack(config, layers, norm, tp, learned_positions=True), tp)

    def split_checkpoint_tensor(self, name: str, weight: Any) -> list[tuple[str, Any]] | None:
        """Older checkpoints' attention-mask buffers dropped; Conv1D weights transposed; c_attn
        read apart into q / k / v."""
        if name.endswith(_SKIPPED_BUFFERS):
            return []
        layer, _, kind = name.rpartition(".")
        if not layer.endswith(_CONV1D_LAYERS):
            return None
        tensor = materialize(weight)
        if self.conv1d and kind == "weight":
            tensor = tensor.t().contiguous()
        return split_fused_qkv(name, tensor, "c_attn", self.split_qkv) or [(name, tensor)]

    def split_qkv(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """c_attn's rows [q; k; v]."""
        q_size = self.config.num_attention_heads * self.config.head_dim
        kv_size = self.config.num_key_value_heads * self.config.head_dim
        return tensor.split([q_size, kv_size, kv_size], dim=0)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name  # (GPT-2's own checkpoints: a GPT2Model's names)
        return mapped_name(name, _RENAMES, self.stacked_params_mapping)


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    conv1d = False

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        heads = 1 if config.raw["multi_query"] else config.num_attention_heads
        if config.num_key_value_heads != heads:
            raise ValueError(f"config.json: num_key_value_heads={config.num_key_value_heads} disagrees with "
                             f"multi_query={config.raw['multi_query']} ({heads} key / value heads)")
        super().__init__(config, max_position, backend, tp)

    def split_qkv(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Multi-query: [q; k; v] rows; multi-head: per head [head][q, k, v][head_dim]."""
        if self.config.num_key_value_heads == 1:
            return super().split_qkv(tensor)
        return per_head_qkv(tensor, self.config.num_attention_heads, self.config.head_dim)
