"""What every vision side the loader reads shares: its parameter names are its checkpoint's,
under `model.` as transformers 5 saves them or without it as older releases do."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn


class CheckpointVisionSide(nn.Module):
    def map_checkpoint_name(self, name: str) -> tuple[str, Any]:
        return name.removeprefix("model."), None

    @staticmethod
    def read_tensors(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The vision side's checkpoint tensors this encoder reads (all, unless it says otherwise)."""
        return iter(weights)
