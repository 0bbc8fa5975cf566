"""What a decoder-only model adds around its decoder stack: the LM head (tied to the embedding
when config.json says so) and the calls the model runner makes; the decoder stack the families
without Llama's fused-norm residual share (`DecoderStack`), and their checkpoints' name mapping."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from vllm_lite.config import HFModelConfig
from vllm_lite.distributed.parallel_state import TensorParallelGroup
from vllm_lite.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vllm_lite.model.layers.linear import materialize
from vllm_lite.model.weight_updates import CheckpointWeightUpdates

QKV_PARTS = ("q_proj", "k_proj", "v_proj")


class DecoderStack(nn.Module):
    """Token embeddings (plus learned absolute positions, or a LayerNorm, where the family has
    them), layers whose forward(positions, hidden, kv_cache, attn_metadata) keeps the residual
    inside, and a final norm."""

    def __init__(self, config: HFModelConfig, layers: Iterable[nn.Module], norm: nn.Module, tp: TensorParallelGroup,
                 learned_positions: bool = False, embed_layernorm: nn.Module | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.embed_positions = (nn.Parameter(torch.zeros(config.max_position_embeddings, config.hidden_size),
                                             requires_grad=False) if learned_positions else None)
        self.embed_layernorm = embed_layernorm
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], attn_metadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.embed_positions is not None:
            hidden = hidden + self.embed_positions[positions]
        if self.embed_layernorm is not None:
            hidden = self.embed_layernorm(hidden)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, attn_metadata)
        return self.norm(hidden)


def mapped_name(name: str, renames: Sequence[tuple[str, str]],
                stacked_params_mapping: Sequence[tuple[str, str, Any]]) -> tuple[str, Any]:
    """A checkpoint tensor's parameter after a family's fragment renames (in order), and its shard
    of a fused layer (None: the whole parameter). A GPT-style `transformer.` prefix is `model.`."""
    if name.startswith("transformer."):
        name = "model." + name.removeprefix("transformer.")
    for fragment, ours in renames:
        name = name.replace(fragment, ours)
    for fragment, fused, shard in stacked_params_mapping:
        if fragment in name:
            return name.replace(fragment, fused), shard
    return name, None


def split_fused_qkv(name: str, weight: Any, fused: str,
                    split: Callable[[torch.Tensor], Sequence[torch.Tensor]]) -> list[tuple[str, Any]] | None:
    """`<layer>.<fused>.<kind>` (a checkpoint's fused q / k / v: weight, bias, or a LoRA B) as the
    q_proj / k_proj / v_proj tensors `split` makes of it; None for any other tensor."""
    prefix, _, kind = name.rpartition(".")
    if not prefix.endswith("." + fused):
        return None
    base = prefix.removesuffix("." + fused)
    return [(f"{base}.{part}.{kind}", piece) for part, piece in zip(QKV_PARTS, split(materialize(weight)))]


def refuse_checkpoint_quantization(config: HFModelConfig) -> None:
    """Families whose fused projections are read apart here take no quantized checkpoint (its
    packed tensors are not read apart)."""
    if config.quantization is not None:
        raise ValueError(f"config.json: quantization_config ({config.quantization}) is not supported for "
                         f"{config.architecture}; load the unquantized checkpoint (quantization='int8' quantizes "
                         "it here)")


class DecoderForCausalLM(CheckpointWeightUpdates, nn.Module):
    """`model`: the decoder (`embed_tokens`, `layers`, forward(input_ids, positions, kv_caches,
    attn_metadata) -> final hidden states)."""

    def __init__(self, config: HFModelConfig, model: nn.Module, tp: TensorParallelGroup,
                 lm_head_bias: bool = False) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, lm_head_bias, tp=tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(model.embed_tokens)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        return None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """vLLM's: the input embeddings of token ids (what `inputs_embeds` stands in for)."""
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, kv_caches, attn_metadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.greedy_tokens(hidden_states)
