"""The reasoning parsers' tags (vLLM's `--reasoning-parser` names) and their token ids: what the
server's reasoning split (entrypoints/openai/reasoning_parsers.py) and the engine's
thinking_token_budget (core/thinking_budget.py) both read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True, slots=True)
class ThinkTokens:
    """The ids of the tokenizer's `<think>` and `</think>` tokens."""

    start: int
    end: int


def think_tokens(tokenizer: Any) -> ThinkTokens | None:
    """None when the tokenizer lacks either tag as one token."""
    ids = []
    for tag in (START, END):
        token_id = tokenizer.convert_tokens_to_ids(tag)
        if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != tag:
            return None
        ids.append(token_id)
    return ThinkTokens(*ids)
