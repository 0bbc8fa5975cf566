"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, as vLLM serves it.
A request runs as the chat completion it describes (anthropic_protocol.py); its answer is a
message of content blocks (thinking with --reasoning-parser, text, tool_use), streamed as
Anthropic's events:

| moment | events |
|---|---|
| start | message_start (the message with no content yet, its input tokens) |
| each block, in order: thinking, text, tool_use | content_block_start, content_block_delta... (thinking_delta then a signature_delta / text_delta / input_json_delta), content_block_stop |
| end | message_delta (stop_reason, stop_sequence, usage), message_stop |

stop_reason: "max_tokens" when max_tokens cut the reply; "tool_use" when it holds complete
tool calls; "stop_sequence" (with stop_sequence) when one of stop_sequences ended it; else
"end_turn". usage: input_tokens, output_tokens, and with --enable-prompt-tokens-details the
prefix-cached part as cache_read_input_tokens (input_tokens is then the rest, Anthropic's sum).
Errors, before or during the stream, are Anthropic's error object (errors.py). The thinking
blocks' signatures are random: this server does not check them when they come back.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vllm_lite.entrypoints.openai.anthropic_protocol import (AnthropicConversation, AnthropicCountTokensRequest,
                                                             AnthropicMessagesRequest)
from vllm_lite.entrypoints.openai.errors import ApiError, anthropic_error_body, describe_error
from vllm_lite.entrypoints.openai.protocol import RequestParamError
from vllm_lite.entrypoints.openai.reasoning_parsers import ReasoningStream, split_reasoning
from vllm_lite.entrypoints.openai.serving import (ServingContext, SSEResponse, cancel_on_disconnect, fit_max_tokens,
                                                  collect_choices, render_chat, start_stream, tracked_generate)
from vllm_lite.entrypoints.openai.serving_chat import chat_prompt
from vllm_lite.entrypoints.openai.serving_tools import ToolPlan, chat_sampling, extract_tool_calls
from vllm_lite.entrypoints.openai.tool_streaming import HeldSpace, ReplySplitter, ToolCallStream
from vllm_lite.outputs import RequestOutput

# A chat field's error, in the Messages API's terms.
_ANTHROPIC_PARAM = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
                    "response_format": "output_config.format", "reasoning_effort": "output_config.effort"}


@dataclass(slots=True)
class _Turn:
    message_id: str
    model: str
    tools: ToolPlan
    num_prompt_tokens: int
    omit_thinking: bool = False  # thinking.display "omitted"


async def create_message(ctx: ServingContext, request: AnthropicMessagesRequest, raw_request: Request) -> Response:
    request.refuse_unknown_fields()
    model, lora = ctx.served_model_and_lora(request.model)
    chat = request.chat_request(await _merges_inline_system(ctx, request))
    try:
        params, tools = chat_sampling(ctx, chat)
    except RequestParamError as exc:
        raise _in_anthropic_terms(exc) from None
    prompt = await chat_prompt(ctx, chat)
    num_prompt_tokens = len(prompt["prompt_token_ids"])
    params = fit_max_tokens(ctx, num_prompt_tokens, params, "messages")
    turn = _Turn(f"msg_{uuid.uuid4().hex}", model, tools, num_prompt_tokens, request.omits_thinking())
    stream = tracked_generate(ctx, prompt, params, turn.message_id, lora=lora)
    if request.stream:
        started = await start_stream(stream)
        return SSEResponse(_sse(_stream_events(ctx, turn, started)), last=None, error_event=_sse_error)
    return JSONResponse(await cancel_on_disconnect(_full_message(ctx, turn, stream), raw_request))


async def count_tokens(ctx: ServingContext, request: AnthropicCountTokensRequest) -> JSONResponse:
    """The prompt's length as the Messages request would render it (vLLM's body: with
    context_management's original_input_tokens, the same number)."""
    request.refuse_unknown_fields()
    ctx.served_model(request.model)
    prompt = await chat_prompt(ctx, request.chat_request(await _merges_inline_system(ctx, request)))
    num_tokens = len(prompt["prompt_token_ids"])
    return JSONResponse({"input_tokens": num_tokens, "context_management": {"original_input_tokens": num_tokens}})


