"""Per-batch sampling state, rebuilt only when the batch's composition changes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingMetadata:
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None  # float32 [num_rows, 1]; None when all greedy
    greedy_mask: torch.Tensor | None  # bool [num_rows]; None unless greedy and random mix
    generators: dict[int, torch.Generator]  # row -> per-request generator (seeded requests)
