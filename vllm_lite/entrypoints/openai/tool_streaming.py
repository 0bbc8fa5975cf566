"""Streamed tool calls: a choice's text deltas in, content deltas and tool-call deltas out,
the arguments sent as they are generated (as vLLM's streaming tool parsers do), not in one
piece at the end.

Each feed re-reads the choice's whole text and works out what is certain so far:

| format | content | calls |
|---|---|---|
| hermes / qwen3 / qwen3_json | the text before the first `<tool_call>` | each `<tool_call>` object's `name`, then its `arguments` value |
| llama3_json | none when the reply starts with `{` (after `<\\|python_tag\\|>`), else all the text | objects joined by `;`, `parameters` (or `arguments`) |
| mistral, granite, jamba | the text before the marker (`[TOOL_CALLS]`, `<|tool_call|>` / `<tool_call>`, `<tool_calls>`) | the objects of the array after it |
| phi4_mini_json | none | the objects of the array after `functools` |
| lfm2 | the text before `<|tool_call_start|>` | (pythonic) decided when the choice ends |
| gemma4 | the text before the first `<\|tool_call>` | decided when the choice ends |
| qwen3_coder / qwen3_xml | the text before the first `<tool_call>` (or a bare `<function=`) | (typed by the tools' schemas) decided when the choice ends |
| openai (gpt-oss) | the final channel's text (harmony.py puts the calls after it) | each message to `functions.NAME`, its body |
| required | none | the objects of the JSON array, `parameters` |
| named | none | one call to the named function: the whole text is its arguments |
| pythonic | (not incremental) everything is decided when the choice ends |

A call is announced once its name is complete; its arguments are then the raw JSON text of the
value as far as it has been generated, so the pieces concatenate to exactly that value (valid
JSON once the value is complete). What has been sent is never taken back: each new view
extends the previous one. When the choice ends, the whole-text parser (tool_parsers.py) decides
what it holds; calls it finds that were not streamed (pythonic, arguments given as a string)
are sent whole, and a reply it reads as plain text sends its held-back text as content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm_lite.entrypoints.openai.harmony import CALL_BLOCK_START
from vllm_lite.entrypoints.openai.reasoning_parsers import ReasoningStream
from vllm_lite.entrypoints.openai.serving_tools import ToolPlan, extract_tool_calls
from vllm_lite.entrypoints.openai.tool_parsers import (ARRAY_FORMATS, GEMMA4_CALL_START, LFM2_START, QWEN3_FUNCTION,
                                                       QWEN3_XML_OPEN, ArrayFormat, openai_call_blocks)

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(slots=True)
class ToolCallDelta:
    """One piece of call `index`: its first piece carries `call_id` and `name`."""

    index: int
    arguments: str
    name: str | None = None
    call_id: str | None = None

    def to_openai(self) -> dict:
        """Chat completions' delta shape."""
        function: dict = {"arguments": self.arguments}
        out: dict = {"index": self.index}
        if self.name is not None:
            out.update(id=self.call_id, type="function")
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass(slots=True)
class _CallView:
    name: str | None
    arguments: str  # raw JSON text of the arguments value so far
    complete: bool = False


@dataclass(slots=True)
class _SentCall:
    name: str
    call_id: str
    arguments: str = ""


