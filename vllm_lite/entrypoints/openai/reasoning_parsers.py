"""`--reasoning-parser`: the `<think>...</think>` part of a chat reply as `reasoning` (vLLM's
field, formerly `reasoning_content`), the rest as `content` (vLLM's parsers of the same names).

| parser | reasoning is |
|---|---|
| qwen3 | the text between a leading `<think>` and `</think>`; a reply not starting with `<think>` has none |
| deepseek_r1 | the text before `</think>` (its template opens `<think>` in the prompt; a leading one is dropped) |

A reply cut before `</think>` is all reasoning. Streaming gives the same split: `ReasoningStream`
holds back a trailing piece that may be the start of a tag until the next delta decides it.

Usage reports the reasoning in tokens, in vLLM's field (`completion_tokens_details.reasoning_tokens`):
the generated tokens after a `<think>` token up to the first `</think>` token (deepseek_r1: from
the start), for tokenizers that have both tags as single tokens; with other tokenizers it is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_lite.reasoning_tags import END, REASONING_PARSERS, START, ThinkTokens, think_tokens  # noqa: F401


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole reply; None for an empty part."""
    stripped = text.lstrip()
    opened = stripped.startswith(START)
    if parser == "qwen3" and not opened:
        return None, text or None
    body = stripped[len(START):] if opened else text
    reasoning, closed, content = body.partition(END)
    if not closed:
        return reasoning or None, None
    return reasoning or None, content.lstrip("\n") or None


class ReasoningStream:
    """Feeds a reply's deltas; returns the new (reasoning, content) pieces of each."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""
        self.sent = ("", "")

    def feed(self, delta: str, final: bool) -> tuple[str | None, str | None]:
        self.text += delta
        visible = self.text if final else self.text[: len(self.text) - _partial_tag_length(self.text)]
        reasoning, content = split_reasoning(self.parser, visible)
        reasoning, content = reasoning or "", content or ""
        if not final and self.parser == "qwen3" and not visible.lstrip() and self.text.strip():
            return None, None  # only a piece of a possible leading <think> so far
        new_reasoning = reasoning[len(self.sent[0]):] if reasoning.startswith(self.sent[0]) else reasoning
        new_content = content[len(self.sent[1]):] if content.startswith(self.sent[1]) else content
        self.sent = (reasoning, content)
        return new_reasoning or None, new_content or None


def _partial_tag_length(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a tag."""
    for tag in (END, START):
        for length in range(len(tag) - 1, 0, -1):
            if text.endswith(tag[:length]):
                return length
    return 0


@dataclass(slots=True)
class ReasoningTokenCounter:
    """Counts the reasoning tokens of one reply fed in pieces: those after `<think>` (deepseek_r1:
    from the start) up to the first `</think>`, the span `split_reasoning` calls reasoning."""

    tokens: ThinkTokens | None
    inside: bool = False
    ended: bool = False
    count: int = 0

    @classmethod
    def for_parser(cls, parser: str, tokens: ThinkTokens | None) -> ReasoningTokenCounter:
        return cls(tokens, inside=parser == "deepseek_r1")

    def feed(self, token_ids: Any) -> int:
        if self.tokens is None or self.ended:
            return self.count
        for token_id in token_ids:
            if token_id == self.tokens.end:
                self.ended = True
                break
            if token_id == self.tokens.start:
                self.inside = True
            elif self.inside:
                self.count += 1
        return self.count
