"""Fixtures of the in-process server tests: the tiny tokenizer and a fake engine over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture
def engine(tokenizer: Any) -> FakeEngine:
    return FakeEngine(tokenizer, max_model_len=64)