@dataclass(slots=True)
class ToolCallStream:
    """One choice of a tool-call request (plan.mode != "none")."""

    plan: ToolPlan
    text: str = ""
    sent_content: str = ""
    sent_calls: list[_SentCall] = field(default_factory=list)

    def feed(self, delta: str, final: bool) -> tuple[str | None, list[ToolCallDelta]]:
        """The new content and call pieces that `delta` makes certain (all of it when `final`)."""
        self.text += delta
        content, views = self._view(final)
        new_content = self._advance_content(content)
        pieces = self._advance_calls(views)
        if final:
            extra_content, extra_calls = self._finish()
            new_content = (new_content or "") + extra_content or None
            pieces += extra_calls
        return new_content, pieces

    @property
    def arguments(self) -> list[str]:
        """Each streamed call's arguments so far."""
        return [call.arguments for call in self.sent_calls]

    # ---- views of the text so far

    def _view(self, final: bool) -> tuple[str, list[_CallView]]:
        mode, text = self.plan.mode, self.text
        if mode == "named":
            return "", [_CallView(self.plan.function_name, text, final)]
        if mode == "required":
            return "", _array_calls(text, 0, ("parameters",))
        parser = self.plan.parser
        if parser in ("hermes", "qwen3", "qwen3_json"):
            return _hermes_view(text, final)
        if parser in ("llama3_json", "llama4_json"):
            return _llama3_view(text, final)
        if parser in ARRAY_FORMATS:
            return _array_format_view(ARRAY_FORMATS[parser], text, final)
        if parser in ("lfm2", "gemma4"):  # the content before the calls streams; the calls are decided at the end
            marker = LFM2_START if parser == "lfm2" else GEMMA4_CALL_START
            start = text.find(marker)
            return (_held_back(text, marker, final) if start < 0 else text[:start]), []
        if parser == "openai":  # gpt-oss: each call's body (its arguments) as it is generated
            start = text.find(CALL_BLOCK_START)
            if start < 0:
                return _held_back(text, CALL_BLOCK_START, final), []
            return text[:start], [_CallView(name, body, complete)
                                  for name, _, body, complete in openai_call_blocks(text[start:])]
        if parser in ("qwen3_coder", "qwen3_xml"):  # the same: a value's type needs the whole value
            starts = [i for i in (text.find(QWEN3_XML_OPEN), text.find(QWEN3_FUNCTION)) if i >= 0]
            if starts:
                return text[:min(starts)], []
            held = min(_held_back(text, QWEN3_XML_OPEN, final), _held_back(text, QWEN3_FUNCTION, final), key=len)
            return held, []
        return "", []  # pythonic: decided when the choice ends

    def _advance_content(self, content: str) -> str | None:
        if not content.startswith(self.sent_content) or len(content) == len(self.sent_content):
            return None
        new = content[len(self.sent_content):]
        self.sent_content = content
        return new

    def _advance_calls(self, views: list[_CallView]) -> list[ToolCallDelta]:
        pieces = []
        for index, view in enumerate(views if self.plan.parallel else views[:1]):
            if index > len(self.sent_calls) or view.name is None:
                break  # calls are announced in order, each once its name is known
            if index == len(self.sent_calls):
                self.sent_calls.append(_SentCall(view.name, f"call_{uuid.uuid4().hex[:24]}"))
                pieces.append(ToolCallDelta(index, "", view.name, self.sent_calls[index].call_id))
            sent = self.sent_calls[index]
            if view.arguments.startswith(sent.arguments) and len(view.arguments) > len(sent.arguments):
                new = view.arguments[len(sent.arguments):]
                sent.arguments = view.arguments
                if pieces and pieces[-1].index == index and pieces[-1].name is not None and not pieces[-1].arguments:
                    pieces[-1].arguments = new  # the announcing piece carries the first arguments
                else:
                    pieces.append(ToolCallDelta(index, new))
        return pieces

    def _finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What the whole-text parser finds beyond what was streamed: calls, and content not sent
        yet (all of a plain reply's held-back text; the text after lfm2's, gemma4's and qwen3_coder's
        call blocks, which is content there)."""
        calls, content = extract_tool_calls(self.plan, self.text)
        rest = (content or "")[len(self.sent_content):] if (content or "").startswith(self.sent_content) else ""
        self.sent_content += rest
        if not calls and not self.sent_calls:
            return rest, []
        pieces = []
        for index, sent in enumerate(self.sent_calls[: len(calls)]):
            if not sent.arguments:  # announced, but its arguments were not an object (a JSON string)
                sent.arguments = calls[index]["function"]["arguments"]
                pieces.append(ToolCallDelta(index, sent.arguments))
        for index in range(len(self.sent_calls), len(calls)):
            function = calls[index]["function"]
            call_id = calls[index]["id"]
            self.sent_calls.append(_SentCall(function["name"], call_id, function["arguments"]))
            pieces.append(ToolCallDelta(index, function["arguments"], function["name"], call_id))
        return rest, pieces


# ---- format readers (pure functions of the text so far)


def _held_back(text: str, tag: str, final: bool) -> str:
    """`text` less a trailing piece that may be the start of `tag`."""
    if final:
        return text
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return text[:-length]
    return text


def _array_format_view(array_format: ArrayFormat, text: str, final: bool) -> tuple[str, list[_CallView]]:
    """The text before the first marker (held back while it may be a marker's start), then the
    array's calls as they are generated."""
    where = array_format.find(text)
    if where is None:
        held = max((len(text) - len(_held_back(text, marker, final)) for marker in array_format.markers), default=0)
        return ("" if not array_format.content_before else text[:len(text) - held]), []
    content = text[:where[0]] if array_format.content_before else ""
    return content, _array_calls(text, where[1], array_format.argument_keys)


def _hermes_view(text: str, final: bool) -> tuple[str, list[_CallView]]:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return _held_back(text, _HERMES_OPEN, final), []
    views = []
    for segment in text[start:].split(_HERMES_OPEN)[1:]:
        body = segment.split(_HERMES_CLOSE)[0]
        offset = len(body) - len(body.lstrip())
        view = _object_call(body, offset, ("arguments",))
        if view is None:
            break
        views.append(view)
    return text[:start], views


def _llama3_view(text: str, final: bool) -> tuple[str, list[_CallView]]:
    body = text.lstrip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    elif _PYTHON_TAG.startswith(body) and not final:
        return "", []  # a possible tag or only whitespace so far: undecided
    if not body:
        return ("" if not final else text), []
    if not body.startswith("{"):
        return text, []
    views, position = [], 0
    while position < len(body):
        view = _object_call(body, position, ("parameters", "arguments"))
        if view is None:
            break
        views.append(view)
        end = _value_end(body, position)
        if end is None:
            break
        position = end
        while position < len(body) and body[position] in " \t\r\n;":
            position += 1
    return "", views


def _array_calls(text: str, start: int, keys: tuple[str, ...]) -> list[_CallView]:
    """The call objects of a JSON array beginning at `start` (after whitespace)."""
    position = _skip_space(text, start)
    if position >= len(text):
        return []
    if text[position] == "{":  # a single object instead of an array
        view = _object_call(text, position, keys)
        return [view] if view is not None else []
    if text[position] != "[":
        return []
    views = []
    position += 1
    while True:
        position = _skip_space(text, position, " \t\r\n,")
        if position >= len(text) or text[position] != "{":
            return views
        view = _object_call(text, position, keys)
        if view is None:
            return views
        views.append(view)
        end = _value_end(text, position)
        if end is None:
            return views
        position = end


def _object_call(text: str, start: int, keys: tuple[str, ...]) -> _CallView | None:
    """The name and the raw arguments value of the (possibly unfinished) JSON object at `start`:
    its top-level members are read one by one, the last one possibly cut short."""
    position = _skip_space(text, start)
    if position >= len(text) or text[position] != "{":
        return None
    name, arguments, complete = None, "", False
    position += 1
    while True:
        position = _skip_space(text, position, " \t\r\n,")
        if position >= len(text) or text[position] != '"':
            break
        key_end = _value_end(text, position)
        if key_end is None:
            break
        key = json.loads(text[position:key_end])
        position = _skip_space(text, key_end)
        if position >= len(text) or text[position] != ":":
            break
        value_start = _skip_space(text, position + 1)
        if value_start >= len(text):
            break
        value_end = _value_end(text, value_start)
        if key == "name":
            if value_end is None:
                break
            value = json.loads(text[value_start:value_end])
            name = value if isinstance(value, str) else None
        elif key in keys and text[value_start] in "{[":
            arguments = text[value_start:value_end] if value_end is not None else text[value_start:]
            complete = value_end is not None
        if value_end is None:
            break
        position = value_end
    return _CallView(name, arguments, complete)


def _skip_space(text: str, position: int, chars: str = " \t\r\n") -> int:
    while position < len(text) and text[position] in chars:
        position += 1
    return position


def _value_end(text: str, start: int) -> int | None:
    """The end of the JSON value at `start`, or None when the text stops inside it."""
    first = text[start]
    if first not in '{["':
        for position in range(start, len(text)):
            if text[position] in ",}] \t\r\n":
                return position
        return None
    depth, in_string, escaped = 0, False, False
    for position in range(start, len(text)):
        char = text[position]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 0:
                    return position + 1
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return position + 1
    return None


@dataclass(slots=True)
class HeldSpace:
    """A PieceWriter's text before its text block opens: while all of it is whitespace it is held
    (whitespace beside a tool call is no text block); at the end (`final`) it is the reply's."""

    held: str = ""

    def release(self, delta: str, final: bool) -> str | None:
        """`delta` after the whitespace held, or None while that is all whitespace still."""
        if not final and not (self.held + delta).strip():
            self.held += delta
            return None
        text, self.held = self.held + delta, ""
        return text


class PieceWriter(Protocol):
    """An API's streamed output blocks (the Responses API's items, Anthropic's content blocks)."""

    def reasoning(self, delta: str) -> list[dict[str, Any]]: ...

    def text(self, delta: str) -> list[dict[str, Any]]: ...

    def call(self, name: str | None, call_id: str | None, delta: str) -> list[dict[str, Any]]: ...


@dataclass(slots=True)
class ReplySplitter:
    """A delta of a reply's text -> its reasoning, content and tool-call pieces, as the events
    `writer` makes of them."""

    reasoning_stream: ReasoningStream | None
    tool_stream: ToolCallStream | None
    hide_reasoning: bool = False

    def events(self, writer: PieceWriter, delta: str, final: bool) -> list[dict[str, Any]]:
        reasoning, text = None, delta
        if self.reasoning_stream is not None:
            reasoning, text = self.reasoning_stream.feed(delta, final)
            if self.hide_reasoning:
                reasoning = None
        events = writer.reasoning(reasoning) if reasoning else []
        calls = []
        if self.tool_stream is not None:
            text, calls = self.tool_stream.feed(text or "", final)
        if text:
            events += writer.text(text)
        for call in calls:
            events += writer.call(call.name, call.call_id, call.arguments)
        return events
