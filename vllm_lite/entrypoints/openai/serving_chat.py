"""POST /v1/chat/completions: the messages go through the model's chat template, then one
engine request with n choices."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vllm_lite.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from vllm_lite.entrypoints.openai.serving import (
    MIN_JSON_LOGPROB, ServingContext, SSEResponse, check_length, check_n, check_prompt_chars,
    collect_choices, decode_token, encode_prompt, json_logprob, json_response, render_chat, sse_event,
    sse_stream, start_stream, top_logprobs, tracked_generate
)
from vllm_lite.entrypoints.openai.serving_tools import (ToolPlan, constrain, extract_tool_calls, finish_reason,
                                                        plan_tools)
from vllm_lite.entrypoints.openai.reasoning_parsers import ReasoningStream, split_reasoning
from vllm_lite.outputs import Logprob, RequestOutput


async def create_chat_completion(ctx: ServingContext, request: ChatCompletionRequest,
                                 raw_request: Request) -> Response:
    model = ctx.served_model(request.model)
    check_n(ctx, request.n)
    params = request.to_sampling_params()
    tools = plan_tools(request, ctx.options)
    params = constrain(params, request, tools)
    prompt = await chat_prompt(ctx, request)
    num_prompt_tokens = len(prompt["prompt_token_ids"])
    check_length(ctx, num_prompt_tokens, params.max_tokens)
    request_id = random_id("chatcmpl")
    stream = tracked_generate(ctx, prompt, params, request_id)
    if request.stream:
        started = await start_stream(stream)
        return SSEResponse(sse_stream(_stream_events(ctx, request, model, request_id, num_prompt_tokens, started,
                                                     tools)))
    return await json_response(_full_response(ctx, request, model, request_id, num_prompt_tokens, stream, tools),
                               raw_request)


async def chat_prompt(ctx: ServingContext, request: ChatCompletionRequest) -> dict[str, Any]:
    """The templated text and its token ids (the template adds the special tokens itself)."""
    conversation = request.conversation()
    check_prompt_chars(ctx, sum(len(message["content"]) for message in conversation), "messages")
    text = await render_chat(ctx, conversation, add_generation_prompt=request.add_generation_prompt,
                             continue_final_message=request.continue_final_message,
                             chat_template=request.chat_template, chat_template_kwargs=request.chat_template_kwargs,
                             tools=request.tools)
    prompt = await encode_prompt(ctx, text, add_special_tokens=False, param="messages")
    if request.cache_salt is not None:
        prompt["cache_salt"] = request.cache_salt
    return prompt


def _num_top(request: ChatCompletionRequest) -> int | None:
    return (request.top_logprobs or 0) if request.logprobs else None


async def _full_response(ctx: ServingContext, request: ChatCompletionRequest, model: str, request_id: str,
                         num_prompt_tokens: int, stream: AsyncGenerator[RequestOutput, None],
                         tools: ToolPlan = ToolPlan("none")) -> ChatCompletionResponse:
    accumulated = await collect_choices(stream, request.n)
    num_top = _num_top(request)
    choices = []
    for index, acc in enumerate(accumulated):
        logprobs = None if num_top is None else chat_logprobs(ctx.tokenizer, acc.token_ids, acc.logprobs, num_top)
        reasoning, text = None, acc.text
        if ctx.options.reasoning_parser is not None:
            reasoning, text = split_reasoning(ctx.options.reasoning_parser, acc.text)
        calls, content = extract_tool_calls(tools, text or "") if tools.parses_output else ([], text)
        message = ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=calls)
        choices.append(ChatCompletionResponseChoice(index=index, message=message,
                                                    logprobs=logprobs,
                                                    finish_reason=finish_reason(tools, calls, acc.finish_reason),
                                                    stop_reason=acc.stop_reason))
    num_generated = sum(len(acc.token_ids) for acc in accumulated)
    usage = UsageInfo.of(num_prompt_tokens, num_generated)
    return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)


async def _stream_events(ctx: ServingContext, request: ChatCompletionRequest, model: str, request_id: str,
                         num_prompt_tokens: int, stream: AsyncGenerator[RequestOutput, None],
                         tools: ToolPlan = ToolPlan("none")) -> AsyncGenerator[str, None]:
    created = int(time.time())
    held = [""] * request.n  # tool-call requests: each choice's text until it finishes
    parser = ctx.options.reasoning_parser
    reasoning_streams = [ReasoningStream(parser) for _ in range(request.n)] if parser else None
    num_top = _num_top(request)
    num_generated = 0

    def chunk(choice: ChatCompletionStreamChoice) -> str:
        return sse_event(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice]))

    for index in range(request.n):
        yield chunk(ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
    async for output in stream:
        for completion in output.outputs:
            num_generated += len(completion.token_ids)
            if not completion.text and completion.finish_reason is None and num_top is None:
                continue
            logprobs = None
            if num_top is not None:
                logprobs = chat_logprobs(ctx.tokenizer, completion.token_ids, completion.logprobs or [], num_top)
            reasoning, text = None, completion.text
            if reasoning_streams is not None:
                reasoning, text = reasoning_streams[completion.index].feed(completion.text,
                                                                           completion.finish_reason is not None)
                if reasoning is None and text is None and completion.finish_reason is None and num_top is None:
                    continue  # a piece of a possible tag: held until the next delta
            delta, reason = DeltaMessage(content=text, reasoning_content=reasoning), completion.finish_reason
            if tools.parses_output:
                held[completion.index] += text or ""
                if reasoning is not None and completion.finish_reason is None:
                    yield chunk(ChatCompletionStreamChoice(index=completion.index,
                                                           delta=DeltaMessage(reasoning_content=reasoning)))
                if completion.finish_reason is None:
                    continue
                calls, content = extract_tool_calls(tools, held[completion.index])
                delta = DeltaMessage(content=content, reasoning_content=reasoning,
                                     tool_calls=[{"index": i, **call} for i, call in enumerate(calls)] or None)
                reason = finish_reason(tools, calls, completion.finish_reason)
                logprobs = None
            yield chunk(ChatCompletionStreamChoice(
                index=completion.index, delta=delta, logprobs=logprobs,
                finish_reason=reason, stop_reason=completion.stop_reason))
    if request.include_usage:
        usage = UsageInfo.of(num_prompt_tokens, num_generated)
        yield sse_event(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                     choices=[], usage=usage))


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  num_top: int) -> ChatChoiceLogprobs:
    """Chat's shape: per token its text, logprob, UTF-8 bytes and the `num_top` most likely tokens."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        sampled = entry.get(token_id)
        token = decode_token(tokenizer, token_id, sampled)
        top = [_top_entry(decode_token(tokenizer, tid, lp), lp) for tid, lp in top_logprobs(entry, num_top)]
        logprob = json_logprob(sampled) if sampled is not None else MIN_JSON_LOGPROB
        content.append(ChatTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


def _top_entry(token: str, logprob: Logprob) -> ChatTopLogprob:
    return ChatTopLogprob(token=token, logprob=json_logprob(logprob), bytes=list(token.encode()))
