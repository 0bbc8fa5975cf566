"""POST /v1/chat/completions: the messages go through the model's chat template, then one
engine request with n choices."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vllm_lite.entrypoints.openai.protocol import (
    BatchChatCompletionRequest,
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
    request_ids,
)
from vllm_lite.entrypoints.openai.serving import (
    MIN_JSON_LOGPROB, ServingContext, SSEResponse, beam_search_stream, check_n, fit_max_tokens, check_prompt_chars,
    gather_or_cancel,
    collect_choices, decode_token, encode_prompt, json_logprob, json_response, prompt_logprobs_json,
    render_chat, sse_event, start_stream, top_logprobs, tracked_generate, truncation, with_chat_images
)
from vllm_lite.entrypoints.openai.serving_tools import (ToolPlan, chat_sampling, extract_tool_calls, finish_reason,
                                                        forced_call_content)
from vllm_lite.entrypoints.openai.tool_streaming import ToolCallStream
from vllm_lite.entrypoints.openai.reasoning_parsers import ReasoningStream, ReasoningTokenCounter, split_reasoning
from vllm_lite.entrypoints.openai.stream_chunks import ChatChunkChoice, ChatDelta, chat_chunk_event
from vllm_lite.outputs import Logprob, RequestOutput


async def create_chat_completion(ctx: ServingContext, request: ChatCompletionRequest,
                                 raw_request: Request) -> Response:
    model, lora = ctx.served_model_and_lora(request.model)
    check_n(ctx, request.n)
    params, tools = chat_sampling(ctx, request)
    prompt = await chat_prompt(ctx, request)
    prompt_token_ids = prompt["prompt_token_ids"]
    params = fit_max_tokens(ctx, len(prompt_token_ids), params, field=request.max_tokens_field())
    request_id, engine_id = request_ids("chatcmpl", raw_request.headers.get("x-request-id"), request.request_id)
    beam = request.beam_search_params(params.max_tokens or ctx.max_model_len - len(prompt_token_ids), request.logprobs,
                                      params.skip_special_tokens)
    if beam is not None:
        stream = beam_search_stream(ctx, prompt, beam, engine_id, request.priority, lora)
    else:
        stream = tracked_generate(ctx, prompt, params, engine_id, request.priority, lora)
    num_top = params.logprobs if request.logprobs else None
    prompt_text = prompt["prompt"] if request.return_prompt_text else None
    if request.stream:
        started = await start_stream(stream)
        return SSEResponse(_stream_events(ctx, request, num_top, model, request_id, prompt_token_ids, started,
                                          tools, prompt_text))
    return await json_response(_full_response(ctx, request, num_top, model, request_id, prompt_token_ids, stream,
                                              tools, prompt_text),
                               raw_request)


def templated_tools(ctx: ServingContext, request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the template shows: none for tool_choice "none" with
    --exclude-tools-when-tool-choice-none (vLLM's flag; by default the template sees them)."""
    if request.tool_choice == "none" and ctx.options.exclude_tools_when_tool_choice_none:
        return None
    return request.tools


async def chat_prompt(ctx: ServingContext, request: ChatCompletionRequest) -> dict[str, Any]:
    """The templated text and its token ids (the template writes the special tokens; the
    tokenizer adds its own too only with add_special_tokens, vLLM's field)."""
    conversation = request.conversation()
    if request.truncate_prompt_tokens is None:  # a prompt to be truncated may be longer than the context
        check_prompt_chars(ctx, sum(len(message.text()) for message in request.messages), "messages")
    text = await render_chat(ctx, conversation, add_generation_prompt=request.add_generation_prompt,
                             continue_final_message=request.continue_final_message,
                             chat_template=request.chat_template, chat_template_kwargs=request.template_kwargs(),
                             tools=templated_tools(ctx, request), documents=request.documents, images=True)
    truncate = truncation(ctx, request.truncate_prompt_tokens, request.truncation_side)
    prompt = await encode_prompt(ctx, text, add_special_tokens=request.add_special_tokens, param="messages",
                                 truncate=truncate)
    prompt = await with_chat_images(ctx, conversation, prompt, request.mm_processor_kwargs)
    if request.cache_salt is not None:
        prompt["cache_salt"] = request.cache_salt
    return prompt


