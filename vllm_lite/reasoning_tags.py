"""The reasoning parsers' markers (vLLM's `--reasoning-parser` names) and their token ids: what the
server's reasoning split (entrypoints/openai/reasoning_parsers.py) and the engine's
thinking_token_budget (core/thinking_budget.py) both read.

| parser | a thinking section | opened by |
|---|---|---|
| qwen3 | `<think>` ... `</think>` | the reply's first token |
| deepseek_r1 | ... `</think>` (a leading `<think>` dropped) | the prompt (its template opens it) |
| mistral (Magistral) | `[THINK]` ... `[/THINK]` | the reply's first token |
| granite (Granite 3.2 / 3.3 with `thinking`) | `Here is my thought process:` ... `Here is my response:` (or `Here's`), plain text | the reply's start |
| openai_gptoss (gpt-oss) | harmony messages on the `analysis` channel (entrypoints/openai/harmony.py) | their headers |
| gemma4 (Gemma 4) | `<\|channel>` ... `<channel\|>`, the `thought\n` label after the opener dropped | the reply's first token |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

START, END = "<think>", "</think>"
# gpt-oss's harmony format's special tokens (entrypoints/openai/harmony.py reads them)
HARMONY_MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """`starts` / `ends`: the markers that open / close a thinking section (the first of each is
    the one a tokenizer may have as a single token); `opened_by_prompt`: the reply starts inside
    one; `single_tokens`: the markers are special tokens (thinking budgets and reasoning token
    counts need that), not text."""

    starts: tuple[str, ...]
    ends: tuple[str, ...]
    opened_by_prompt: bool = False
    single_tokens: bool = True
    harmony: bool = False  # gpt-oss's messages, not a thinking section: `starts` lists their markers
    label: str = ""  # text the model writes right after the opener that is not reasoning (Gemma 4's)


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat((START,), (END,)),
    "deepseek_r1": ReasoningFormat((START,), (END,), opened_by_prompt=True),
    "mistral": ReasoningFormat(("[THINK]",), ("[/THINK]",)),
    "granite": ReasoningFormat(("Here is my thought process:", "Here's my thought process:"),
                               ("Here is my response:", "Here's my response:"), single_tokens=False),
    "openai_gptoss": ReasoningFormat(HARMONY_MARKERS, (), single_tokens=False, harmony=True),
    "gemma4": ReasoningFormat(("<|channel>",), ("<channel|>",), label="thought\n"),
}
REASONING_PARSERS = tuple(REASONING_FORMATS)


@dataclass(frozen=True, slots=True)
class ThinkTokens:
    """The ids of the tokenizer's start and end markers (`<think>` and `</think>` for qwen3)."""

    start: int
    end: int


def think_tokens(tokenizer: Any, parser: str = "qwen3") -> ThinkTokens | None:
    """None when the parser's markers are text, or the tokenizer lacks either as one token."""
    reasoning_format = REASONING_FORMATS[parser]
    if not reasoning_format.single_tokens:
        return None
    start, end = (single_token_id(tokenizer, marker) for marker in (reasoning_format.starts[0],
                                                                    reasoning_format.ends[0]))
    return None if start is None or end is None else ThinkTokens(start, end)


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of the tokenizer's token that is exactly `text`, or None."""
    token_id = tokenizer.convert_tokens_to_ids(text)
    if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != text:
        return None
    return token_id


def special_token_markers(tokenizer: Any, markers: tuple[str, ...]) -> tuple[str, ...]:
    """The markers the tokenizer has as special tokens: decoding with skip_special_tokens (the
    default) takes them out of the text, so a parser reading them needs them kept."""
    kept = []
    for marker in markers:
        token_id = single_token_id(tokenizer, marker)
        if token_id is not None and tokenizer.decode([token_id], skip_special_tokens=True) != marker:
            kept.append(marker)
    return tuple(kept)


def reasoning_markers(parser: str) -> tuple[str, ...]:
    reasoning_format = REASONING_FORMATS[parser]
    return (*reasoning_format.starts, *reasoning_format.ends)
