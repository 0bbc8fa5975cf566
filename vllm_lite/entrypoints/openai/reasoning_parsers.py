"""`--reasoning-parser`: the thinking part of a chat reply as `reasoning` (vLLM's field, formerly
`reasoning_content`), the rest as `content` (vLLM's parsers of the same names; their markers in
vllm_lite/reasoning_tags.py).

| parser | reasoning is |
|---|---|
| qwen3 | the text between a leading `<think>` and `</think>`; a reply not starting with `<think>` has none |
| deepseek_r1 | the text before `</think>` (its template opens `<think>` in the prompt; a leading one is dropped) |
| mistral | the text between a leading `[THINK]` and `[/THINK]` (Magistral) |
| granite | the text between a leading "Here is my thought process:" and "Here is my response:" (or "Here's") |
| openai_gptoss | gpt-oss's harmony messages on the analysis channel; the content is the final channel's (harmony.py) |

A reply cut before its end marker is all reasoning (vLLM's granite calls a cut reply all content
when it is not streamed, and reasoning when it is: here both are reasoning). Streaming gives the
same split: `ReasoningStream` holds back a trailing piece that may be the start of a marker until
the next delta decides it.

Usage reports the reasoning in tokens, in vLLM's field (`completion_tokens_details.reasoning_tokens`):
the generated tokens after the start token up to the first end token (deepseek_r1: from the
start), for tokenizers that have both markers as single tokens; otherwise (granite's text
markers) it is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_lite.entrypoints.openai import harmony
from vllm_lite.reasoning_tags import (HARMONY_MARKERS, REASONING_FORMATS, REASONING_PARSERS, ThinkTokens,  # noqa: F401
                                     single_token_id, think_tokens)


def split_reasoning(parser: str, text: str, keep_calls: bool = False) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole reply; None for an empty part. `keep_calls` (gpt-oss's
    harmony replies only): its tool calls follow the content, for the `openai` tool parser."""
    reasoning_format = REASONING_FORMATS[parser]
    if reasoning_format.harmony:
        return harmony.split(text, keep_calls)
    stripped = text.lstrip()
    start = next((marker for marker in reasoning_format.starts if stripped.startswith(marker)), None)
    if start is None and not reasoning_format.opened_by_prompt:
        return None, text or None
    body = stripped[len(start):] if start is not None else text
    if start is not None and reasoning_format.label:
        if reasoning_format.label.startswith(body):  # (the label so far: no reasoning yet)
            return None, None
        body = body.removeprefix(reasoning_format.label)
    ends = [(body.find(marker), marker) for marker in reasoning_format.ends if marker in body]
    if not ends:
        return body or None, None
    where, marker = min(ends)
    reasoning, content = body[:where], body[where + len(marker):]
    return reasoning or None, content.lstrip("\n") or None


class ReasoningStream:
    """Feeds a reply's deltas; returns the new (reasoning, content) pieces of each."""

    def __init__(self, parser: str, keep_calls: bool = False) -> None:
        self.parser = parser
        self.format = REASONING_FORMATS[parser]
        self.keep_calls = keep_calls
        self.text = ""
        self.sent = ("", "")

    def feed(self, delta: str, final: bool) -> tuple[str | None, str | None]:
        self.text += delta
        visible = self.text if final else self.text[: len(self.text) - self._partial_marker_length(self.text)]
        reasoning, content = split_reasoning(self.parser, visible, self.keep_calls)
        reasoning, content = reasoning or "", content or ""
        if not final and not self.format.opened_by_prompt and not visible.lstrip() and self.text.strip():
            return None, None  # only a piece of a possible leading start marker so far
        new_reasoning = reasoning[len(self.sent[0]):] if reasoning.startswith(self.sent[0]) else reasoning
        new_content = content[len(self.sent[1]):] if content.startswith(self.sent[1]) else content
        self.sent = (reasoning, content)
        return new_reasoning or None, new_content or None

    def _partial_marker_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a marker."""
        if self.format.harmony:
            return harmony.partial_marker_length(text)
        longest = 0
        for marker in (*self.format.ends, *self.format.starts):
            for length in range(len(marker) - 1, longest, -1):
                if text.endswith(marker[:length]):
                    longest = length
                    break
        return longest


@dataclass(slots=True)
class ReasoningTokenCounter:
    """Counts the reasoning tokens of one reply fed in pieces: those after `<think>` (deepseek_r1:
    from the start) up to the first `</think>`, the span `split_reasoning` calls reasoning."""

    tokens: ThinkTokens | None
    inside: bool = False
    ended: bool = False
    count: int = 0

    @classmethod
    def for_parser(cls, parser: str, tokens: ThinkTokens | HarmonyTokens | None
                   ) -> ReasoningTokenCounter | HarmonyTokenCounter:
        if isinstance(tokens, HarmonyTokens):
            return HarmonyTokenCounter(tokens)
        return cls(tokens, inside=REASONING_FORMATS[parser].opened_by_prompt)

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


@dataclass(frozen=True, slots=True)
class HarmonyTokens:
    """gpt-oss's tokenizer's ids of the harmony markers, and of the word `analysis`."""

    channel: int
    message: int
    ends: frozenset[int]  # <|end|>, <|start|>, <|return|>, <|call|>: a message's body ends
    analysis: tuple[int, ...]


def reasoning_count_tokens(tokenizer: Any, parser: str) -> ThinkTokens | HarmonyTokens | None:
    """What counting a reply's reasoning tokens reads (`ServingContext.think_tokens`): the
    thinking markers' ids, or gpt-oss's harmony markers'; None where the markers are no single
    tokens (the count is then 0)."""
    if not REASONING_FORMATS[parser].harmony:
        return think_tokens(tokenizer, parser)
    ids = {marker: single_token_id(tokenizer, marker) for marker in HARMONY_MARKERS}
    if None in ids.values():
        return None
    ends = frozenset(ids[marker] for marker in (harmony.END, harmony.START, harmony.RETURN, harmony.CALL))
    return HarmonyTokens(ids[harmony.CHANNEL], ids[harmony.MESSAGE], ends,
                         tuple(tokenizer.encode("analysis", add_special_tokens=False)))


@dataclass(slots=True)
class HarmonyTokenCounter:
    """Counts the tokens of a harmony reply's analysis bodies (vLLM's reasoning_tokens for
    gpt-oss): after a `<|message|>` whose header names the analysis channel, up to its end."""

    tokens: HarmonyTokens
    header: list[int] | None = None  # the ids after <|channel|> while the header is read
    inside: bool = False
    count: int = 0

    def feed(self, token_ids: Any) -> int:
        tokens = self.tokens
        for token_id in token_ids:
            if token_id == tokens.channel:
                self.header, self.inside = [], False
            elif token_id == tokens.message:
                self.inside = self.header is not None and tuple(self.header[:len(tokens.analysis)]) == tokens.analysis
                self.header = None
            elif token_id in tokens.ends:
                self.header, self.inside = None, False
            elif self.header is not None:
                self.header.append(token_id)
            elif self.inside:
                self.count += 1
        return self.count
