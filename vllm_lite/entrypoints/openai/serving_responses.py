"""POST /v1/responses (and GET /v1/responses/{id}): a Responses API request runs as the chat
completion it describes (responses_protocol.py); its answer is a list of output items
(reasoning, message, function_call), streamed with the events vLLM emits for non-harmony
models:

| moment | events |
|---|---|
| start | response.created, response.in_progress |
| reasoning (--reasoning-parser) | output_item.added, reasoning_text.delta..., reasoning_text.done, output_item.done |
| text | output_item.added, content_part.added, output_text.delta..., output_text.done, content_part.done, output_item.done |
| each tool call | output_item.added, function_call_arguments.delta..., function_call_arguments.done, output_item.done |
| end | response.completed (status "incomplete" when max_output_tokens cut it) |

Every event carries its `sequence_number`; an error after the stream began is one `error`
event. A stored response (`store`, the default) can be continued with previous_response_id
for the server's lifetime, within --max-stored-responses (the oldest are forgotten first).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vllm_lite.entrypoints.openai.errors import ApiError
from vllm_lite.entrypoints.openai.protocol import RequestParamError
from vllm_lite.entrypoints.openai.reasoning_parsers import ReasoningStream, ReasoningTokenCounter, split_reasoning
from vllm_lite.entrypoints.openai.responses_protocol import (ResponsesRequest, function_call_item, message_item,
                                                             new_id, output_as_messages, output_text_part,
                                                             reasoning_item)
from vllm_lite.entrypoints.openai.serving import (ServingContext, SSEResponse, cancel_on_disconnect, check_length,
                                                  collect_choices, sse_error, start_stream, tracked_generate)
from vllm_lite.entrypoints.openai.serving_chat import chat_logprobs, chat_prompt
from vllm_lite.entrypoints.openai.serving_tools import ToolPlan, constrain, extract_tool_calls, plan_tools
from vllm_lite.entrypoints.openai.tool_streaming import ToolCallStream
from vllm_lite.outputs import Logprob, RequestOutput


@dataclass(slots=True)
class ResponseTurn:
    """What a response's body needs besides its output."""

    request: ResponsesRequest
    response_id: str
    model: str
    max_output_tokens: int
    history: list[dict[str, Any]]  # the conversation before this turn (no instructions)
    tools: ToolPlan
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        request = self.request
        return {"id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": request.instructions, "max_output_tokens": self.max_output_tokens,
                "model": self.model, "output": output, "parallel_tool_calls": True,
                "previous_response_id": request.previous_response_id, "reasoning": request.reasoning,
                "store": request.store, "top_logprobs": request.top_logprobs or 0,
                "temperature": 1.0 if request.temperature is None else request.temperature,
                "top_p": 1.0 if request.top_p is None else request.top_p,
                "text": request.text or {"format": {"type": "text"}}, "tool_choice": request.tool_choice,
                "tools": request.tools, "truncation": "disabled", "usage": usage, "user": request.user,
                "metadata": request.metadata, "background": False, "service_tier": request.service_tier}


async def create_response(ctx: ServingContext, request: ResponsesRequest, raw_request: Request) -> Response:
    request.check_supported()
    model = ctx.served_model(request.model)
    history = ctx.responses.history(request.previous_response_id)
    if history is None:
        raise ApiError(404, "NotFoundError", f"Response with id '{request.previous_response_id}' not found.",
                       "previous_response_id")
    chat = request.chat_request(history)
    try:
        params = chat.to_sampling_params(ctx.vocab_size, ctx.sampling_defaults)
        tools = plan_tools(chat, ctx.options)
        params = constrain(params, chat, tools)
    except RequestParamError as exc:
        raise request.chat_error(exc) from None
    prompt = await chat_prompt(ctx, chat)
    num_prompt_tokens = len(prompt["prompt_token_ids"])
    check_length(ctx, num_prompt_tokens, params.max_tokens, "input")
    response_id, engine_request_id = request.ids()
    turn = ResponseTurn(request, response_id, model, params.max_tokens or ctx.max_model_len - num_prompt_tokens,
                        history, tools)
    stream = tracked_generate(ctx, prompt, params, engine_request_id, request.priority)
    if request.stream:
        started = await start_stream(stream)
        return SSEResponse(_sse(_stream_events(ctx, turn, started)), last=None, error_event=_sse_error)
    return JSONResponse(await cancel_on_disconnect(_full_response(ctx, turn, stream), raw_request))


async def retrieve_response(ctx: ServingContext, response_id: str) -> JSONResponse:
    return JSONResponse(_stored_body(ctx, response_id))