async def _merges_inline_system(ctx: ServingContext, request: AnthropicConversation) -> bool:
    """vLLM's rule: system messages after the first join the leading system prompt when the
    chat template refuses a conversation with one there (Qwen's templates raise). Tried only for
    a request that has such messages."""
    if not any(isinstance(message, dict) and message.get("role") == "system" for message in request.messages):
        return False
    probe = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
    try:
        await render_chat(ctx, probe, add_generation_prompt=False)
    except ApiError:
        return True
    return False


def _in_anthropic_terms(exc: RequestParamError) -> RequestParamError:
    param = _ANTHROPIC_PARAM.get(exc.param, exc.param)
    message = str(exc)
    for chat_name, name in _ANTHROPIC_PARAM.items():
        if chat_name != "stop":  # (a common word)
            message = message.replace(chat_name, name)
    return RequestParamError(param, message)


def _stop_reason(finish_reason: str | None, stop_reason: int | str | None,
                 has_complete_calls: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence), vLLM's mapping: max_tokens wins; complete tool calls win
    over a stop string; a stop string (not a stop token) is a stop_sequence."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if has_complete_calls:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


@dataclass(slots=True)
class _Usage:
    """Anthropic's usage: input_tokens + cache_read_input_tokens is the prompt."""

    input_tokens: int
    cached_tokens: int | None = None  # the prefix-cached part, with --enable-prompt-tokens-details
    output_tokens: int = 0

    def json(self) -> dict[str, int]:
        if self.cached_tokens is None:
            return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}
        return {"input_tokens": self.input_tokens - self.cached_tokens, "output_tokens": self.output_tokens,
                "cache_read_input_tokens": self.cached_tokens}


def _arguments(call: dict[str, Any]) -> dict[str, Any] | None:
    """A call's arguments as an object; None when they do not parse (cut by max_tokens)."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        return None
    return arguments if isinstance(arguments, dict) else None


# --------------------------------------------------------------------------- whole message


async def _full_message(ctx: ServingContext, turn: _Turn,
                        stream: AsyncGenerator[RequestOutput, None]) -> dict[str, Any]:
    collected = await collect_choices(stream, 1)
    choice = collected.choices[0]
    reasoning, text = None, choice.text
    if ctx.options.reasoning_parser is not None:
        reasoning, text = split_reasoning(ctx.options.reasoning_parser, choice.text, turn.tools.parses_output)
        if ctx.hides_reasoning(True):
            reasoning = None
    calls, content = extract_tool_calls(turn.tools, text or "") if turn.tools.parses_output else ([], text)
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": "" if turn.omit_thinking else reasoning,
                       "signature": uuid.uuid4().hex})
    uses = [(call, _arguments(call)) for call in calls]
    # A call whose arguments were cut short is no call: its text stays (as text) rather than be lost.
    cut = "".join(call["function"]["arguments"] for call, arguments in uses if arguments is None)
    if content and (content.strip() or not uses) or cut:  # (whitespace beside tool calls is no text block)
        blocks.append({"type": "text", "text": (content or "") + cut})
    blocks += [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments}
               for call, arguments in uses if arguments is not None]
    stop_reason, stop_sequence = _stop_reason(choice.finish_reason, choice.stop_reason,
                                              any(arguments is not None for _, arguments in uses))
    usage = _Usage(turn.num_prompt_tokens, ctx.cached_tokens_detail(collected.num_cached_tokens),
                   len(choice.token_ids))
    return {"id": turn.message_id, "type": "message", "role": "assistant",
            "content": blocks or [{"type": "text", "text": ""}],  # (Anthropic's empty reply: one empty text block)
            "model": turn.model, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage.json()}


# --------------------------------------------------------------------------- streaming


async def _sse(events: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[bytes, None]:
    async with contextlib.aclosing(events):
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def _sse_error(exc: Exception) -> bytes:
    """An error met after the stream began: Anthropic's `error` event (its clients raise it)."""
    status, _, message, _ = describe_error(exc)
    return f"event: error\ndata: {json.dumps(anthropic_error_body(status, message))}\n\n".encode()


