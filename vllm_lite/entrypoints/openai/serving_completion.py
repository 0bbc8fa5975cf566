"""POST /v1/completions: one engine request per prompt (a list of prompts is a batch), n
choices per prompt; choice `index` is prompt_index * n + sample_index, as in vLLM."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vllm_lite.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    RequestParamError,
    UsageInfo,
    request_ids,
)
from vllm_lite.entrypoints.openai.serving import (
    ServingContext, SSEResponse, Truncation, beam_search_stream, check_length, check_n, collect_choices, decode_token,
    fit_max_tokens, gather_or_cancel, load_prompt_embeds,
    encode_prompt, json_logprob, json_response, merge_streams, off_loop, prompt_logprobs_json, sse_event,
    start_streams, tracked_generate, truncation
)
from vllm_lite.entrypoints.openai.stream_chunks import CompletionChunkChoice, completion_chunk_event
from vllm_lite.outputs import CompletionOutput, Logprob, RequestOutput


async def create_completion(ctx: ServingContext, request: CompletionRequest, raw_request: Request) -> Response:
    model, lora = ctx.served_model_and_lora(request.model)
    check_n(ctx, request.n)
    params = request.to_sampling_params(ctx.vocab_size, ctx.sampling_defaults)
    truncate = truncation(ctx, request.truncate_prompt_tokens, request.truncation_side)
    prompts = await embeds_engine_prompts(ctx, request.prompt_embeds, request.cache_salt, truncate)
    if request.prompt is not None and request.prompt != "":
        prompts += await engine_prompts(ctx, request.prompt, request.cache_salt, truncate,
                                        add_special_tokens=request.add_special_tokens,
                                        batch_so_far=len(prompts))
    echoed = [await _prompt_text(ctx, prompt) if request.echo else "" for prompt in prompts]
    prompt_params = [fit_max_tokens(ctx, len(prompt["prompt_token_ids"]), params) for prompt in prompts]
    request_id, engine_id = request_ids("cmpl", raw_request.headers.get("x-request-id"), request.request_id)
    streams = []
    for i, (prompt, fitted) in enumerate(zip(prompts, prompt_params)):
        beam = request.beam_search_params(fitted.max_tokens, request.logprobs is not None, fitted.skip_special_tokens)
        engine_request_id = f"{engine_id}-{i}"
        streams.append(beam_search_stream(ctx, prompt, beam, engine_request_id, request.priority, lora)
                       if beam is not None
                       else tracked_generate(ctx, prompt, fitted, engine_request_id, request.priority, lora))
    shape = _ChoiceShape.of(request, params.logprobs, ctx.tokens_as_ids(request.return_tokens_as_token_ids))
    if request.stream:
        started = await start_streams(streams)
        return SSEResponse(_stream_events(ctx, request, shape, model, request_id, prompts, echoed, started))
    return await json_response(_full_response(ctx, request, shape, model, request_id, prompts, echoed, streams),
                               raw_request)


@dataclass(frozen=True, slots=True)
class _ChoiceShape:
    """What each choice carries, from the request: `num_logprobs` is the request's logprobs
    (-1 already the vocabulary size), None when not asked."""

    num_logprobs: int | None
    echo_logprobs: bool  # echo with logprobs: the prompt's tokens get logprobs too
    token_ids: bool
    tokens_as_ids: bool
    prompt_logprobs: bool  # the choice's `prompt_logprobs` (vLLM's: also with echo and logprobs)

    @classmethod
    def of(cls, request: CompletionRequest, num_logprobs: int | None, tokens_as_ids: bool) -> _ChoiceShape:
        echo_logprobs = request.echo and num_logprobs is not None
        return cls(num_logprobs=num_logprobs, echo_logprobs=echo_logprobs, token_ids=request.return_token_ids,
                   tokens_as_ids=tokens_as_ids, prompt_logprobs=request.prompt_logprobs is not None or echo_logprobs)


async def engine_prompts(ctx: ServingContext, prompt: str | list[str] | list[int] | list[list[int]],
                         cache_salt: str | None, truncate: Truncation | None, param: str = "prompt",
                         add_special_tokens: bool = True, batch_so_far: int = 0) -> list[dict[str, Any]]:
    """One engine prompt per text or token list of a request's `param` (a batch or one;
    `batch_so_far`: the request's prompts before these, from `prompt_embeds`)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items: list[Any] = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise RequestParamError(param, f"{param} must not be empty")
    check_batch_size(ctx, batch_so_far + len(items), param)
    prompts = [await encode_prompt(ctx, item, add_special_tokens, param=param, truncate=truncate) for item in items]
    if cache_salt is not None:
        for engine_prompt in prompts:
            engine_prompt["cache_salt"] = cache_salt
    return prompts


