"""gpt-oss's replies in OpenAI's harmony format, read as vLLM reads them (its HarmonyParser):
messages `<|channel|>CHANNEL[ to=RECIPIENT][<|constrain|>TYPE]<|message|>BODY<|end|>`, each
after the first opened by `<|start|>ROLE` (the prompt opens the first: `<|start|>assistant`), the
last ended by `<|return|>` or `<|call|>` (stop tokens: not in the text).

| message | is |
|---|---|
| channel `analysis` | reasoning (`--reasoning-parser openai_gptoss`; without it, left out, as vLLM) |
| channel `final`, or `commentary` with no recipient (a preamble) | content |
| recipient `functions.NAME` | a call of NAME (`--tool-call-parser openai`), its body the arguments |
| anything else (a built-in tool's recipient: browser, python) | left out |

Parts of one kind are joined with a newline. A reply without any header (a grammar's output) is
all content. For the tool parser, the calls follow the content
in one canonical form, `<|start|>assistant to=functions.NAME<|channel|>commentary<|constrain|>TYPE
<|message|>ARGS<|call|>` (tool_parsers.parse_openai reads it); without a tool parser they are
left out. The text must keep the special tokens (the server detokenizes gpt-oss replies so)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_lite.reasoning_tags import HARMONY_MARKERS

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = HARMONY_MARKERS
FUNCTION_PREFIX = "functions."
CALL_BLOCK_START = f"{START}assistant to={FUNCTION_PREFIX}"

_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CONSTRAIN = re.compile(re.escape(CONSTRAIN) + r"\s*([^\s<]+)")
_BARE_TYPE = re.compile(re.escape(CHANNEL) + r"\s*commentary\s+(?:to=\S+\s+)?([A-Za-z_/]+)\s*$")


@dataclass(frozen=True, slots=True)
class HarmonyMessage:
    channel: str | None
    recipient: str | None
    content_type: str | None
    body: str
    complete: bool  # its end token was read (else the text stopped inside it)

    @property
    def kind(self) -> str:
        """reasoning | content | call | other (vLLM's segment types)."""
        if self.recipient is not None and self.recipient.startswith(FUNCTION_PREFIX):
            return "call"
        if self.channel == "analysis":
            return "reasoning"
        if self.channel == "final" or (self.channel == "commentary" and self.recipient is None):
            return "content"
        return "other"


def parse_messages(text: str) -> list[HarmonyMessage]:
    """The messages of a reply whose headers are complete (a header still being generated is
    not a message yet)."""
    messages = []
    for index, part in enumerate(text.split(START)):
        header, found, rest = part.partition(MESSAGE)
        if not found:
            continue
        ends = [(rest.find(marker), marker) for marker in (END, RETURN, CALL) if marker in rest]
        body = rest[:min(ends)[0]] if ends else rest
        messages.append(_message(header if index else "assistant" + header, body, bool(ends)))
    return messages


def _message(header: str, body: str, complete: bool) -> HarmonyMessage:
    channel = _CHANNEL.search(header)
    recipient = _RECIPIENT.search(header)
    constrain = _CONSTRAIN.search(header) or _BARE_TYPE.search(header)
    return HarmonyMessage(channel.group(1) if channel else None, recipient.group(1) if recipient else None,
                          constrain.group(1) if constrain else None, body, complete)


def split(text: str, keep_calls: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) of a reply: analysis bodies, and the content bodies followed (with
    `keep_calls`) by the calls in their canonical form; None for an empty part. A reply with no
    harmony header at all (one a grammar constrained: structured outputs, a forced tool call) is
    all content, as vLLM recovers raw text."""
    if not any(marker in text for marker in (START, CHANNEL, MESSAGE)):
        return None, text or None
    messages = parse_messages(text)
    reasoning = "\n".join(m.body for m in messages if m.kind == "reasoning" and m.body)
    content = "\n".join(m.body for m in messages if m.kind == "content" and m.body)
    if keep_calls:
        content += "".join(call_block(m) for m in messages if m.kind == "call")
    return reasoning or None, content or None


def call_block(message: HarmonyMessage) -> str:
    return (f"{START}assistant to={message.recipient}{CHANNEL}commentary{CONSTRAIN}{message.content_type or 'json'}"
            f"{MESSAGE}{message.body}{CALL if message.complete else ''}")


def partial_marker_length(text: str) -> int:
    """Length of a trailing piece of `text` that may be the start of a special token (held back
    while streaming: it may open a header that changes what the text before it is)."""
    start = text.rfind("<|")
    if start < 0 or "|>" in text[start:]:
        return 1 if text.endswith("<") else 0
    return len(text) - start