@dataclass(slots=True)
class _BlockWriter:
    """The message's content blocks, opened and closed in order, as events."""

    omit_thinking: bool = False  # thinking blocks without their text (thinking.display "omitted")
    index: int = -1  # the open (or last) block's
    kind: str | None = None  # the open block's type
    space: HeldSpace = field(default_factory=HeldSpace)  # text that is only whitespace so far
    call_arguments: list[str] = field(default_factory=list)  # the open tool_use block's, so far

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.index, self.kind = self.index + 1, block["type"]
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def reasoning(self, delta: str) -> list[dict[str, Any]]:
        events = [] if self.kind == "thinking" else self._open({"type": "thinking", "thinking": "", "signature": ""})
        if self.omit_thinking:
            return events
        return events + [self._delta({"type": "thinking_delta", "thinking": delta})]

    def flush_space(self, tool_used: bool) -> list[dict[str, Any]]:
        """At the end: whitespace still held is the reply's text (a text block, as vLLM's), unless
        a tool call came after it."""
        return [] if tool_used or not self.space.held else self.text("", final=True)

    def text(self, delta: str, final: bool = False) -> list[dict[str, Any]]:
        events = []
        if self.kind != "text":
            delta = self.space.release(delta, final)
            if delta is None:
                return []
            events = self._open({"type": "text", "text": ""})
        return events + [self._delta({"type": "text_delta", "text": delta})]

    def call(self, name: str | None, call_id: str | None, delta: str) -> list[dict[str, Any]]:
        events = []
        if name is not None:
            events = self._open({"type": "tool_use", "id": call_id or f"toolu_{uuid.uuid4().hex}", "name": name,
                                 "input": {}})
            self.call_arguments = []
        if delta:
            self.call_arguments.append(delta)
            events.append(self._delta({"type": "input_json_delta", "partial_json": delta}))
        return events

    def close(self) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        events = []
        if self.kind == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": uuid.uuid4().hex}))
        events.append({"type": "content_block_stop", "index": self.index})
        self.kind = None
        return events


async def _stream_events(ctx: ServingContext, turn: _Turn,
                         stream: AsyncIterator[RequestOutput]) -> AsyncGenerator[dict[str, Any], None]:
    usage = _Usage(turn.num_prompt_tokens)  # (the cache's share is known at the end: message_delta says it)
    yield {"type": "message_start", "message": {
        "id": turn.message_id, "type": "message", "role": "assistant", "content": [], "model": turn.model,
        "stop_reason": None, "stop_sequence": None, "usage": usage.json()}}
    writer = _BlockWriter(turn.omit_thinking)
    parser = ctx.options.reasoning_parser
    tool_stream = ToolCallStream(turn.tools) if turn.tools.parses_output else None
    pieces = ReplySplitter(ReasoningStream(parser, turn.tools.parses_output) if parser else None, tool_stream,
                           ctx.hides_reasoning(True))
    finish_reason, stop_reason, tool_used, cached_tokens = None, None, False, 0
    async with contextlib.aclosing(stream):
        async for output in stream:
            completion = output.outputs[0]
            cached_tokens = max(cached_tokens, output.num_cached_tokens)
            usage.output_tokens += len(completion.token_ids)
            if completion.finish_reason is not None:
                finish_reason, stop_reason = completion.finish_reason, completion.stop_reason
            for event in pieces.events(writer, completion.text, completion.finish_reason is not None):
                tool_used = tool_used or event["type"] == "content_block_start" and \
                    event["content_block"]["type"] == "tool_use"
                yield event
    complete = tool_used and _arguments({"function": {"arguments": "".join(writer.call_arguments)}}) is not None
    for event in [*writer.flush_space(tool_used), *writer.close()]:
        yield event
    usage.cached_tokens = ctx.cached_tokens_detail(cached_tokens)
    reason, sequence = _stop_reason(finish_reason, stop_reason, complete)
    yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
           "usage": usage.json()}
    yield {"type": "message_stop"}
