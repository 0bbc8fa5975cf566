"""Tokenizer loading (client side only: the engine core never sees text)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer: cannot load a tokenizer from '{path}': {exc}") from exc
    if tokenizer.chat_template is None:
        tokenizer.chat_template = processor_chat_template(Path(path))
    return tokenizer


def processor_chat_template(folder: Path) -> str | None:
    """The chat template a multimodal checkpoint keeps with its processor (`chat_template.json`),
    which vLLM uses (it resolves templates through the processor) and the tokenizer does not read."""
    path = folder / "chat_template.json"
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"tokenizer: cannot read the chat template in '{path}': {exc}") from exc
    if template is not None and not isinstance(template, str):
        raise ValueError(f"tokenizer: '{path}': chat_template must be a string, got {type(template).__name__}")
    return template
