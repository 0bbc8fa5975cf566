"""Tokenizer loading (client side only: the engine core never sees text)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


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


def end_token_ids(config_eos: tuple[int, ...], tokenizer: Any, vocab_size: int) -> tuple[int, ...]:
    """The ids that end a reply unless a request ignores EOS: config.json's / generation_config's
    eos_token_id and the tokenizer's. An id outside the model's vocabulary can never be sampled,
    so it ends nothing: left out, with a warning naming it (it would fail the engine core's check
    of every request's eos ids, and index past the grammar bitmask)."""
    ids = list(config_eos)
    tokenizer_eos = tokenizer.eos_token_id if tokenizer is not None else None
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids.append(tokenizer_eos)
    outside = [token for token in ids if not 0 <= token < vocab_size]
    if outside:
        logger.warning("eos_token_id %s (config.json, generation_config.json or the tokenizer) is outside the "
                       "model's vocabulary [0, %d): the model cannot produce it, so it ends no reply", outside,
                       vocab_size)
    return tuple(token for token in ids if 0 <= token < vocab_size)
