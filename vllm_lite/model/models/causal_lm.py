"""What a decoder-only model adds around its decoder stack: the LM head (tied to the embedding
when config.json says so) and the calls the model runner makes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_lite.config import HFModelConfig
from vllm_lite.distributed.parallel_state import TensorParallelGroup
from vllm_lite.model.layers.embedding import ParallelLMHead


class DecoderForCausalLM(nn.Module):
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

    def forward(self, input_ids, positions, kv_caches, attn_metadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.greedy_tokens(hidden_states)
