"""What the completion and chat handlers share: the engine they talk to, prompt checks, a
tracked `generate` that aborts requests whose consumer goes away, SSE framing, and the
accumulation of delta outputs into whole choices."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
import msgspec
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from vllm_lite.config import MediaAccess, VllmConfig, check_priority
from vllm_lite.entrypoints.beam_search import BeamSearch, BeamSearchParams
from vllm_lite.exceptions import RequestRejectedError, VLLMValidationError
from vllm_lite.entrypoints.chat_content import (developer_as_system, image_sources, image_uuids, resolve_content_format,
                                                with_content_format)
from vllm_lite.entrypoints.media import fetch_client, load_image_bytes, open_image
from vllm_lite.entrypoints.openai.chat_template import TemplateRenderTimeout, render_chat_template
from vllm_lite.entrypoints.openai.errors import ApiError, describe_error, error_body
from vllm_lite.engine.stats import StatLogger
from vllm_lite.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from vllm_lite.entrypoints.openai.middleware import BODY_SEND
from vllm_lite.entrypoints.openai.protocol import LogprobEntry, PromptLogprobs, RequestParamError
from vllm_lite.entrypoints.openai.reasoning_parsers import HarmonyTokens, ThinkTokens
from vllm_lite.entrypoints.openai.server_state import ResponseStore, ServerLoad, ServerOptions, ShutdownDrain
from vllm_lite.entrypoints.openai.serving_models import ServedModels
from vllm_lite.entrypoints.tokenization import default_truncation_side, truncated
from vllm_lite.lora.request import LoRARequest
from vllm_lite.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
# apply_chat_template's own arguments: chat_template_kwargs may not set them (they would change
# what it returns, not what the template sees).
RESERVED_TEMPLATE_KWARGS = frozenset((
    "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"))
SSE_DONE = b"data: [DONE]\n\n"


class EngineClient(Protocol):
    """The part of AsyncLLM the server uses. `generate` yields outputs as the params'
    output_kind says, and closing its generator early aborts the request."""

    vllm_config: VllmConfig
    tokenizer: Any
    stat_loggers: list[StatLogger]  # called with each engine step's IterationStats

    @property
    def errored(self) -> bool:
        """True once the engine is gone for good (the server then exits)."""
        ...

    def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str, priority: int = 0, *,
                 lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]: ...

    async def add_lora(self, lora_request: LoRARequest) -> bool: ...

    def check_lora(self, lora_request: LoRARequest) -> None: ...

    def forget_lora(self, lora_id: int) -> bool: ...

    def encode(self, prompt: Any, pooling_params: PoolingParams | None, request_id: str, priority: int = 0, *,
               lora_request: LoRARequest | None = None) -> AsyncGenerator[EmbeddingRequestOutput, None]: ...

    async def check_health(self) -> None: ...

    async def abort(self, request_id: str | list[str]) -> None: ...

    async def get_stats(self) -> dict[str, Any]: ...

    async def reset_prefix_cache(self) -> bool: ...

    async def reset_encoder_cache(self) -> None: ...

    async def reset_mm_cache(self) -> None: ...

    def expanded_image_prompt(self, token_ids: list[int], images: list[Any], uuids: list[str | None],
                              kwargs: dict[str, Any] | None = None) -> list[int]: ...

    # (the development routes': VLLM_SERVER_DEV_MODE=1)
    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]: ...

    async def sleep(self, level: int = 1, mode: str = "abort") -> None: ...

    async def release_kv_cache_memory(self) -> None: ...

    async def wake_up(self, tags: list[str] | None = None) -> bool: ...

    async def is_sleeping(self) -> bool: ...

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None: ...

    async def resume_generation(self) -> None: ...

    async def is_paused(self) -> bool: ...

    def unfinished_request_ids(self) -> list[str]: ...

    async def update_weight_version(self, new_version: str) -> None: ...

    async def get_weight_version(self) -> str: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ServingContext:
    """Everything a handler needs, built once by `build_app` and kept on `app.state`.
    `tokenizer_thread` runs tokenization, chat templates and large detokenizations off the
    event loop (one thread, as in vLLM: the tokenizer is not shared between threads).
    `max_prompt_chars`: a text longer than this cannot fit in max_model_len tokens (no token
    is longer than the vocabulary's longest), so it is refused before it is tokenized."""

    engine: EngineClient
    tokenizer: Any
    model_names: tuple[str, ...]
    models: ServedModels  # the served names and LoRA adapters (serving_models.py)
    model_path: str
    max_model_len: int
    metrics: ServerMetrics
    vocab_size: int
    max_prompt_chars: int
    # The model's sampling defaults (ModelConfig.sampling_defaults): what a request leaves unset.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    options: ServerOptions = field(default_factory=ServerOptions)
    think_tokens: ThinkTokens | HarmonyTokens | None = None  # counted as reasoning tokens (reasoning_parsers.py)
    # The parsers' markers this tokenizer has as special tokens (serving_tools.keep_parser_markers).
    tool_special_markers: tuple[str, ...] = ()
    reasoning_special_markers: tuple[str, ...] = ()
    scheduling_policy: str = "fcfs"  # the engine's (SchedulerConfig.policy): requests' priority needs "priority"
    # the text of the model's image placeholder token where it takes images (chat_content.py); None: it takes none
    image_placeholder: str | None = None
    images_refused: str = "the model takes no images"  # (ModelConfig.images_refused)
    drain: ShutdownDrain = field(default_factory=ShutdownDrain)
    load: ServerLoad = field(default_factory=ServerLoad)
    responses: ResponseStore = field(default_factory=ResponseStore)
    tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer"))

    def hides_reasoning(self, include_reasoning: bool) -> bool:
        """Whether a reply's reasoning is split off and left out: the request asks so
        (`include_reasoning: false`), or the server shows none (gpt-oss's analysis channel
        without --reasoning-parser)."""
        return self.options.reasoning_parser is not None and not (include_reasoning and self.options.show_reasoning)

    def tokens_as_ids(self, requested: bool | None) -> bool:
        """Logprob tokens as 'token_id:<int>': the request's return_tokens_as_token_ids, else the
        server's --return-tokens-as-token-ids (vLLM's rule)."""
        return self.options.return_tokens_as_token_ids if requested is None else requested

    def cached_tokens_detail(self, num_cached_tokens: int) -> int | None:
        """usage.prompt_tokens_details.cached_tokens, only with --enable-prompt-tokens-details."""
        return num_cached_tokens if self.options.enable_prompt_tokens_details else None

    def require_tokenizer(self, param: str) -> Any:
        """The tokenizer, or a 400 naming the field that needs it when the server runs with
        --skip-tokenizer-init (token ids in and out only)."""
        if self.tokenizer is None:
            raise ApiError(400, "BadRequestError", f"{param} needs the tokenizer, which this server does not "
                           "load (--skip-tokenizer-init): send token ids", param)
        return self.tokenizer

    def served_model(self, requested: str | None) -> str:
        """The name to answer with (the base model's or a LoRA adapter's); an unknown name is a
        404, as with OpenAI."""
        return self.models.resolve(requested)[0]

    def served_model_and_lora(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """`served_model`, and the LoRA adapter a generation runs with (None: the base model)."""
        return self.models.resolve(requested)


# --------------------------------------------------------------------------- prompts


async def off_loop(ctx: ServingContext, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on the tokenizer thread, so the event loop keeps serving."""
    return await asyncio.get_running_loop().run_in_executor(ctx.tokenizer_thread,
                                                            functools.partial(fn, *args, **kwargs))


@dataclass(frozen=True, slots=True)
class Truncation:
    """vLLM's truncate_prompt_tokens: keep `num_tokens` prompt tokens, cutting the `side` end."""

    num_tokens: int
    side: str = "left"

    def apply(self, token_ids: list[int]) -> list[int]:
        return truncated(token_ids, self.num_tokens, self.side)


def truncation(ctx: ServingContext, truncate_prompt_tokens: int | None, side: str | None, *,
               pooling: bool = False) -> Truncation | None:
    """The request's truncation, -1 meaning max_model_len; more than max_model_len is refused (as vLLM).
    No `side`: vLLM's default for the model's kind (`pooling`: an embedding model's)."""
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        truncate_prompt_tokens = ctx.max_model_len
    if truncate_prompt_tokens > ctx.max_model_len:
        raise ApiError(400, "BadRequestError", f"truncate_prompt_tokens value ({truncate_prompt_tokens}) is "
                       f"greater than max_model_len ({ctx.max_model_len}). Please, select a smaller "
                       "truncation size.", "truncate_prompt_tokens")
    return Truncation(truncate_prompt_tokens, side or default_truncation_side(pooling))


async def encode_prompt(ctx: ServingContext, prompt: str | list[int], add_special_tokens: bool = True, *,
                        param: str = "prompt", check_fits: bool = True,
                        truncate: Truncation | None = None) -> dict[str, Any]:
    """The engine prompt: text and token ids (tokenized as `LLM.generate` does, off the event
    loop). Token ids must lie in the vocabulary; with `check_fits`, a prompt that cannot fit in
    max_model_len is refused before the work of tokenizing or copying it (unless it is to be
    truncated). A truncated prompt keeps no text (its text is no longer the prompt's)."""
    if isinstance(prompt, str):
        tokenizer = ctx.require_tokenizer(param)
        if check_fits and truncate is None:
            check_prompt_chars(ctx, len(prompt), param)
        token_ids = await off_loop(ctx, tokenizer.encode, prompt, add_special_tokens=add_special_tokens)
        text: str | None = prompt
    else:
        token_ids, text = list(prompt), None
        if check_fits and truncate is None and token_ids:
            check_length(ctx, len(token_ids), param)  # before the scan of a huge list
        check_token_ids(ctx, token_ids, param)
    if truncate is not None and len(token_ids) > truncate.num_tokens:
        token_ids, text = truncate.apply(token_ids), None
    if check_fits and not token_ids:
        raise ApiError(400, "BadRequestError", f"The decoder prompt cannot be empty ({param} has no tokens)", param)
    if check_fits and text is None:
        check_length(ctx, len(token_ids), param)
    return {"prompt": text, "prompt_token_ids": token_ids}


# How much of torch's reason for refusing a `prompt_embeds` payload is repeated (it is built from
# the caller's bytes, so it is bounded, as vLLM bounds it)
EMBEDS_ERROR_REASON_CHARS = 200


def load_prompt_embeds(data: str) -> Any:
    """vLLM's `prompt_embeds` wire form: base64 of a `torch.save`d tensor, read with torch's
    weights-only loader (no code runs) onto the CPU; anything else is a 400 naming the field."""
    import base64
    import binascii
    import io

    import torch

    try:
        payload = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestParamError("prompt_embeds", f"`prompt_embeds` is not base64: {exc}") from None
    try:
        # (a sparse tensor's indices are checked against its shape as it is read: out of range, a
        # later to_dense would write out of bounds)
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:  # torch raises several types for bytes that are not a tensor file
        reason = str(exc).strip() or type(exc).__name__
        if len(reason) > EMBEDS_ERROR_REASON_CHARS:
            reason = f"{reason[:EMBEDS_ERROR_REASON_CHARS]}... ({len(reason) - EMBEDS_ERROR_REASON_CHARS} more " \
                     "characters truncated)"
        raise RequestParamError("prompt_embeds", f"`prompt_embeds` could not be deserialized as a torch tensor: "
                                f"{reason}") from None
    if not isinstance(tensor, torch.Tensor):
        raise RequestParamError("prompt_embeds", f"`prompt_embeds` must hold one torch tensor, got "
                                f"{type(tensor).__name__}")
    return tensor


def engine_input(engine_prompt: dict[str, Any]) -> dict[str, Any]:
    """What the engine is given: a prompt of embeddings without the placeholder ids the server
    keeps for its counts."""
    if "prompt_embeds" not in engine_prompt:
        return engine_prompt
    return {key: value for key, value in engine_prompt.items() if key not in ("prompt", "prompt_token_ids")}


def check_token_ids(ctx: ServingContext, token_ids: list[int], param: str) -> None:
    vocab_size = ctx.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        shown = ", ".join(str(t) if abs(t) < 10**12 else f"{t:.3e}" for t in bad[:8])
        raise ApiError(400, "BadRequestError", f"Token id {max(bad)} is out of vocabulary: {param} has token ids "
                       f"outside the vocabulary [0, {vocab_size}): {shown}", param)


def check_prompt_chars(ctx: ServingContext, num_chars: int, param: str = "prompt") -> None:
    if num_chars > ctx.max_prompt_chars:
        raise ApiError(400, "BadRequestError", f"This model's maximum context length is {ctx.max_model_len} "
                       f"tokens. However, your {param} has {num_chars} characters, more than any text of "
                       f"{ctx.max_model_len} tokens can have. Please reduce the length of the {param}.", param)


def check_n(ctx: ServingContext, n: int) -> None:
    limit = ctx.options.max_n_sequences
    if n > limit:
        raise ApiError(400, "BadRequestError", f"n must be at most {limit} (the server's "
                       f"--max-n-sequences), got {n}", "n")


async def render_chat(ctx: ServingContext, conversation: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                      continue_final_message: bool = False, chat_template: str | None = None,
                      chat_template_kwargs: dict[str, Any] | None = None,
                      tools: list[dict[str, Any]] | None = None,
                      documents: list[dict[str, str]] | None = None, images: bool = False) -> str:
    """The conversation through the chat template, off the event loop, with a deadline and a
    size limit. A template from the request is used only with --trust-request-chat-template.
    `images`: the caller sends the messages' images with the prompt (`with_chat_images`), so the
    template shows them where the model takes them; otherwise an image part is refused."""
    kwargs = {**ctx.options.default_chat_template_kwargs, **(chat_template_kwargs or {})}  # the request's win
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ApiError(400, "BadRequestError", f"chat_template_kwargs may not set {', '.join(reserved)}",
                       "chat_template_kwargs")
    if chat_template is not None or "chat_template" in kwargs:
        if not ctx.options.trust_request_chat_template:
            raise ApiError(400, "BadRequestError", "chat_template in a request is refused unless the server "
                           "runs with --trust-request-chat-template", "chat_template")
        chat_template = kwargs.pop("chat_template", chat_template)
    chat_template = chat_template if chat_template is not None else ctx.options.chat_template  # --chat-template
    tokenizer = ctx.require_tokenizer("messages")
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if chat_template is None and not template:
        raise ApiError(400, "BadRequestError", "the model's tokenizer has no chat template", "messages")
    content_format = resolve_content_format(ctx.options.chat_template_content_format, template)
    try:
        conversation = with_content_format(developer_as_system(conversation, template), content_format,
                                           ctx.image_placeholder if images else None,
                                           ctx.images_refused if images else "this endpoint takes no images")
    except ValueError as exc:
        raise ApiError(400, "BadRequestError", str(exc), "messages") from exc
    try:
        return await off_loop(ctx, render_chat_template, tokenizer, conversation,
                              max_chars=ctx.max_prompt_chars, timeout_s=ctx.options.chat_template_timeout_s,
                              chat_template=chat_template,
                              add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message,
                              **({"tools": tools} if tools else {}),
                              **({"documents": documents} if documents is not None else {}), **kwargs)
    except TemplateRenderTimeout as exc:
        raise ApiError(400, "BadRequestError", str(exc), "chat_template") from exc
    except Exception as exc:  # a template error is the request's problem, not the server's
        raise ApiError(400, "BadRequestError", f"the chat template failed on these messages: {exc}",
                       "messages") from exc


async def with_chat_images(ctx: ServingContext, conversation: list[dict[str, Any]], prompt: dict[str, Any],
                           processor_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The chat prompt with its messages' images (fetched concurrently on the event loop, decoded
    off it, so a slow image host holds up only its own request): its placeholders expanded here,
    so that its token ids (counted, returned) are the ones the model reads, and the images as
    vLLM's multi_modal_data with the request's mm_processor_kwargs. A conversation without
    images: `prompt`."""
    if ctx.image_placeholder is None:
        return prompt
    try:
        sources = image_sources(conversation)
        if not sources:
            return prompt
        uuids = image_uuids(conversation)
        images = await _loaded_images(sources, ctx.engine.vllm_config.model_config.media_access)
    except ValueError as exc:
        raise ApiError(400, "BadRequestError", str(exc), "messages") from exc
    try:
        # (off the event loop: a tiled model's placeholders are counted by processing its images)
        token_ids = await asyncio.to_thread(ctx.engine.expanded_image_prompt, prompt["prompt_token_ids"], images,
                                            uuids, processor_kwargs)
    except VLLMValidationError as exc:
        where = "mm_processor_kwargs" if exc.parameter == "mm_processor_kwargs" else "messages"
        raise ApiError(400, "BadRequestError", str(exc), where) from exc
    check_length(ctx, len(token_ids), "messages")
    return {**prompt, "prompt_token_ids": token_ids, "multi_modal_data": {"image": images},
            **({"multi_modal_uuids": {"image": uuids}} if any(uuids) else {}),
            **({"mm_processor_kwargs": processor_kwargs} if processor_kwargs else {})}


async def _loaded_images(sources: list[Any], access: MediaAccess) -> list[Any]:
    async with fetch_client(access, asynchronous=True) as client:
        data = await asyncio.gather(*(load_image_bytes(source, client, access) for source in sources
                                      if isinstance(source, str)))
    opened = iter(await asyncio.to_thread(lambda: [open_image(item) for item in data]))
    return [next(opened) if isinstance(source, str) else source for source in sources]


def check_length(ctx: ServingContext, num_prompt_tokens: int, param: str = "prompt") -> None:
    """A prompt longer than max_model_len is refused (naming `param`)."""
    max_len = ctx.max_model_len
    if num_prompt_tokens > max_len:
        raise ApiError(400, "BadRequestError", f"This model's maximum context length is {max_len} tokens. "
                       f"However, your {param} has {num_prompt_tokens} tokens. Please reduce the length "
                       f"of the {param}.", param)


def fit_max_tokens(ctx: ServingContext, num_prompt_tokens: int, params: SamplingParams, param: str = "prompt",
                   field: str = "max_tokens") -> SamplingParams:
    """vLLM's rule (its get_max_tokens): the prompt must fit in max_model_len with room for one
    token, max_tokens (`field`) may not be more than max_model_len, and is capped at what the
    prompt leaves (the reply then ends "length" there, as vLLM's does)."""
    check_length(ctx, num_prompt_tokens, param)
    max_len = ctx.max_model_len
    if params.max_tokens is not None and params.max_tokens > max_len:
        raise ApiError(400, "BadRequestError", f"{field}={params.max_tokens} cannot be greater than "
                       f"max_model_len={max_len}. Please request fewer output tokens.", field)
    room = max_len - num_prompt_tokens
    if room < 1:
        raise ApiError(400, "BadRequestError", f"This model's maximum context length is {max_len} tokens. "
                       f"However, your {param} has {num_prompt_tokens} tokens, which leaves no room for the "
                       f"output. Please reduce the length of the {param}.", param)
    if params.max_tokens is None or params.max_tokens <= room:
        return params
    return params.clone_with(max_tokens=room)


# --------------------------------------------------------------------------- generation


def check_request_priority(ctx: ServingContext, priority: int) -> None:
    """A request's priority under the engine's scheduling policy (a 400 naming `priority`)."""
    try:
        check_priority(priority, ctx.scheduling_policy)
    except ValueError as exc:
        raise ApiError(400, "BadRequestError", str(exc), "priority") from None


async def tracked_generate(ctx: ServingContext, engine_prompt: dict[str, Any], params: SamplingParams,
                           request_id: str, priority: int = 0,
                           lora: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
    """`engine.generate` plus metrics, with the LoRA adapter the request's model names. A
    consumer that stops early (client gone, cancelled task, closed generator) closes the
    engine's generator, which aborts the request in the engine core and so frees its KV blocks
    (AsyncLLM's contract)."""
    check_request_priority(ctx, priority)
    structured = params.structured_outputs
    if ctx.options.compact_structured_outputs and structured is not None and not structured.disable_any_whitespace:
        params = params.clone_with(structured_outputs=msgspec.structs.replace(structured, disable_any_whitespace=True))
    tracker = RequestTracker(ctx.metrics, len(engine_prompt["prompt_token_ids"]), params)
    if ctx.options.enable_log_requests:
        _log_request(request_id, engine_prompt, params, ctx.options.max_log_len)
    generated = _GeneratedLog(request_id, params.output_kind) if ctx.options.enable_log_outputs else None
    finished = False
    ctx.drain.in_flight.add(request_id)
    try:
        async with contextlib.aclosing(ctx.engine.generate(engine_input(engine_prompt), params, request_id,
                                                           priority, lora_request=lora)) as outputs:
            async for output in outputs:
                if ctx.drain.expired and output.finished and _was_aborted(output):
                    raise ApiError(503, "ServiceUnavailableError", "the server shut down before the request "
                                   "finished (--shutdown-timeout)")
                tracker.observe(output)
                finished = output.finished
                if generated is not None:
                    generated.add(output, ctx.options.max_log_len)
                yield output
    except RequestRejectedError as exc:
        if exc.while_running:  # (a step failed on it: vLLM's finish reason "error")
            finished = True
            tracker.failed()
        raise
    finally:
        ctx.drain.in_flight.discard(request_id)
        if not finished:
            ctx.metrics.requests_aborted.inc()


def _log_request(request_id: str, engine_prompt: dict[str, Any], params: SamplingParams,
                 max_log_len: int | None) -> None:
    """--enable-log-requests (vLLM's RequestLogger): the prompt's text and ids, cut to max_log_len."""
    text, token_ids = engine_prompt.get("prompt"), engine_prompt["prompt_token_ids"]
    if max_log_len is not None:
        text, token_ids = (text[:max_log_len] if text is not None else None), token_ids[:max_log_len]
    logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", request_id, text, params,
                list(token_ids))


@dataclass(slots=True)
class _GeneratedLog:
    """--enable-log-outputs (vLLM's): each completion's whole text and finish reason, logged when
    the request finishes (streamed deltas are joined first)."""

    request_id: str
    output_kind: RequestOutputKind
    texts: dict[int, list[str]] = field(default_factory=dict)

    def add(self, output: RequestOutput, max_log_len: int | None) -> None:
        for completion in output.outputs:
            pieces = self.texts.setdefault(completion.index, [])
            if self.output_kind != RequestOutputKind.DELTA:
                pieces.clear()
            pieces.append(completion.text)
            if completion.finish_reason is not None:
                text = "".join(pieces)
                logger.info("Generated response %s%s: output: %r, finish_reason: %s", self.request_id,
                            f" (choice {completion.index})" if completion.index else "",
                            text if max_log_len is None else text[:max_log_len], completion.finish_reason)


def _was_aborted(output: RequestOutput) -> bool:
    return any(completion.finish_reason == "abort" for completion in output.outputs)


async def start_stream(stream: AsyncGenerator[T, None]) -> AsyncIterator[T]:
    """Pulls the first item now, so that errors of adding the request (invalid parameters, a
    dead engine) are raised before a streaming response has begun; returns an iterator of all
    the items (closing it closes `stream`)."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        return stream  # exhausted: iterating it yields nothing
    return StartedStream(first, stream)


class StartedStream(AsyncIterator[T]):
    """`first`, then the items of `rest`. After the first, each `__anext__` is `rest`'s own
    awaitable: no generator layer of its own per item (each layer costs every streamed token)."""

    __slots__ = ("_first", "_rest")

    def __init__(self, first: T, rest: AsyncGenerator[T, None]) -> None:
        self._first: tuple[T] | None = (first,)
        self._rest = rest

    def __anext__(self) -> Awaitable[T]:
        if self._first is None:
            return self._rest.__anext__()
        (first,), self._first = self._first, None
        return _ready(first)

    async def aclose(self) -> None:
        self._first = None
        await self._rest.aclose()


async def _ready(item: T) -> T:
    return item


async def start_streams(streams: list[AsyncGenerator[T, None]]) -> list[AsyncIterator[T]]:
    """`start_stream` for each; if one fails, the ones already started are closed (aborted)."""
    started: list[AsyncIterator[T]] = []
    try:
        for stream in streams:
            started.append(await start_stream(stream))
    except BaseException:
        for stream in started:
            await stream.aclose()
        raise
    return started


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several streams as they come, tagged with the stream's index. Closing the merged
    iterator cancels (and so aborts) the streams still running.

    Bounded: the queue holds at most one item per stream, and a stream is read again only once
    the consumer took from the queue. A consumer that falls behind leaves the outputs in each
    request's own collector (merged there, and the request aborted past AsyncLLM's
    `max_unread_outputs`), exactly as with a single stream, instead of in this queue."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=len(streams))
    done = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        end: object = done
        try:
            async with contextlib.aclosing(stream):  # cancelled while waiting to put: closed
                async for item in stream:
                    await queue.put((index, item))
        except Exception as exc:  # handed to the consumer, which raises it
            end = exc
        await queue.put((index, end))  # (not when cancelled: nobody reads any more)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def gather_or_cancel(tasks: list[asyncio.Future[T]]) -> list[T]:
    """All results, or the first error with the other tasks cancelled."""
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def json_response(body: Awaitable[BaseModel], raw_request: Request) -> JSONResponse:
    """A non-streaming response, its work cancelled when the client disconnects first."""
    return JSONResponse((await cancel_on_disconnect(body, raw_request)).model_dump())


async def cancel_on_disconnect(work: Awaitable[T], raw_request: Request) -> T:
    """Runs `work` (a non-streaming request) but cancels it when the client disconnects first."""
    task = await run_until_disconnect(work, raw_request.receive)
    if task.cancelled():
        raise ApiError(499, "ClientClosedRequest", "the client disconnected")
    return task.result()


async def run_until_disconnect(work: Awaitable[T], receive: Receive) -> asyncio.Future[T]:
    """Runs `work` in a task of its own until it ends or the client disconnects, which cancels
    it; returns the task, done (a result, an error, or cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


# --------------------------------------------------------------------------- outputs


@dataclass(slots=True)
class ChoiceAccumulator:
    """One choice built up from delta outputs (non-streaming responses)."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass(slots=True)
class CollectedRequest:
    """One request's whole result: its n choices and, when asked, its prompt's logprobs."""

    choices: list[ChoiceAccumulator]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


async def collect_choices(stream: AsyncIterator[RequestOutput], n: int) -> CollectedRequest:
    """All (delta) outputs of one request folded into its n choices."""
    collected = CollectedRequest([ChoiceAccumulator() for _ in range(n)])
    choices = collected.choices
    async for output in stream:
        if output.prompt_logprobs is not None and collected.prompt_logprobs is None:
            collected.prompt_logprobs = output.prompt_logprobs
        collected.num_cached_tokens = max(collected.num_cached_tokens, output.num_cached_tokens)
        for completion in output.outputs:
            choice = choices[completion.index]
            choice.text_parts.append(completion.text)
            choice.token_ids.extend(completion.token_ids)
            choice.logprobs.extend(completion.logprobs or ())
            if completion.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason
    return collected


MIN_JSON_LOGPROB = -9999.0  # JSON has no -inf


def json_logprob(logprob: Logprob) -> float:
    """A logprob as JSON can carry it (-inf, a masked token, becomes MIN_JSON_LOGPROB)."""
    return max(logprob.logprob, MIN_JSON_LOGPROB)


def decode_token(tokenizer: Any, token_id: int, logprob: Logprob | None = None, as_token_id: bool = False) -> str:
    """A logprob's token as text, or as 'token_id:<int>' (vLLM's return_tokens_as_token_ids; also
    the only form a server without a tokenizer has)."""
    if as_token_id or tokenizer is None:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id])


def prompt_logprobs_json(tokenizer: Any, entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` field: per prompt position (the first is None) a dict of token
    id -> {logprob, rank, decoded_token}; the tokens' text whatever return_tokens_as_token_ids
    says (as vLLM: that flag is the `logprobs` fields')."""
    if entries is None:
        return None
    return [None if entry is None else {
        token_id: LogprobEntry(logprob=json_logprob(lp), rank=lp.rank, decoded_token=decode_token(tokenizer, token_id, lp))
        for token_id, lp in entry.items()} for entry in entries]


def top_logprobs(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of one position (by rank), most likely first."""
    ranked = sorted(((tid, lp) for tid, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)
    return [(tid, lp) for tid, lp in ranked if lp.rank <= k][:k]


class SSEResponse(StreamingResponse):
    """Server-sent events, each already encoded (bytes). The event generator is closed as soon
    as streaming stops (a client that disconnected included), which aborts the requests it was
    reading. An error the events raise after the stream began becomes one event
    (`error_event`), then `last` ends the stream (vLLM's `data: [DONE]`; None for none).

    The events are sent from a task of their own, cancelled if the client disconnects first, as
    Starlette's StreamingResponse does, but without its anyio task group and its per-chunk type
    check: the API server's CPU per streamed token is what bounds a served stream's speed."""

    def __init__(self, events: AsyncGenerator[bytes, None], last: bytes | None = SSE_DONE,
                 error_event: Callable[[Exception], bytes] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.events = events
        self.last = last
        self.error_event = error_event or sse_error
        self.on_close: list[Callable[[], None]] = []  # run once the stream has ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = await run_until_disconnect(self.stream_response(send, scope.get(BODY_SEND, send)), receive)
        if not task.cancelled():
            task.result()  # an error met while sending goes on to the server's handlers

    async def stream_response(self, send: Send, body_send: Send | None = None) -> None:
        """`body_send`: where the body chunks go once the start went through `send` (past the
        layers that act on the start only: middleware.py)."""
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            send = body_send or send
            failed = False
            while not failed:
                try:
                    event = await anext(self.events)
                except StopAsyncIteration:
                    break
                except Exception as exc:  # (not one of `send`'s: those end the response)
                    event, failed = self.error_event(exc), True
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": self.last or b"", "more_body": False})
        finally:
            await self.events.aclose()
            for callback in self.on_close:
                callback()


def sse_error(exc: Exception) -> bytes:
    """An error met after a stream began: one error event (SSEResponse then ends the stream)."""
    if describe_error(exc)[0] == 500:
        logger.exception("error while streaming", exc_info=exc)
    return f"data: {json.dumps(error_body(*describe_error(exc)))}\n\n".encode()


def sse_event(chunk: BaseModel) -> bytes:
    return f"data: {chunk.model_dump_json()}\n\n".encode()



# --------------------------------------------------------------------------- beam search


async def beam_search_stream(ctx: ServingContext, engine_prompt: dict[str, Any], params: BeamSearchParams,
                             request_id: str, priority: int = 0,
                             lora: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
    """vLLM's server-side beam search: every step sends each live beam to the engine for one
    token (BeamSearch decides what to keep), then yields one finished RequestOutput whose
    outputs are the beam_width best beams, best first, so the handlers treat it as any
    request's output."""
    prompt_ids = engine_prompt["prompt_token_ids"]
    tokenizer = ctx.require_tokenizer("use_beam_search")
    search = BeamSearch([prompt_ids], params, tokenizer.eos_token_id)
    step_params = params.step_params()
    step = 0
    while batch := search.pending():
        step_streams = [tracked_generate(ctx, {**engine_prompt, "prompt": None, "prompt_token_ids": tokens},
                                         step_params, f"{request_id}-beam{step}-{i}", priority, lora)
                        for i, tokens in enumerate(batch)]
        collected = await asyncio.gather(*(collect_choices(stream, 1) for stream in step_streams))
        search.advance([c.choices[0].logprobs[0] for c in collected])
        step += 1
    outputs = []
    for index, beam in enumerate(search.results()[0]):
        generated = search.generated(0, beam)
        text = await off_loop(ctx, tokenizer.decode, generated, skip_special_tokens=params.skip_special_tokens)
        outputs.append(CompletionOutput(index=index, text=text, token_ids=generated, cumulative_logprob=beam.cum_logprob,
                                        finish_reason=beam.finish_reason))
    yield RequestOutput(request_id, engine_prompt.get("prompt"), prompt_ids, outputs, True)