def check_batch_size(ctx: ServingContext, num_prompts: int, param: str) -> None:
    if num_prompts > ctx.options.max_n_sequences:
        raise RequestParamError(param, f"a batch may hold at most {ctx.options.max_n_sequences} prompts "
                                f"(--max-n-sequences), got {num_prompts}")


async def embeds_engine_prompts(ctx: ServingContext, prompt_embeds: str | list[str] | None, cache_salt: str | None,
                                truncate: Truncation | None) -> list[dict[str, Any]]:
    """One engine prompt per base64 tensor of vLLM's `prompt_embeds` (decoded and checked on the
    tokenizer thread); their `prompt_token_ids` are the placeholders the engine reports."""
    items = [prompt_embeds] if isinstance(prompt_embeds, str) else list(prompt_embeds or ())
    if items:
        ctx.engine.input_processor.require_prompt_embeds()
    check_batch_size(ctx, len(items), "prompt_embeds")
    prompts = []
    for item in items:
        embeds = await off_loop(ctx, ctx.engine.input_processor.prompt_embeds,
                                {"prompt_embeds": await off_loop(ctx, load_prompt_embeds, item)})
        if truncate is not None:
            embeds = truncate.apply(embeds)
        check_length(ctx, len(embeds), "prompt_embeds")
        prompt = {"prompt": None, "prompt_token_ids": [0] * len(embeds), "prompt_embeds": embeds}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        prompts.append(prompt)
    return prompts


async def _prompt_text(ctx: ServingContext, prompt: dict[str, Any]) -> str:
    """The prompt as text (echo): token-id prompts are decoded on the tokenizer thread; without
    a tokenizer (--skip-tokenizer-init) the text is "", as every text is then."""
    if prompt["prompt"] is not None:
        return prompt["prompt"]
    if ctx.tokenizer is None:
        return ""
    return await off_loop(ctx, ctx.tokenizer.decode, prompt["prompt_token_ids"])


async def _full_response(ctx: ServingContext, request: CompletionRequest, shape: _ChoiceShape, model: str,
                         request_id: str, prompts: list[dict[str, Any]], echoed: list[str],
                         streams: list[AsyncGenerator[RequestOutput, None]]) -> CompletionResponse:
    tasks = [asyncio.ensure_future(collect_choices(stream, request.n)) for stream in streams]
    results = await gather_or_cancel(tasks)
    choices, usage = [], UsageInfo()
    for i, (collected, prompt) in enumerate(zip(results, prompts)):
        prompt_ids = prompt["prompt_token_ids"]
        usage.prompt_tokens += len(prompt_ids)
        prompt_logprobs = collected.prompt_logprobs or [None] * len(prompt_ids)
        for j, acc in enumerate(collected.choices):
            usage.completion_tokens += len(acc.token_ids)
            logprobs = None
            if shape.num_logprobs is not None:
                token_ids, entries = acc.token_ids, acc.logprobs
                if shape.echo_logprobs:
                    token_ids, entries = prompt_ids + token_ids, prompt_logprobs + entries
                logprobs = completion_logprobs(ctx.tokenizer, token_ids, entries, shape.num_logprobs, 0,
                                               shape.tokens_as_ids)
            choices.append(CompletionResponseChoice(
                index=i * request.n + j, text=echoed[i] + acc.text, logprobs=logprobs,
                finish_reason=acc.finish_reason, stop_reason=acc.stop_reason,
                prompt_logprobs=(prompt_logprobs_json(ctx.tokenizer, collected.prompt_logprobs)
                                 if shape.prompt_logprobs else None),
                prompt_token_ids=prompt_ids if shape.token_ids else None,
                token_ids=acc.token_ids if shape.token_ids else None))
    usage = UsageInfo.of(usage.prompt_tokens, usage.completion_tokens,
                         cached_tokens=ctx.cached_tokens_detail(sum(collected.num_cached_tokens for collected in results)))
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)


