"""`--reasoning-parser`: the `<think>...</think>` part of a chat reply as `reasoning_content`,
the rest as `content` (vLLM's parsers of the same names).

| parser | reasoning is |
|---|---|
| qwen3 | the text between a leading `<think>` and `</think>`; a reply not starting with `<think>` has none |
| deepseek_r1 | the text before `</think>` (its template opens `<think>` in the prompt; a leading one is dropped) |

A reply cut before `</think>` is all reasoning. Streaming gives the same split: `ReasoningStream`
holds back a trailing piece that may be the start of a tag until the next delta decides it.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


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
