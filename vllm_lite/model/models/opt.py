"""OPT: learned absolute positions (table offset by 2), LayerNorm before (or, for
`do_layer_norm_before=False`, after) attention and MLP, ReLU, biases everywhere, multi-head
attention without rotary, and `project_in` / `project_out` when the word embeddings are
narrower than the hidden size. Hub checkpoints name tensors `decoder.*` or `model.decoder.*`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import HFModelConfig
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.attention import Attention
from vllm_lite.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vllm_lite.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm_lite.model.weight_updates import CheckpointWeightUpdates

POSITION_OFFSET = 2  # OPT's position table starts at index 2 (a fairseq padding convention)


class OPTAttention(nn.Module):
    def __init__(self, config: HFModelConfig, backend: AttentionBackend, tp: TensorParallelGroup) -> None:
        super().__init__()
        bias, d = config.raw.get("enable_bias", True), config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_attention_heads, bias, tp)
        self.out_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias, tp)
        self.num_heads, self.q_size, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.q_size, d
        self.num_kv_heads = self.num_heads
        self.scaling = d ** -0.5
        # transformers scales the query before the product (and attends with scale 1)
        self.attn = Attention(self.num_heads, self.num_heads, d, backend, scale=1.0)

    def forward(self, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size] * 3, dim=-1)
        q = (q * self.scaling).view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_heads, self.head_dim)
        v = v.view(-1, self.num_heads, self.head_dim)
        return self.out_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: HFModelConfig, backend: AttentionBackend, tp: TensorParallelGroup) -> None:
        super().__init__()
        raw, h = config.raw, config.hidden_size
        bias, affine = raw.get("enable_bias", True), raw.get("layer_norm_elementwise_affine", True)
        self.self_attn = OPTAttention(config, backend, tp)
        self.self_attn_layer_norm = nn.LayerNorm(h, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(h, config.intermediate_size, bias, tp)
        self.fc2 = RowParallelLinear(config.intermediate_size, h, bias, tp)
        self.final_layer_norm = nn.LayerNorm(h, elementwise_affine=affine)
        self.pre_norm = raw.get("do_layer_norm_before", True)

    def forward(self, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        attn_in = self.self_attn_layer_norm(hidden) if self.pre_norm else hidden
        hidden = hidden + self.self_attn(attn_in, kv_cache, attn_metadata)
        if not self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        mlp_in = self.final_layer_norm(hidden) if self.pre_norm else hidden
        hidden = hidden + self.fc2(F.relu(self.fc1(mlp_in)))
        return hidden if self.pre_norm else self.final_layer_norm(hidden)


class OPTDecoder(nn.Module):
    def __init__(self, config: HFModelConfig, backend: AttentionBackend, tp: TensorParallelGroup) -> None:
        super().__init__()
        raw, h = config.raw, config.hidden_size
        embed_dim = raw.get("word_embed_proj_dim") or h
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, embed_dim, tp)
        self.embed_positions = nn.Parameter(
            torch.zeros(config.max_position_embeddings + POSITION_OFFSET, h), requires_grad=False)
        self.project_in = ReplicatedLinear(embed_dim, h) if embed_dim != h else None
        self.project_out = ReplicatedLinear(h, embed_dim) if embed_dim != h else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config, backend, tp) for _ in range(config.num_hidden_layers))
        has_final_norm = raw.get("do_layer_norm_before", True) and not raw.get("_remove_final_layer_norm", False)
        self.final_layer_norm = (nn.LayerNorm(h, elementwise_affine=raw.get("layer_norm_elementwise_affine", True))
                                 if has_final_norm else None)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, attn_metadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions[positions + POSITION_OFFSET]
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, kv_cache, attn_metadata)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        return hidden if self.project_out is None else self.project_out(hidden)


class OPTModel(nn.Module):
    def __init__(self, config: HFModelConfig, backend: AttentionBackend, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config, backend, tp)

    @property
    def layers(self) -> nn.ModuleList:  # what the model runner sizes the KV cache from
        return self.decoder.layers

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, kv_caches, attn_metadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.decoder(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)


class OPTForCausalLM(CheckpointWeightUpdates, nn.Module):
    stacked_params_mapping = (
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
    )

    def __init__(self, config: HFModelConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config, backend, tp)
        embed_dim = config.raw.get("word_embed_proj_dim") or config.hidden_size
        self.lm_head = ParallelLMHead(config.vocab_size, embed_dim, tp=tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.decoder.embed_tokens)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        if name.startswith("decoder."):  # the original checkpoints have no `model.` prefix
            name = "model." + name
        if name.endswith("embed_positions.weight"):
            return name[: -len(".weight")], None
        for fragment, fused, shard in self.stacked_params_mapping:
            if fragment in name:
                return name.replace(fragment, fused), shard
        return name, None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """vLLM's: the input embeddings of token ids (what `inputs_embeds` stands in for)."""
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, kv_caches, attn_metadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """`compute_logits(hidden_states).argmax(-1)` without writing the logits where the LM head
        can (layers/head_panels.py); None: compute the logits."""
        return self.lm_head.greedy_tokens(hidden_states)