@dataclass(slots=True)
class _StreamedChoice:
    echo: str  # the prompt text while it is still to be sent (echo=true), else ""
    prompt_token_ids: list[int]
    first: bool = True
    num_tokens: int = 0
    text_offset: int = 0

    def chunk_choice(self, tokenizer: Any, index: int, completion: CompletionOutput, shape: _ChoiceShape,
                     prompt_logprobs: list[dict[int, Logprob] | None] | None,
                     plain: bool = False) -> CompletionResponseChoice | CompletionChunkChoice:
        """`plain` (no logprobs asked, no usage in the chunk): the msgspec form of the choice."""
        text, self.echo = self.echo + completion.text, ""
        logprobs = None
        if shape.num_logprobs is not None:
            logprob_ids, entries = completion.token_ids, completion.logprobs or []
            if shape.echo_logprobs and self.first:
                prompt_entries = prompt_logprobs or [None] * len(self.prompt_token_ids)
                logprob_ids, entries = self.prompt_token_ids + logprob_ids, prompt_entries + entries
            logprobs = completion_logprobs(tokenizer, logprob_ids, entries, shape.num_logprobs, self.text_offset,
                                           shape.tokens_as_ids)
        prompt_token_ids = self.prompt_token_ids if shape.token_ids and self.first else None
        token_ids = completion.token_ids if shape.token_ids else None
        self.num_tokens += len(completion.token_ids)
        self.text_offset += len(text)
        self.first = False
        if plain:
            return CompletionChunkChoice(index, text, None, completion.finish_reason, completion.stop_reason, None,
                                         prompt_token_ids, token_ids)
        return CompletionResponseChoice(index=index, text=text, logprobs=logprobs,
                                        finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                                        prompt_token_ids=prompt_token_ids, token_ids=token_ids)


async def _stream_events(ctx: ServingContext, request: CompletionRequest, shape: _ChoiceShape, model: str,
                         request_id: str, prompts: list[dict[str, Any]], echoed: list[str],
                         streams: list[AsyncIterator[RequestOutput]]) -> AsyncGenerator[bytes, None]:
    choices = [_StreamedChoice(echo, prompt["prompt_token_ids"])
               for echo, prompt in zip(echoed, prompts) for _ in range(request.n)]
    prompt_logprobs: list[list[dict[int, Logprob] | None] | None] = [None] * len(prompts)
    cached_tokens = [0] * len(prompts)
    usage_mode = request.stream_usage(ctx.options.enable_force_include_usage)
    plain = shape.num_logprobs is None and not usage_mode.every_chunk  # the per-token chunk, msgspec-encoded
    created = int(time.time())
    single = len(streams) == 1  # read as it is: merging one stream would add a generator layer per token
    async with contextlib.aclosing(streams[0] if single else merge_streams(streams)) as items:
        async for item in items:
            i, output = (0, item) if single else item
            if output.prompt_logprobs is not None and prompt_logprobs[i] is None:
                prompt_logprobs[i] = output.prompt_logprobs
            cached_tokens[i] = max(cached_tokens[i], output.num_cached_tokens)
            for completion in output.outputs:
                if not completion.token_ids and not completion.text and completion.finish_reason is None:
                    continue
                index = i * request.n + completion.index
                choice = choices[index].chunk_choice(ctx.tokenizer, index, completion, shape, prompt_logprobs[i],
                                                     plain)
                if plain:
                    yield completion_chunk_event(request_id, created, model, choice)
                    continue
                usage = None
                if usage_mode.every_chunk:  # vLLM: the prompt's tokens and this choice's tokens so far
                    usage = UsageInfo.of(len(prompts[i]["prompt_token_ids"]), choices[index].num_tokens)
                yield sse_event(CompletionStreamResponse(id=request_id, created=created, model=model,
                                                         choices=[choice], usage=usage))
    if usage_mode.final:
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        completion_tokens = sum(choice.num_tokens for choice in choices)
        usage = UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens=ctx.cached_tokens_detail(sum(cached_tokens)))
        yield sse_event(CompletionStreamResponse(id=request_id, created=created, model=model,
                                                 choices=[], usage=usage))


def completion_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, Logprob] | None],
                        num_top: int, text_offset: int, tokens_as_ids: bool = False) -> CompletionLogProbs:
    """The legacy completions shape: per token its text, offset, logprob and a dict of the
    sampled token plus the `num_top` most likely ones (vLLM's rule). A position without
    logprobs (the first echoed prompt token) has None for its logprob and its top dict."""
    out = CompletionLogProbs()
    for token_id, entry in zip(token_ids, logprobs):
        sampled = entry.get(token_id) if entry is not None else None
        out.tokens.append(decode_token(tokenizer, token_id, sampled, tokens_as_ids))
        out.token_logprobs.append(json_logprob(sampled) if sampled is not None else None)
        out.text_offset.append(text_offset)
        out.top_logprobs.append(None if entry is None else {
            decode_token(tokenizer, tid, lp, tokens_as_ids): json_logprob(lp)
            for tid, lp in list(entry.items())[:num_top + 1]})
        text_offset += len(decode_token(tokenizer, token_id, sampled))
    return out
