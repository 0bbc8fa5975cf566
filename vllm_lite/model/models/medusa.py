"""Medusa heads (vLLM's `Medusa`; settings in medusa_config.py): from the model's last hidden
state at a position, head i's residual SiLU blocks and LM head give the token i + 1 places after
the one the model's own LM head gives there."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.medusa_config import MedusaHeadConfig
from vllm_lite.model.layers.embedding import ParallelLMHead
from vllm_lite.model.layers.linear import ReplicatedLinear


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ReplicatedLinear(hidden_size, hidden_size, bias) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + nn.functional.silu(layer(x))
        return x


class MedusaHead(nn.Module):
    """Checkpoint names: vLLM's (`blocks.{head}.layers.{layer}.*`, `lm_heads.{head}.weight`, or
    `lm_head.weight` with original_lm_head; a `medusa_heads.` prefix dropped) or FasterDecoding's
    (`{head}.{layer}.linear.*`, `{head}.{num_layers}.weight`)."""

    def __init__(self, config: MedusaHeadConfig, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(ResidualBlock(config.hidden_size, config.num_layers, config.fc_bias)
                                    for _ in range(config.num_heads))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp) if config.shared_lm_head else None
        self.lm_heads = (None if config.shared_lm_head else
                         nn.ModuleList(ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
                                       for _ in range(config.num_heads)))

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        name = name.removeprefix("medusa_heads.")
        parts = name.split(".")
        if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():  # (FasterDecoding's names)
            head, layer, rest = parts[0], parts[1], parts[2:]
            name = (f"blocks.{head}.layers.{layer}.{'.'.join(rest[1:])}" if rest[0] == "linear"
                    else f"lm_heads.{head}.{'.'.join(rest)}")
        if self.config.shared_lm_head and name == "lm_heads.0.weight":
            name = "lm_head.weight"
        return name, None

    def draft_tokens(self, hidden: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """[rows, num_drafts]: the first `num_drafts` heads' top tokens after each row's state."""
        return torch.stack([(self.lm_head or self.lm_heads[i]).compute_logits(self.blocks[i](hidden)).argmax(dim=-1)
                            for i in range(num_drafts)], dim=1)
