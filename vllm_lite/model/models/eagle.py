"""EAGLE heads (vLLM's `EagleLlamaForCausalLM` and `Eagle3LlamaForCausalLM`; the settings in
eagle_config.py): a drafter that reads the model's hidden states beside the token embeddings.

At draft position p the head reads the token at p + 1 and the model's hidden state at p (for
later drafts: its own output at p), so its output at p predicts the token at p + 2, as the model's
does at p + 1. `forward` returns the states the draft logits are taken from and the states the
next draft pass reads (the same for EAGLE-1; the normed and pre-norm ones for EAGLE-3)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import HFModelConfig
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.eagle_config import EagleHeadConfig
from vllm_lite.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vllm_lite.model.layers.linear import QKVParallelLinear, ReplicatedLinear
from vllm_lite.model.layers.norm import RMSNorm
from vllm_lite.model.layers.rotary import RotaryEmbedding
from vllm_lite.model.models.causal_lm import mapped_name
from vllm_lite.model.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Eagle3FirstLayer(LlamaDecoderLayer):
    """EAGLE-3's first layer: attention over [normed embedding, normed hidden state] (twice the
    width), the hidden state as the residual."""

    def __init__(self, config: HFModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallelGroup, norm_before_residual: bool, qk_norm: bool) -> None:
        super().__init__(config, rotary, backend, tp, qk_norm=qk_norm, o_proj_bias=True, layer_idx=0)
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(2 * config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, config.attention_bias, tp)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, positions, embeds, hidden, kv_cache, attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        hidden = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class EagleModel(nn.Module):
    """The head's layers (`layers`, as a decoder's: the KV cache is sized from them), `fc` and, for
    EAGLE-3, the final norm. `embed_tokens` is the head's own, or the model's (set by the
    proposer) when its checkpoint has none."""

    def __init__(self, config: HFModelConfig, eagle: EagleHeadConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup, own_embeddings: bool) -> None:
        super().__init__()
        self.eagle = eagle
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp) if own_embeddings
                             else None)
        rotary = RotaryEmbedding(config.rotary_dim, max_position, config.rope_theta, config.rope_scaling)
        first = (Eagle3FirstLayer(config, rotary, backend, tp, eagle.norm_before_residual, eagle.qk_norm)
                 if eagle.version == 3
                 else LlamaDecoderLayer(config, rotary, backend, tp, qk_norm=False, o_proj_bias=True, layer_idx=0))
        if eagle.version == 1:  # (SafeAILab's EAGLE: the first layer reads fc's output unnormed)
            first.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([first, *(
            LlamaDecoderLayer(config, rotary, backend, tp, qk_norm=eagle.qk_norm, o_proj_bias=True, layer_idx=i)
            for i in range(1, config.num_hidden_layers))])
        num_aux = len(eagle.aux_layer_ids)
        fc_input = eagle.target_hidden_size * num_aux if eagle.version == 3 else 2 * config.hidden_size
        self.fc = ReplicatedLinear(fc_input, config.hidden_size) if eagle.version == 1 or num_aux else None
        self.input_norm = RMSNorm(fc_input, config.rms_norm_eps) if eagle.norm_before_fc and num_aux else None
        self.fc_norm = (nn.ModuleList(RMSNorm(eagle.target_hidden_size, config.rms_norm_eps) for _ in range(num_aux))
                        if eagle.fc_norm and num_aux else None)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if eagle.version == 3 else None

    def combine_target_states(self, states: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: the model's concatenated aux states mapped to the head's width by `fc` (the
        first draft pass; later passes read the head's own output)."""
        if self.eagle.version == 1 or self.fc is None:
            return states
        if self.input_norm is not None:
            states = self.input_norm(states)
        if self.fc_norm is not None:
            chunks = states.chunk(len(self.fc_norm), dim=-1)
            states = torch.cat([norm(chunk.contiguous()) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(states)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed_tokens(input_ids)
        if self.eagle.version == 1:
            hidden, residual = self.fc(torch.cat([embeds, hidden], dim=-1)), None
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
            hidden = hidden + residual
            return hidden, hidden
        hidden, residual = self.layers[0](positions, embeds, hidden, kv_caches[0], attn_metadata)
        for layer, kv_cache in zip(self.layers[1:], kv_caches[1:]):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        normed, prenorm = self.norm(hidden, residual)
        return normed, (normed if self.eagle.norm_output else prenorm)


class EagleHead(nn.Module):
    """An EAGLE head as its checkpoint names it: `fc`, `layers.*` (EAGLE-3: `midlayer.*`), `norm`,
    `embed_tokens` and `lm_head` where it has them, EAGLE-3's `d2t` (each draft token's offset to
    the model's token; `t2d` is not read). Without its own `lm_head` the model's computes the
    draft logits (EAGLE-1; `own_lm_head` False)."""

    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, config: HFModelConfig, eagle: EagleHeadConfig, max_position: int, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK, own_embeddings: bool = True, own_lm_head: bool = True,
                 token_map: bool = False) -> None:
        """`token_map`: the checkpoint has `d2t` (always, with a smaller draft vocabulary)."""
        super().__init__()
        self.config = config
        self.eagle = eagle
        self.model = EagleModel(config, eagle, max_position, backend, tp, own_embeddings)
        self.lm_head = ParallelLMHead(eagle.draft_vocab_size, config.hidden_size, tp=tp) if own_lm_head else None
        self.draft_id_to_target_id = (nn.Parameter(torch.zeros(eagle.draft_vocab_size, dtype=torch.int64),
                                                   requires_grad=False)
                                      if token_map or eagle.draft_vocab_size != config.vocab_size else None)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """(parameter name, shard id) of an EAGLE checkpoint's tensor."""
        if name == "d2t":
            return "draft_id_to_target_id", None
        if name.startswith("lm_head."):
            return name, None
        return mapped_name(name if name.startswith("model.") else "model." + name, (("midlayer.", "layers.0."),),
                           self.stacked_params_mapping)

    def draft_tokens(self, states: torch.Tensor, model_logits: Any) -> torch.Tensor:
        """The greedy draft token of each row of `states` (the head's logits states), in the
        model's vocabulary; `model_logits`: the model's `compute_logits`, for a head without an
        LM head of its own."""
        if self.lm_head is None:
            return model_logits(states).argmax(dim=-1)
        best = self.lm_head.compute_logits(states).argmax(dim=-1)
        return best if self.draft_id_to_target_id is None else best + self.draft_id_to_target_id[best]
