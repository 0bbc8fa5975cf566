"""Llama-family decoder (Llama 2/3, Mistral with its sliding window, SmolLM2). Qwen2, Qwen3,
Granite and SmolLM3 reuse it: Qwen2 adds q/k/v biases, Qwen3 adds per-head RMSNorm on q and k
before rotary, Granite scales the embeddings, the attention, the residual branches and the logits
(`Scales`), SmolLM3 leaves rotary out of some layers (`rope_layers`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import HFModelConfig
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.activation import SiluAndMul
from vllm_lite.model.layers.attention import Attention
from vllm_lite.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vllm_lite.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm_lite.model.layers.norm import RMSNorm
from vllm_lite.model.layers.rotary import RotaryEmbedding
from vllm_lite.model.weight_updates import CheckpointWeightUpdates


@dataclass(frozen=True, slots=True)
class Scales:
    """Constant factors of a Llama-family model (Granite's multipliers; 1 and None elsewhere):
    the embeddings are multiplied by `embedding`, each attention / MLP output by `residual`
    before it joins the residual stream, the logits divided by `logits`; `attention` is the
    softmax scale (None: 1 / sqrt(head_dim))."""

    embedding: float = 1.0
    residual: float = 1.0
    attention: float | None = None
    logits: float = 1.0


class LlamaAttention(nn.Module):
    def __init__(self, config: HFModelConfig, rotary: RotaryEmbedding | None, backend: AttentionBackend,
                 tp: TensorParallelGroup, qk_norm: bool, o_proj_bias: bool,
                 sliding_window: int | None = None, scale: float | None = None,
                 alibi_slopes: torch.Tensor | None = None, clip_qkv: float | None = None) -> None:
        """`alibi_slopes`: every head's ALiBi slopes (Bloom, without rotary); this rank takes its
        heads' ones. `clip_qkv` c: q, k and v clamped to [-c, c] (OLMo)."""
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, config.attention_bias, tp)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size,
                                        config.attention_bias and o_proj_bias, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size, self.head_dim = self.qkv_proj.q_size, self.qkv_proj.kv_size, d
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary
        self.clip_qkv = clip_qkv
        if alibi_slopes is not None:
            first = tp.rank * self.num_heads
            alibi_slopes = alibi_slopes[first:first + self.num_heads]
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, backend, sliding_window, scale,
                              alibi_slopes=alibi_slopes)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:  # (None: a NoPE layer, SmolLM3's)
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class LlamaMLP(nn.Module):
    def __init__(self, config: HFModelConfig, tp: TensorParallelGroup, intermediate_size: int | None = None) -> None:
        """`intermediate_size`: another width than config.json's (a MoE's shared expert)."""
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], config.mlp_bias, tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, config.mlp_bias, tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


MLPFactory = Callable[[HFModelConfig, int, TensorParallelGroup], nn.Module]  # (config, layer, tp)


def dense_mlp(config: HFModelConfig, layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
    return LlamaMLP(config, tp)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: HFModelConfig, rotary: RotaryEmbedding | None, backend: AttentionBackend,
                 tp: TensorParallelGroup, qk_norm: bool, o_proj_bias: bool, layer_idx: int,
                 mlp_factory: MLPFactory = dense_mlp, scales: Scales = Scales()) -> None:
        super().__init__()
        window = config.sliding_windows[layer_idx] if config.sliding_windows else None
        self.self_attn = LlamaAttention(config, rotary, backend, tp, qk_norm, o_proj_bias, window, scales.attention)
        self.mlp = mlp_factory(config, layer_idx, tp)
        self.residual_scale = scales.residual
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (this layer's MLP output, the residual stream before it), vLLM's
        form: each norm adds the previous output to the residual in the same pass (the first
        layer's residual is None: its input is the embedding)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata)
        if self.residual_scale != 1.0:
            hidden = hidden * self.residual_scale
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        return (hidden if self.residual_scale == 1.0 else hidden * self.residual_scale), residual


# Qwen3-VL's DeepStack: (the step's token indices of image placeholders, [layers, placeholders,
# hidden] additions to the hidden states there after each of the first layers)
DeepStack = tuple[torch.Tensor, torch.Tensor]


class LlamaModel(nn.Module):
    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup, qk_norm: bool, o_proj_bias: bool,
                 mlp_factory: MLPFactory = dense_mlp, scales: Scales = Scales(),
                 rope_layers: tuple[bool, ...] | None = None) -> None:
        """`rope_layers`: whether each layer rotates q and k (None: every layer does)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.embedding_scale = scales.embedding
        rotary = RotaryEmbedding(config.rotary_dim, max_position, config.rope_theta, config.rope_scaling)
        rope_layers = rope_layers or (True,) * config.num_hidden_layers
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary if rope_layers[i] else None, backend, tp, qk_norm, o_proj_bias, i,
                              mlp_factory, scales)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], attn_metadata,
                inputs_embeds: torch.Tensor | None = None, deepstack: DeepStack | None = None) -> torch.Tensor:
        # (Granite's embedding multiplier applies to given embeddings too, as in vLLM and transformers)
        hidden, residual = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds, None
        if self.embedding_scale != 1.0:
            hidden = hidden * self.embedding_scale
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
            if deepstack is not None and index < len(deepstack[1]):
                # (the layer's output is hidden + residual: adding to either part adds to it)
                hidden = hidden.index_add(0, deepstack[0], deepstack[1][index])
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class LlamaForCausalLM(CheckpointWeightUpdates, nn.Module):
    qk_norm = False
    o_proj_bias = True  # o_proj has a bias whenever `attention_bias` is set (not so in Qwen2)

    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    stacked_params_mapping = (
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0),
        (".up_proj", ".gate_up_proj", 1),
    )

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.config = config
        scales = self.scales(config)
        self.model = LlamaModel(config, max_position, backend, tp, self.qk_norm, self.o_proj_bias,
                                self.build_mlp, scales, self.rope_layers(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_scale = scales.logits

    @staticmethod
    def scales(config: HFModelConfig) -> Scales:
        return Scales()

    @staticmethod
    def rope_layers(config: HFModelConfig) -> tuple[bool, ...] | None:
        """Whether each layer rotates q and k (None: all do)."""
        return None

    @staticmethod
    def build_mlp(config: HFModelConfig, layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        return LlamaMLP(config, tp)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """(parameter name, shard id) for checkpoint names the fragment table cannot map
        (per-expert tensors); None: use `stacked_params_mapping`."""
        return None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """vLLM's: the input embeddings of token ids (what `inputs_embeds` stands in for)."""
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, kv_caches, attn_metadata,
                inputs_embeds: torch.Tensor | None = None, deepstack: DeepStack | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds, deepstack)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden_states)
        return logits if self.logits_scale == 1.0 else logits / self.logits_scale

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """`compute_logits(hidden_states).argmax(-1)` without writing the logits where the LM head
        can (layers/head_panels.py); None: compute the logits. (A positive logits scale keeps
        the argmax; Granite's is checked positive.)"""
        return self.lm_head.greedy_tokens(hidden_states)
