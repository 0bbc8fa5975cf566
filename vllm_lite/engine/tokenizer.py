"""Tokenizer loading (client side only: the engine core never sees text)."""

from __future__ import annotations

from typing import Any


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer: cannot load a tokenizer from '{path}': {exc}") from exc