async def _full_response(ctx: ServingContext, request: ChatCompletionRequest, num_top: int | None, model: str,
                         request_id: str, prompt_token_ids: list[int],
                         stream: AsyncGenerator[RequestOutput, None],
                         tools: ToolPlan = ToolPlan("none"), prompt_text: str | None = None) -> ChatCompletionResponse:
    collected = await collect_choices(stream, request.n)
    as_ids = ctx.tokens_as_ids(request.return_tokens_as_token_ids)
    parser = ctx.options.reasoning_parser
    hide_reasoning = ctx.hides_reasoning(request.include_reasoning)
    choices, reasoning_tokens = [], 0
    for index, acc in enumerate(collected.choices):
        logprobs = None
        if num_top is not None and not hide_reasoning:
            logprobs = chat_logprobs(ctx.tokenizer, acc.token_ids, acc.logprobs, num_top, as_ids,
                                     request.logprob_token_ids is not None)
        reasoning, text = None, acc.text
        if parser is not None:
            reasoning, text = split_reasoning(parser, acc.text, tools.parses_output)
            reasoning_tokens += ReasoningTokenCounter.for_parser(parser, ctx.think_tokens).feed(acc.token_ids)
        calls, content = extract_tool_calls(tools, text or "") if tools.parses_output else ([], text)
        if content is not None:
            content = request.echoed_text(ctx.options.response_role) + content
        message = ChatResponseMessage(role=request.reply_role(ctx.options.response_role),
                                      content=forced_call_content(tools, content),
                                      reasoning=None if hide_reasoning else reasoning, tool_calls=calls)
        choices.append(ChatCompletionResponseChoice(
            index=index, message=message, logprobs=logprobs,
            finish_reason=finish_reason(tools, calls, acc.finish_reason), stop_reason=acc.stop_reason,
            token_ids=acc.token_ids if request.return_token_ids and not hide_reasoning else None))
    num_generated = sum(len(acc.token_ids) for acc in collected.choices)
    usage = UsageInfo.of(len(prompt_token_ids), num_generated, reasoning_tokens if parser is not None else None,
                         cached_tokens=ctx.cached_tokens_detail(collected.num_cached_tokens))
    prompt_logprobs = None
    if request.prompt_logprobs_count() is not None:
        prompt_logprobs = prompt_logprobs_json(ctx.tokenizer, collected.prompt_logprobs)
    return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage,
                                  prompt_logprobs=prompt_logprobs,
                                  prompt_token_ids=prompt_token_ids if request.return_token_ids else None,
                                  prompt_text=prompt_text)