async def cancel_response(ctx: ServingContext, response_id: str) -> JSONResponse:
    """POST /v1/responses/{id}/cancel: only background responses can be cancelled (vLLM's
    answer for the others, the only kind this server runs)."""
    _stored_body(ctx, response_id)
    raise ApiError(400, "BadRequestError", "Cannot cancel a synchronous response.", "response_id")


def _stored_body(ctx: ServingContext, response_id: str) -> dict[str, Any]:
    body = ctx.responses.body(response_id)
    if body is None:
        raise ApiError(404, "NotFoundError", f"Response with id '{response_id}' not found.", "response_id")
    return body


# --------------------------------------------------------------------------- whole response


async def _full_response(ctx: ServingContext, turn: ResponseTurn,
                         stream: AsyncGenerator[RequestOutput, None]) -> dict[str, Any]:
    usage = _Usage.for_server(ctx)
    collected = await collect_choices(usage.counting(stream), 1)
    choice = collected.choices[0]
    incomplete = choice.finish_reason == "length"
    logprobs = _logprobs(ctx, turn.request, choice.token_ids, choice.logprobs)
    output = _output_items(ctx, turn, choice.text, incomplete, logprobs)
    return _finish(ctx, turn, output, incomplete, usage)


def _hides_reasoning(ctx: ServingContext, request: ResponsesRequest) -> bool:
    return ctx.options.reasoning_parser is not None and not request.include_reasoning


def _logprobs(ctx: ServingContext, request: ResponsesRequest, token_ids: list[int],
              logprobs: list[dict[int, Logprob]]) -> list[dict[str, Any]] | None:
    """The output_text's logprobs, as vLLM gives them: every generated token's (the reasoning's
    too), none when the reasoning is hidden."""
    if not request.wants_logprobs() or _hides_reasoning(ctx, request):
        return None
    return chat_logprobs(ctx.tokenizer, token_ids, logprobs, request.top_logprobs or 0).model_dump()["content"]


def _output_items(ctx: ServingContext, turn: ResponseTurn, text: str, incomplete: bool,
                  logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    tools = turn.tools
    reasoning, content = None, text
    if ctx.options.reasoning_parser is not None:
        reasoning, content = split_reasoning(ctx.options.reasoning_parser, text)
    if _hides_reasoning(ctx, turn.request):
        reasoning = None
    calls: list[dict[str, Any]] = []
    if tools.parses_output:
        calls, content = extract_tool_calls(tools, content or "")
    items = []
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning))
    if content and content.strip():
        items.append(message_item(new_id("msg"), content, "incomplete" if incomplete else "completed", logprobs))
    for call in calls:
        items.append(function_call_item(new_id("fc"), call["id"], call["function"]["name"],
                                        call["function"]["arguments"]))
    return items


