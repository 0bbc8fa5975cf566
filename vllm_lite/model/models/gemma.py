"""Gemma 2 and Gemma 3 (text): pre- and post-norms around attention and MLP, (1 + w) RMSNorm,
embeddings scaled by sqrt(hidden_size), gelu-tanh MLP, attention scaled by
`query_pre_attn_scalar`, local (sliding) and global layers per `layer_types`, soft-capped
attention scores (Gemma 2) and final logits. Gemma 3 adds per-head q/k norms and a separate
rope base (and scaling) for local and global layers. Gemma (1) has the same parts without the
post-norms (`sandwich_norms`), soft caps or local layers, attention scaled by 1 / sqrt(head_dim)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import HFModelConfig, complete_rope_scaling, rope_scaling_of
from vllm_lite.config_fields import gemma_layer_types
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.activation import GeluTanhAndMul
from vllm_lite.model.layers.attention import Attention
from vllm_lite.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vllm_lite.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm_lite.model.layers.norm import GemmaRMSNorm
from vllm_lite.model.layers.rotary import RotaryEmbedding
from vllm_lite.model.models.llama import LlamaAttention, LlamaForCausalLM
from vllm_lite.model.weight_updates import CheckpointWeightUpdates

SLIDING = "sliding_attention"


def gemma3_rope(raw: dict[str, Any], layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling) for one layer type: transformers-5 `rope_parameters` keyed by layer type,
    or the older `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq` (local)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        rope = params[layer_type]
        return float(rope["rope_theta"]), complete_rope_scaling(rope_scaling_of(rope), raw)
    if layer_type == SLIDING:
        return float(raw.get("rope_local_base_freq", 10000.0)), None
    scaling = rope_scaling_of(raw.get("rope_scaling"))
    return float(raw.get("rope_theta", 1_000_000.0)), complete_rope_scaling(scaling, raw)


class GemmaAttention(nn.Module):
    def __init__(self, config: HFModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallelGroup, window: int | None, qk_norm: bool) -> None:
        super().__init__()
        raw, d = config.raw, config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, config.attention_bias, tp)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size,
                                        config.attention_bias, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size, self.head_dim = self.qkv_proj.q_size, self.qkv_proj.kv_size, d
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary
        self.clip_qkv = None  # (LlamaAttention.forward reads it: OLMo's clamp)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, backend, window,
                              scale=raw.get("query_pre_attn_scalar", d) ** -0.5,
                              logits_soft_cap=raw.get("attn_logit_softcapping"))

    # Same projections, norms and rotary as Llama's; only the scale and soft cap (set above) differ.
    forward = LlamaAttention.forward


class GemmaMLP(nn.Module):
    def __init__(self, config: HFModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], False, tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, False, tp)
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """`sandwich_norms` (Gemma 2 and 3): the attention and MLP outputs are normalized too, and the
    MLP reads a norm of its own; without (Gemma 1): Llama's pre-norm block."""

    def __init__(self, config: HFModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallelGroup, window: int | None, qk_norm: bool, sandwich_norms: bool = True) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GemmaAttention(config, rotary, backend, tp, window, qk_norm)
        self.mlp = GemmaMLP(config, tp)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.sandwich_norms = sandwich_norms
        if sandwich_norms:
            self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, attn_metadata)
        if not self.sandwich_norms:
            hidden = hidden + attn
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaModel(nn.Module):
    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup, qk_norm: bool, sandwich_norms: bool = True) -> None:
        super().__init__()
        raw = config.raw
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.embed_scale = config.hidden_size ** 0.5
        layer_types = gemma_layer_types(raw, config.architecture)
        rotaries = {kind: self._rotary(config, max_position, kind, qk_norm) for kind in set(layer_types)}
        self.rotaries = nn.ModuleList(rotaries.values())  # buffers follow the model's device
        windows = config.sliding_windows or (None,) * len(layer_types)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, rotaries[kind], backend, tp, windows[i], qk_norm, sandwich_norms)
            for i, kind in enumerate(layer_types))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    @staticmethod
    def _rotary(config: HFModelConfig, max_position: int, layer_type: str, per_type: bool) -> RotaryEmbedding:
        if per_type:  # Gemma 3
            base, scaling = gemma3_rope(config.raw, layer_type)
            return RotaryEmbedding(config.head_dim, max_position, base, scaling)
        return RotaryEmbedding(config.head_dim, max_position, config.rope_theta, config.rope_scaling)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled by sqrt(hidden_size) here, as vLLM's Gemma models embed (so given embeddings
        are taken as they are)."""
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], attn_metadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, attn_metadata)
        return self.norm(hidden)


class Gemma2ForCausalLM(CheckpointWeightUpdates, nn.Module):
    qk_norm = False
    sandwich_norms = True
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.config = config
        self.model = GemmaModel(config, max_position, backend, tp, self.qk_norm, self.sandwich_norms)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.final_logit_softcapping = config.raw.get("final_logit_softcapping")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """vLLM's: the input embeddings of token ids (what `inputs_embeds` stands in for)."""
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, kv_caches, attn_metadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """As in Llama, but not under soft-capping: tanh can round distinct logits to one value,
        and the capped logits' first maximum is then what greedy sampling takes."""
        if self.final_logit_softcapping is not None:
            return None
        return self.lm_head.greedy_tokens(hidden_states)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True


class GemmaForCausalLM(Gemma2ForCausalLM):
    """Gemma (1): every layer global, no post-norms or soft caps."""

    sandwich_norms = False
