"""StarCoder2: Llama's attention (GQA, rotary, biases per `use_bias`, `sliding_window` on every
layer) in a GPT-style block: LayerNorm with biases (`norm_epsilon`) before attention and before a
plain (not gated) MLP, `c_fc` -> gelu-tanh -> `c_proj`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import HFModelConfig
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm_lite.model.layers.rotary import RotaryEmbedding
from vllm_lite.model.models.causal_lm import DecoderForCausalLM, DecoderStack
from vllm_lite.model.models.llama import LlamaAttention, LlamaForCausalLM

DEFAULT_NORM_EPSILON = 1e-5  # transformers' Starcoder2Config


class Starcoder2MLP(nn.Module):
    def __init__(self, config: HFModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        bias = config.attention_bias  # (`use_bias`, read for every projection)
        self.c_fc = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias, tp)
        self.c_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, config: HFModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallelGroup, layer_idx: int) -> None:
        super().__init__()
        eps = config.raw.get("norm_epsilon", DEFAULT_NORM_EPSILON)
        window = config.sliding_windows[layer_idx] if config.sliding_windows else None
        self.self_attn = LlamaAttention(config, rotary, backend, tp, qk_norm=False, o_proj_bias=True,
                                        sliding_window=window)
        self.mlp = Starcoder2MLP(config, tp)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)

    def forward(self, positions, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), kv_cache, attn_metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Starcoder2ForCausalLM(DecoderForCausalLM):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping[:3]  # q / k / v (the MLP is not gated)

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        rotary = RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_scaling)
        layers = [Starcoder2DecoderLayer(config, rotary, backend, tp, i) for i in range(config.num_hidden_layers)]
        norm = nn.LayerNorm(config.hidden_size, eps=config.raw.get("norm_epsilon", DEFAULT_NORM_EPSILON))
        super().__init__(config, DecoderStack(config, layers, norm, tp), tp)