@dataclass(slots=True)
class _Usage:
    reasoning: ReasoningTokenCounter | None = None
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @classmethod
    def for_server(cls, ctx: ServingContext) -> _Usage:
        parser = ctx.options.reasoning_parser
        return cls(None if parser is None else ReasoningTokenCounter.for_parser(parser, ctx.think_tokens))

    async def counting(self, stream: AsyncIterator[RequestOutput]) -> AsyncGenerator[RequestOutput, None]:
        async with contextlib.aclosing(stream):
            async for output in stream:
                self.input_tokens = len(output.prompt_token_ids)
                self.cached_tokens = output.num_cached_tokens
                for completion in output.outputs:
                    self.output_tokens += len(completion.token_ids)
                    if self.reasoning is not None:
                        self.reasoning.feed(completion.token_ids)
                yield output

    def json(self) -> dict[str, Any]:
        reasoning_tokens = 0 if self.reasoning is None else self.reasoning.count
        return {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": self.input_tokens + self.output_tokens}


def _finish(ctx: ServingContext, turn: ResponseTurn, output: list[dict[str, Any]], incomplete: bool,
            usage: _Usage) -> dict[str, Any]:
    """The final body; stored (with the conversation it continues) when the request asks."""
    body = turn.body(output, "incomplete" if incomplete else "completed", usage.json())
    if turn.request.store:
        conversation = [*turn.history, *turn.request.input_messages(), *output_as_messages(output)]
        ctx.responses.put(turn.response_id, conversation, body)
    return body


# --------------------------------------------------------------------------- streaming


async def _sse(events: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[bytes, None]:
    """Each event as `event: <type>` + its JSON."""
    async with contextlib.aclosing(events):
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def _sse_error(exc: Exception) -> bytes:
    """An error met after the stream began: an `error` event (the openai client raises it)."""
    return b"event: error\n" + sse_error(exc)


@dataclass(slots=True)
class _OpenItem:
    kind: str  # reasoning | message | function_call
    item: dict[str, Any]
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class _EventWriter:
    """The stream's output items, opened and closed in order, as events."""

    sequence_number: int = 0
    done: list[dict[str, Any]] = field(default_factory=list)
    current: _OpenItem | None = None
    pending_space: str = ""  # text that is only whitespace so far: no message for it yet
    pending_logprobs: list[dict[str, Any]] = field(default_factory=list)  # of tokens whose text is not out yet

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _where(self) -> dict[str, Any]:
        assert self.current is not None
        return {"item_id": self.current.item["id"], "output_index": len(self.done)}

    def _open(self, kind: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.current = _OpenItem(kind, item)
        events.append(self.event("response.output_item.added", output_index=len(self.done), item=dict(item)))
        if kind == "message":
            events.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                     part=output_text_part("")))
        return events

    def reasoning(self, delta: str) -> list[dict[str, Any]]:
        events = [] if self.current is not None and self.current.kind == "reasoning" else \
            self._open("reasoning", reasoning_item(new_id("rs"), "", "in_progress"))
        self.current.text += delta
        events.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=delta))
        return events

    def text(self, delta: str) -> list[dict[str, Any]]:
        if self.current is None or self.current.kind != "message":
            if not (self.pending_space + delta).strip():
                self.pending_space += delta
                return []
            delta, self.pending_space = self.pending_space + delta, ""
            events = self._open("message", message_item(new_id("msg"), None, "in_progress"))
        else:
            events = []
        self.current.text += delta
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        self.current.logprobs += logprobs
        events.append(self.event("response.output_text.delta", **self._where(), content_index=0, delta=delta,
                                 logprobs=logprobs))
        return events

    def call(self, name: str | None, call_id: str | None, delta: str) -> list[dict[str, Any]]:
        events = []
        if name is not None:
            events = self._open("function_call", function_call_item(new_id("fc"), call_id or new_id("call"), name, "",
                                                                    "in_progress"))
        assert self.current is not None and self.current.kind == "function_call"
        self.current.text += delta
        if delta:
            events.append(self.event("response.function_call_arguments.delta", **self._where(), delta=delta))
        return events

    def close(self, incomplete: bool = False) -> list[dict[str, Any]]:
        """Closes the open item: its done events."""
        current, events = self.current, []
        if current is None:
            return events
        where = self._where()
        if current.kind == "reasoning":
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=current.text))
            item = reasoning_item(current.item["id"], current.text)
        elif current.kind == "message":
            part = output_text_part(current.text, current.logprobs)
            events.append(self.event("response.output_text.done", **where, content_index=0, text=current.text,
                                     logprobs=current.logprobs))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item = message_item(current.item["id"], current.text, "incomplete" if incomplete else "completed",
                                current.logprobs)
        else:
            item = function_call_item(current.item["id"], current.item["call_id"], current.item["name"],
                                      current.text)
            events.append(self.event("response.function_call_arguments.done", **where, arguments=current.text))
        events.append(self.event("response.output_item.done", output_index=len(self.done), item=item))
        self.done.append(item)
        self.current = None
        return events


async def _stream_events(ctx: ServingContext, turn: ResponseTurn,
                         stream: AsyncIterator[RequestOutput]) -> AsyncGenerator[dict[str, Any], None]:
    writer, usage = _EventWriter(), _Usage.for_server(ctx)
    started = turn.body([], "in_progress", None)
    yield writer.event("response.created", response=started)
    yield writer.event("response.in_progress", response=started)
    parser = ctx.options.reasoning_parser
    pieces = _PieceSplitter(ReasoningStream(parser) if parser else None,
                            ToolCallStream(turn.tools) if turn.tools.parses_output else None,
                            _hides_reasoning(ctx, turn.request))
    finish_reason = None
    async with contextlib.aclosing(usage.counting(stream)) as outputs:
        async for output in outputs:
            completion = output.outputs[0]
            finish_reason = completion.finish_reason or finish_reason
            writer.pending_logprobs += _logprobs(ctx, turn.request, completion.token_ids,
                                                 completion.logprobs or []) or []
            for event in pieces.events(writer, completion.text, completion.finish_reason is not None):
                yield event
    incomplete = finish_reason == "length"
    for event in writer.close(incomplete):
        yield event
    yield writer.event("response.completed", response=_finish(ctx, turn, writer.done, incomplete, usage))


@dataclass(slots=True)
class _PieceSplitter:
    """A delta of text -> its reasoning, content and tool-call pieces, as events."""

    reasoning_stream: ReasoningStream | None
    tool_stream: ToolCallStream | None
    hide_reasoning: bool = False

    def events(self, writer: _EventWriter, delta: str, final: bool) -> list[dict[str, Any]]:
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
