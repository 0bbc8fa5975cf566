"""Sliding-window attention: a Mistral whose window is much shorter than its prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_lite.config import EngineArgs


def test_mistral_window_is_not_silently_ignored(tiny_mistral_window: Path) -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        EngineArgs(model=str(tiny_mistral_window), max_model_len=256).create_engine_config()