async def _stream_events(ctx: ServingContext, request: ChatCompletionRequest, num_top: int | None, model: str,
                         request_id: str, prompt_token_ids: list[int],
                         stream: AsyncIterator[RequestOutput],
                         tools: ToolPlan = ToolPlan("none"), prompt_text: str | None = None
                         ) -> AsyncGenerator[bytes, None]:
    created = int(time.time())
    num_prompt_tokens = len(prompt_token_ids)
    per_choice = [0] * request.n  # tokens generated so far, per choice
    cached_tokens = 0
    as_ids = ctx.tokens_as_ids(request.return_tokens_as_token_ids)
    usage_mode = request.stream_usage(ctx.options.enable_force_include_usage)
    plain = not usage_mode.every_chunk
    tool_streams = [ToolCallStream(tools) for _ in range(request.n)] if tools.parses_output else None
    parser = ctx.options.reasoning_parser
    reasoning_streams = [ReasoningStream(parser, tools.parses_output) for _ in range(request.n)] if parser else None
    counters = [ReasoningTokenCounter.for_parser(parser, ctx.think_tokens) for _ in range(request.n)] if parser \
        else None
    hide_reasoning = ctx.hides_reasoning(request.include_reasoning)

    def reasoning_tokens(indices: range | list[int]) -> int | None:
        return None if counters is None else sum(counters[i].count for i in indices)

    def chunk(choice: ChatCompletionStreamChoice, prompt_ids: list[int] | None = None,
              prompt: str | None = None) -> bytes:
        usage = UsageInfo.of(num_prompt_tokens, per_choice[choice.index], reasoning_tokens([choice.index])) \
            if usage_mode.every_chunk else None
        return sse_event(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice],
                                                      prompt_token_ids=prompt_ids, prompt_text=prompt, usage=usage))

    first_prompt_ids = prompt_token_ids if request.return_token_ids else None
    role = request.reply_role(ctx.options.response_role)
    echoed = request.echoed_text(ctx.options.response_role)
    for index in range(request.n):
        yield chunk(ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role=role, content="")),
                    first_prompt_ids if index == 0 else None, prompt_text if index == 0 else None)
        if echoed:
            yield chunk(ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=echoed)))
    async for output in stream:
        cached_tokens = max(cached_tokens, output.num_cached_tokens)
        for completion in output.outputs:
            per_choice[completion.index] += len(completion.token_ids)
            if counters is not None:
                counters[completion.index].feed(completion.token_ids)
            carries_ids = request.return_token_ids and completion.token_ids and not hide_reasoning
            if not completion.text and completion.finish_reason is None and num_top is None and not carries_ids:
                continue  # tokens still held back by the detokenizer (no text yet)
            logprobs = None
            if num_top is not None and not hide_reasoning:
                logprobs = chat_logprobs(ctx.tokenizer, completion.token_ids, completion.logprobs or [], num_top,
                                         as_ids, request.logprob_token_ids is not None)
            reasoning, text = None, completion.text
            if reasoning_streams is not None:
                reasoning, text = reasoning_streams[completion.index].feed(completion.text,
                                                                           completion.finish_reason is not None)
                if hide_reasoning:
                    reasoning = None
                if reasoning is None and text is None and completion.finish_reason is None and logprobs is None \
                        and not carries_ids:
                    continue  # a piece of a possible tag (or hidden reasoning): held until the next delta
            delta, reason = None, completion.finish_reason
            if tool_streams is not None:
                final = completion.finish_reason is not None
                content, calls = tool_streams[completion.index].feed(text or "", final)
                if content is None and not calls and reasoning is None and not final:
                    continue  # nothing certain yet (a call's name, a possible tag)
                delta = DeltaMessage(content=content, reasoning=reasoning,
                                     tool_calls=[call.to_openai() for call in calls] or None)
                if final:
                    whole_calls, _ = extract_tool_calls(tools, tool_streams[completion.index].text)
                    reason = finish_reason(tools, whole_calls, completion.finish_reason)
                logprobs = None
            token_ids = completion.token_ids if request.return_token_ids and not hide_reasoning else None
            if plain and logprobs is None and tool_streams is None:  # the per-token chunk, msgspec-encoded
                yield chat_chunk_event(request_id, created, model, ChatChunkChoice(
                    completion.index, ChatDelta(content=text, reasoning=reasoning), None, reason,
                    completion.stop_reason, token_ids))
                continue
            if delta is None:
                delta = DeltaMessage(content=text, reasoning=reasoning)
            yield chunk(ChatCompletionStreamChoice(index=completion.index, delta=delta, logprobs=logprobs,
                                                   finish_reason=reason, stop_reason=completion.stop_reason,
                                                   token_ids=token_ids))
    if usage_mode.final:
        usage = UsageInfo.of(num_prompt_tokens, sum(per_choice), reasoning_tokens(range(request.n)),
                             cached_tokens=ctx.cached_tokens_detail(cached_tokens))
        yield sse_event(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                     choices=[], usage=usage))


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, Logprob]],
                  num_top: int, tokens_as_ids: bool = False, list_all: bool = False) -> ChatChoiceLogprobs:
    """Chat's shape: per token its text (or 'token_id:<int>'), logprob, UTF-8 bytes and the
    `num_top` most likely tokens; with `list_all` (logprob_token_ids, as vLLM) every token the
    entry holds instead: the sampled token, then the requested ids."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        sampled = entry.get(token_id)
        token = decode_token(tokenizer, token_id, sampled, tokens_as_ids)
        top = [_top_entry(decode_token(tokenizer, tid, lp, tokens_as_ids), lp)
               for tid, lp in (entry.items() if list_all else top_logprobs(entry, num_top))]
        logprob = json_logprob(sampled) if sampled is not None else MIN_JSON_LOGPROB
        content.append(ChatTokenLogprob(token=token, logprob=logprob, bytes=_sampled_bytes(token, sampled, tokens_as_ids),
                                        top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


def _sampled_bytes(token: str, sampled: Logprob | None, tokens_as_ids: bool) -> list[int] | None:
    """The sampled token's UTF-8 bytes: of its text even when it is shown as 'token_id:<int>'
    (vLLM's; None when the text is unknown), as OpenAI's clients rebuild text from them."""
    if not tokens_as_ids:
        return list(token.encode())
    text = sampled.decoded_token if sampled is not None else None
    return None if text is None else list(text.encode("utf-8", errors="replace"))


def _top_entry(token: str, logprob: Logprob) -> ChatTopLogprob:
    return ChatTopLogprob(token=token, logprob=json_logprob(logprob), bytes=list(token.encode()))


async def create_batch_chat_completion(ctx: ServingContext, request: BatchChatCompletionRequest,
                                       raw_request: Request) -> Response:
    """vLLM's batch endpoint: each conversation is one engine request (all run together), and
    choice i answers conversation i; usage sums them."""
    model, lora = ctx.served_model_and_lora(request.model)
    requests = request.conversation_requests()
    prompts, streams = [], []
    request_id, engine_id = request_ids("chatcmpl", raw_request.headers.get("x-request-id"), request.request_id)
    for i, single in enumerate(requests):
        params = single.to_sampling_params(ctx.vocab_size, ctx.sampling_defaults)
        prompt = await chat_prompt(ctx, single)
        params = fit_max_tokens(ctx, len(prompt["prompt_token_ids"]), params,
                                field=single.max_tokens_field())
        prompts.append(prompt)
        streams.append(tracked_generate(ctx, prompt, params, f"{engine_id}-{i}", request.priority, lora))
    roles = [single.reply_role(ctx.options.response_role) for single in requests]
    return await json_response(_batch_response(ctx, request, model, request_id, prompts, streams, roles), raw_request)


async def _batch_response(ctx: ServingContext, request: BatchChatCompletionRequest, model: str, request_id: str,
                          prompts: list[dict[str, Any]], streams: list[AsyncGenerator[RequestOutput, None]],
                          roles: list[str]) -> ChatCompletionResponse:
    tasks = [asyncio.ensure_future(collect_choices(stream, 1)) for stream in streams]
    results = await gather_or_cancel(tasks)
    num_top = (request.top_logprobs or 0) if request.logprobs else None
    as_ids = ctx.tokens_as_ids(request.return_tokens_as_token_ids)
    choices, usage = [], UsageInfo()
    for index, (collected, prompt) in enumerate(zip(results, prompts)):
        acc = collected.choices[0]
        usage.prompt_tokens += len(prompt["prompt_token_ids"])
        usage.completion_tokens += len(acc.token_ids)
        logprobs = None
        if num_top is not None:
            logprobs = chat_logprobs(ctx.tokenizer, acc.token_ids, acc.logprobs, num_top, as_ids,
                                     request.logprob_token_ids is not None)
        choices.append(ChatCompletionResponseChoice(
            index=index, message=ChatResponseMessage(role=roles[index], content=acc.text), logprobs=logprobs,
            finish_reason=acc.finish_reason, stop_reason=acc.stop_reason,
            token_ids=acc.token_ids if request.return_token_ids else None))
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
