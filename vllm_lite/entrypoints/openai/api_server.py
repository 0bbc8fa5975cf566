"""The OpenAI-compatible server: `build_app` makes a FastAPI app around an engine (AsyncLLM),
`run_server` serves it with uvicorn (`vllm-lite serve`).

Routes: POST /v1/completions, POST /v1/chat/completions (and /batch), GET /v1/models, GET /health,
GET|POST /ping, GET /metrics, GET /version, GET /load, POST /invocations, POST /tokenize,
POST /detokenize, GET /tokenizer_info (--enable-tokenizer-info-endpoint) (and FastAPI's
/docs, /openapi.json); with --root-path, each also under that prefix. Every answer other than 2xx uses OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: 400 invalid parameters (the field named),
401 a wrong API key (every route but /health and /ping), 404 an unknown model or route, 413 a
body over --max-request-body-bytes, 503 a dead engine or a server shutting down, 500 only for
a bug. When the engine dies the server exits with status 1, so a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import inspect
import json
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from types import FrameType
from typing import Any, TypeVar

import uvicorn
import uvloop
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from vllm_lite.version import __version__
from vllm_lite.exceptions import EngineDeadError, ProfilerAlreadyActiveError, VLLMValidationError
from vllm_lite.lora.request import LoRARequest
from vllm_lite.entrypoints.chat_content import image_placeholder
from vllm_lite.entrypoints.openai.serving_models import ServedModels
from vllm_lite.lifecycle import freeze_startup_heap
from vllm_lite.entrypoints.openai.metrics import (ServerMetrics, cache_config_info, num_engines,
                                                  num_speculative_tokens)
from vllm_lite.entrypoints.openai import orca
from vllm_lite.entrypoints.openai.errors import ApiError, describe_error, route_error_body
from vllm_lite.entrypoints.openai.middleware import RequestGate, ServerSend, route_path
from vllm_lite.entrypoints.openai.protocol import (
    AbortRequestsRequest,
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CollectiveRpcRequest,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    OpenAIBaseModel,
    RequestModel,
    StartProfileRequest,
    UpdateWeightVersionRequest,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
    UnloadLoRAAdapterRequest,
    tokenizer_config,
)
from vllm_lite.entrypoints.openai.serving import (
    RESERVED_TEMPLATE_KWARGS,
    EngineClient,
    ServingContext,
    SSEResponse,
    check_token_ids,
    encode_prompt,
    off_loop,
    render_chat,
)
from vllm_lite.entrypoints.openai.server_state import (DEFAULT_MAX_STORED_RESPONSES, ResponseStore, ServerLoad,
                                                       ServerOptions, load_chat_template)
from vllm_lite.entrypoints.openai.reasoning_parsers import reasoning_count_tokens
from vllm_lite.entrypoints.openai.tool_parsers import TOOL_MARKERS
from vllm_lite.reasoning_tags import reasoning_markers, special_token_markers
from vllm_lite.engine.stats_log import StatsLog, log_stats_interval
from vllm_lite.entrypoints.openai.responses_protocol import ResponsesRequest
from vllm_lite.entrypoints.openai.anthropic_protocol import (AnthropicCountTokensRequest, AnthropicErrorResponse,
                                                             AnthropicMessagesRequest)
from vllm_lite.entrypoints.openai.serving_anthropic import count_tokens, create_message
from vllm_lite.entrypoints.openai.structured_outputs import BACKENDS as STRUCTURED_OUTPUT_BACKENDS
from vllm_lite.entrypoints.openai.serving_responses import (end_background_runs, cancel_response, create_response,
                                                            retrieve_response)
from vllm_lite.entrypoints.openai.serving_chat import create_batch_chat_completion, create_chat_completion
from vllm_lite.entrypoints.openai.serving_completion import create_completion
from vllm_lite.entrypoints.openai.serving_tools import tool_names
from vllm_lite.entrypoints.openai.serving_embedding import (ClassificationRequest, ClassificationResponse,
                                                           EmbeddingRequest, EmbeddingResponse, PoolingRequest,
                                                           PoolingResponse, create_classification, create_embedding)
from vllm_lite.entrypoints.openai.serving_score import (RerankRequest, RerankResponse, ScoreRequest, ScoreResponse,
                                                       create_rerank, create_score)

logger = logging.getLogger(__name__)
T = TypeVar("T", bound=RequestModel)


# Documented on every route of /openapi.json: the error answers a client must expect.
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": description}
    for code, description in ((400, "invalid request"), (401, "wrong or missing API key"),
                              (404, "unknown model"), (413, "body too large"),
                              (500, "server bug"), (503, "engine dead or server shutting down"))}
_ANTHROPIC_ERROR_RESPONSES = {code: {**response, "model": AnthropicErrorResponse}
                              for code, response in _ERROR_RESPONSES.items()}


def _parser_special_markers(tokenizer: Any, options: ServerOptions) -> dict[str, tuple[str, ...]]:
    if tokenizer is None:
        return {}
    tool = TOOL_MARKERS[options.tool_call_parser] if options.tool_call_parser else ()
    reasoning = reasoning_markers(options.reasoning_parser) if options.reasoning_parser else ()
    return {"tool_special_markers": special_token_markers(tokenizer, tool),
            "reasoning_special_markers": special_token_markers(tokenizer, reasoning)}


def _harmony_options(options: ServerOptions, model_config: Any) -> ServerOptions:
    """gpt-oss replies in the harmony format, which vLLM always reads as such (harmony.py): its
    parsers are `openai_gptoss` and `openai` (another is refused, as vLLM refuses it); without
    --reasoning-parser the analysis channel is read and left out."""
    raw = getattr(getattr(model_config, "hf", None), "raw", None) or {}
    if raw.get("model_type") != "gpt_oss":
        return options
    if options.reasoning_parser not in (None, "openai_gptoss"):
        raise ValueError(f"gpt-oss replies in the harmony format: --reasoning-parser must be openai_gptoss (or "
                         f"unset), got {options.reasoning_parser!r}")
    if options.tool_call_parser not in (None, "openai"):
        raise ValueError(f"gpt-oss replies in the harmony format: --tool-call-parser must be openai, got "
                         f"{options.tool_call_parser!r}")
    if options.reasoning_parser is None:
        return dataclasses.replace(options, reasoning_parser="openai_gptoss", show_reasoning=False)
    return options


def build_app(engine: EngineClient, served_model_names: Sequence[str] = (), api_key: str | None = None, *,
              owns_engine: bool = False, options: ServerOptions | None = None) -> FastAPI:
    """`engine` is an AsyncLLM (or anything with its interface). `owns_engine`: shut the engine
    down when the app's lifespan ends (what `run_server` wants). `api_key` overrides
    `options.api_key`."""
    options = options or ServerOptions()
    if api_key:
        options = dataclasses.replace(options, api_key=api_key)
    model_config = engine.vllm_config.model_config
    options = _harmony_options(options, model_config)
    if engine.tokenizer is None:
        _refuse_text_options(options)
    names = tuple(served_model_names) or (model_config.model,)
    ctx = ServingContext(engine=engine, tokenizer=engine.tokenizer, model_names=names,
                         models=_served_models(engine, names, options),
                         model_path=model_config.model, max_model_len=model_config.max_model_len,
                         metrics=ServerMetrics(names[0], model_config.max_model_len,
                                               cache_config_info(engine.vllm_config),
                                               num_speculative_tokens(engine.vllm_config),
                                               num_engines(engine.vllm_config)),
                         vocab_size=model_config.hf.vocab_size, sampling_defaults=model_config.sampling_defaults,
                         max_prompt_chars=_max_prompt_chars(engine.tokenizer, model_config.max_model_len),
                         options=options, load=ServerLoad(enabled=options.enable_server_load_tracking),
                         responses=ResponseStore(options.max_stored_responses),
                         think_tokens=(reasoning_count_tokens(engine.tokenizer, options.reasoning_parser)
                                       if options.reasoning_parser else None),
                         **_parser_special_markers(engine.tokenizer, options),
                         scheduling_policy=getattr(getattr(engine.vllm_config, "scheduler_config", None), "policy",
                                                   "fcfs"),
                         image_placeholder=image_placeholder(engine.tokenizer, model_config.image_encoder),
                         images_refused=model_config.images_refused or "the model takes no images")
    docs = {} if not options.disable_fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="vllm_lite", version=__version__, lifespan=_lifespan(ctx, owns_engine),
                  responses=_ERROR_RESPONSES, root_path=options.root_path, **docs)
    app.state.ctx = ctx
    if ctx.sampling_defaults:
        logger.warning("requests that leave them unset take the model's generation-config sampling values %s "
                       "(vLLM's rule; --generation-config vllm to not use them)", ctx.sampling_defaults)
    engine.stat_loggers.append(ctx.metrics.record_iteration)
    engine.admission_loggers.append(ctx.metrics.admission_rejected)
    _add_error_handlers(app)
    instrument_http(app, ctx.metrics.registry)
    # CORS inside the gate (added first): a browser's preflight (OPTIONS, no key) passes the gate.
    app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                       allow_methods=list(options.allowed_methods), allow_headers=list(options.allowed_headers),
                       allow_credentials=options.allow_credentials)
    app.add_middleware(RequestGate, options=options, drain=ctx.drain)
    for path in options.middleware:  # outside the gate (added last): they see every request, as in vLLM
        add_user_middleware(app, path)
    _add_openai_routes(app, ctx)
    _add_server_routes(app, ctx)
    return app


# vLLM's: its routes for probes and scrapes are not counted
_UNCOUNTED_ROUTES = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")


def instrument_http(app: FastAPI, registry: CollectorRegistry) -> None:
    """vLLM's HTTP metrics (prometheus-fastapi-instrumentator's defaults, as vLLM sets them up):
    http_requests_total by handler, method and status class, request and response sizes,
    http_request_duration_seconds by handler and method (vLLM's Grafana dashboards read them)."""
    Instrumentator(excluded_handlers=list(_UNCOUNTED_ROUTES), registry=registry).add().instrument(app)


def load_middleware(path: str) -> Any:
    """vLLM's --middleware: "package.module.name", an ASGI middleware class or an HTTP middleware
    function `async (request, call_next) -> response`; a path that does not import is named."""
    module_name, _, name = path.rpartition(".")
    try:
        middleware = getattr(importlib.import_module(module_name), name) if module_name else None
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--middleware {path!r} does not import: {exc}") from None
    if not (inspect.isclass(middleware) or inspect.iscoroutinefunction(middleware)):
        raise ValueError(f"--middleware {path!r} must name an ASGI middleware class or an async function "
                         f"(request, call_next), got {type(middleware).__name__}")
    return middleware


def add_user_middleware(app: FastAPI, path: str) -> None:
    middleware = load_middleware(path)
    if inspect.isclass(middleware):
        app.add_middleware(middleware)
    else:
        app.middleware("http")(middleware)


def _refuse_text_options(options: ServerOptions) -> None:
    """Options that only work on text cannot be served without a tokenizer: refused at start."""
    needs_text = {"--reasoning-parser": options.reasoning_parser,
                  "--enable-auto-tool-choice": options.enable_auto_tool_choice,
                  "--enable-tokenizer-info-endpoint": options.enable_tokenizer_info_endpoint}
    given = [flag for flag, value in needs_text.items() if value]
    if given:
        raise ValueError(f"{', '.join(given)} need(s) the tokenizer, which --skip-tokenizer-init leaves unloaded")


def _max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """No text of max_model_len tokens is longer than max_model_len times the longest token."""
    if tokenizer is None:  # --skip-tokenizer-init: text is refused where it would be tokenized
        return sys.maxsize
    longest_token = max(map(len, tokenizer.get_vocab()), default=1)
    return (max_model_len + 1) * max(longest_token, 1)


Lifespan = Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]


def _lifespan(ctx: ServingContext, owns_engine: bool) -> Lifespan:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stats_log = None if ctx.options.disable_log_stats else StatsLog(log_stats_interval())
        if stats_log is not None:
            ctx.engine.stat_loggers.append(stats_log.record_iteration)
            stats_task = asyncio.get_running_loop().create_task(stats_log.run(ctx.engine.get_stats))
        try:
            yield
        finally:
            await end_background_runs(ctx)
            if stats_log is not None:
                stats_task.cancel()
                ctx.engine.stat_loggers.remove(stats_log.record_iteration)
            ctx.engine.stat_loggers.remove(ctx.metrics.record_iteration)
            ctx.engine.admission_loggers.remove(ctx.metrics.admission_rejected)
            ctx.tokenizer_thread.shutdown(wait=False, cancel_futures=True)
            if owns_engine:
                ctx.engine.shutdown()

    return lifespan


def engine_is_dead(engine: EngineClient) -> bool:
    """The one place the server asks whether its engine is gone for good (AsyncLLM.errored:
    the engine core's death today; with issue 13, the output handler's death too)."""
    return engine.errored


# --------------------------------------------------------------------------- errors


def _error_response(request: Request, status_code: int, err_type: str, message: str, param: str | None = None,
                    headers: dict[str, str] | None = None) -> JSONResponse:
    body = route_error_body(route_path(request.scope), status_code, err_type, message, param)
    return JSONResponse(body, status_code=status_code, headers=headers)


_HTTP_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                     404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestEntityTooLargeError",
                     422: "UnprocessableEntityError"}


def _add_error_handlers(app: FastAPI) -> None:
    async def known_error(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(request, *describe_error(exc))

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        return _error_response(request, 400, "BadRequestError", message, param)

    async def http_error(request: Request, exc: Exception) -> Response:
        # Starlette's own answers (unknown route, wrong method, unparsable body) in OpenAI's shape.
        assert isinstance(exc, HTTPException)
        status = exc.status_code if exc.status_code >= 400 else 400
        if exc.status_code == 400:
            message = f"the request body is not valid JSON: {exc.detail}"
        else:
            message = str(exc.detail)
        return _error_response(request, status, _HTTP_ERROR_TYPES.get(status, "HTTPError"), message,
                               headers=exc.headers)

    for exc_type in (ApiError, EngineDeadError, ValueError, TypeError, RecursionError):
        app.add_exception_handler(exc_type, known_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's errors as one line, one error per field (a union field fails once per
    member; the first says enough), each with pydantic's error type as vLLM's messages carry it
    (e.g. `[type=less_than_equal]`); the first field is `param`."""
    first_error: dict[str, str] = {}
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "invalid JSON")
            return f"malformed JSON in the request body: {reason}", None
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        field = loc[0] if loc else "body"
        detail = ".".join(loc[1:])
        kind = f" [type={error['type']}]" if error.get("type") else ""
        first_error.setdefault(field, f"{field}{f' ({detail})' if detail else ''}: {error.get('msg', 'invalid')}{kind}")
    param = next(iter(first_error), None)
    return "invalid request: " + "; ".join(first_error.values()), param




# --------------------------------------------------------------------------- routes


_SSE_EVENT_SCHEMA = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                     "required": ["data"]}


def _generation_responses(model: type[OpenAIBaseModel] | None) -> dict[int | str, dict[str, Any]]:
    """200 is the JSON response (`model`'s, or an object), or server-sent events when the request
    streams (each event's `data` is a JSON chunk or event, an error object, or `[DONE]`)."""
    content: dict[str, Any] = {"text/event-stream": {"schema": _SSE_EVENT_SCHEMA}}
    if model is None:
        content["application/json"] = {"schema": {"type": "object"}}
    return {200: {**({"model": model} if model is not None else {}), "content": content,
                  "description": "the response, or its chunks as server-sent events (stream: true)"}}


def _validate(model: type[T], body: dict[str, Any]) -> T:
    """A body read by hand, validated as FastAPI validates a typed one (the same 400)."""
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in exc.errors()]) from None
    request.refuse_unknown_fields()
    return request


async def _load_aware(ctx: ServingContext, handler: Coroutine[Any, Any, Response], raw_request: Request) -> Response:
    """The handler counted in the server load until its response is done (a stream: until it
    ends); a non-streamed response carries the ORCA load report when the request asks for one."""
    try:
        report_format = orca.requested_format(raw_request.headers)
    except ApiError:
        handler.close()
        raise
    response = await _counted(ctx, handler)
    if report_format is not None and not isinstance(response, SSEResponse):
        metrics = orca.named_metrics(await ctx.engine.get_stats())
        response.headers.update(orca.orca_header(report_format, metrics))
    return response


async def _counted(ctx: ServingContext, handler: Awaitable[Response]) -> Response:
    ctx.load.start()
    try:
        response = await handler
    except BaseException:
        ctx.load.end()
        raise
    if isinstance(response, SSEResponse):
        response.on_close.append(ctx.load.end)
    else:
        ctx.load.end()
    return response


def _add_openai_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/completions", response_model=None, responses=_generation_responses(CompletionResponse))
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        request.refuse_unknown_fields()
        return await _load_aware(ctx, create_completion(ctx, request, raw_request), raw_request)

    @app.post("/v1/responses", response_model=None, responses=_generation_responses(None))
    async def responses(request: ResponsesRequest, raw_request: Request) -> Response:
        """The Responses API (serving_responses.py); unknown fields are refused by name."""
        return await _load_aware(ctx, create_response(ctx, request, raw_request), raw_request)

    @app.get("/v1/responses/{response_id}", response_model=None)
    async def retrieve(response_id: str, stream: bool = False, starting_after: int | None = None) -> Response:
        """A stored response (`store: true`), within --max-stored-responses; `stream`: a streamed
        background response's events after `starting_after`."""
        return await retrieve_response(ctx, response_id, stream, starting_after)

    @app.post("/v1/responses/{response_id}/cancel", response_model=None)
    async def cancel(response_id: str) -> Response:
        """vLLM's cancel: a background response still running stops; any other is a 400."""
        return await cancel_response(ctx, response_id)

    @app.post("/v1/messages", response_model=None,
              responses={**_generation_responses(None), **_ANTHROPIC_ERROR_RESPONSES})
    async def messages(request: AnthropicMessagesRequest, raw_request: Request) -> Response:
        """Anthropic's Messages API, as vLLM serves it (serving_anthropic.py); errors in
        Anthropic's shape."""
        return await _load_aware(ctx, create_message(ctx, request, raw_request), raw_request)

    @app.post("/v1/messages/count_tokens", response_model=None, responses=_ANTHROPIC_ERROR_RESPONSES)
    async def messages_count_tokens(request: AnthropicCountTokensRequest) -> Response:
        """The Messages request's prompt length (Anthropic's messages.count_tokens)."""
        return await count_tokens(ctx, request)

    @app.post("/v1/chat/completions", response_model=None,
              responses=_generation_responses(ChatCompletionResponse))
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        request.refuse_unknown_fields()
        return await _load_aware(ctx, create_chat_completion(ctx, request, raw_request), raw_request)

    @app.post("/v1/chat/completions/batch", response_model=ChatCompletionResponse)
    async def batch_chat_completions(request: BatchChatCompletionRequest, raw_request: Request) -> Response:
        """vLLM's batch endpoint: several conversations in one call, one choice per conversation."""
        request.refuse_unknown_fields()
        return await _load_aware(ctx, create_batch_chat_completion(ctx, request, raw_request), raw_request)

    @app.post("/invocations", response_model=None, responses=_generation_responses(ChatCompletionResponse))
    async def invocations(raw_request: Request) -> Response:
        """SageMaker's route (as vLLM): a chat completion body (`messages`) or a completion body
        (`prompt`), told apart by their fields."""
        body = await raw_request.json()
        if isinstance(body, dict) and "messages" in body:
            chat = _validate(ChatCompletionRequest, body)
            return await _load_aware(ctx, create_chat_completion(ctx, chat, raw_request), raw_request)
        if isinstance(body, dict) and "prompt" in body:
            completion = _validate(CompletionRequest, body)
            return await _load_aware(ctx, create_completion(ctx, completion, raw_request), raw_request)
        raise ApiError(400, "BadRequestError", "/invocations takes a chat completion request (with `messages`) "
                       "or a completion request (with `prompt`)", None)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def embeddings(request: EmbeddingRequest, raw_request: Request) -> Response:
        """vLLM's embedding API, on an embedding model's server (--runner pooling)."""
        request.refuse_unknown_fields()
        return await _load_aware(ctx, create_embedding(ctx, request, raw_request), raw_request)

    @app.post("/pooling", response_model=PoolingResponse)
    async def pooling(request: PoolingRequest, raw_request: Request) -> Response:
        """vLLM's pooling API, its `embed` task (an embedding model's vectors)."""
        request.refuse_unknown_fields()
        return await _load_aware(ctx, create_embedding(ctx, request, raw_request), raw_request)

    @app.post("/classify", response_model=ClassificationResponse)
    async def classify(request: ClassificationRequest, raw_request: Request) -> Response:
        """vLLM's classification API, on a classification model's server (a *ForSequenceClassification)."""
        request.refuse_unknown_fields()
        return await _load_aware(ctx, create_classification(ctx, request, raw_request), raw_request)

    @app.post("/score", response_model=ScoreResponse)
    @app.post("/v1/score", response_model=ScoreResponse)
    async def score(request: ScoreRequest, raw_request: Request) -> Response:
        """vLLM's score API on an embedding model: each pair's cosine similarity."""
        request.refuse_unknown_fields()
        return await _load_aware(ctx, create_score(ctx, request, raw_request), raw_request)

    @app.post("/rerank", response_model=RerankResponse)
    @app.post("/v1/rerank", response_model=RerankResponse)
    @app.post("/v2/rerank", response_model=RerankResponse)
    async def rerank(request: RerankRequest, raw_request: Request) -> Response:
        """vLLM's rerank API (Jina's and Cohere's shape) on an embedding model."""
        request.refuse_unknown_fields()
        return await _load_aware(ctx, create_rerank(ctx, request, raw_request), raw_request)

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's server load: generation requests in flight (0 unless --enable-server-load-tracking)."""
        return {"server_load": ctx.load.in_flight}

    @app.get("/v1/models")
    async def models() -> ModelList:
        """The base model's served names, then the LoRA adapters (their `parent`), as vLLM's."""
        return ModelList(data=ctx.models.cards(ctx.model_path, ctx.max_model_len))

    if ctx.options.allow_runtime_lora_updating:
        _add_lora_routes(app, ctx)


def _served_models(engine: EngineClient, names: tuple[str, ...], options: ServerOptions) -> ServedModels:
    """The served names and the --lora-modules adapters, each checked now (a bad one stops the
    server from starting, as vLLM's)."""
    resolver_dir = options.lora_resolver_cache_dir if options.allow_runtime_lora_updating else None
    model_ids = frozenset({engine.vllm_config.model_config.model, *names})
    models = ServedModels(names, engine.check_lora if hasattr(engine, "check_lora") else _no_lora,
                          getattr(engine, "forget_lora", None), resolver_dir, model_ids)
    for module in options.lora_modules:
        try:
            models.load(module.name, module.path, base_model_name=module.base_model_name)
        except ApiError as exc:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {exc.message}") from None
    return models


def _no_lora(lora_request: LoRARequest) -> None:
    raise VLLMValidationError("this engine serves no LoRA adapters")


def _add_lora_routes(app: FastAPI, ctx: ServingContext) -> None:
    """vLLM's runtime adapter routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING): 200 with a text line, or
    an error body."""
    logger.warning("LoRA dynamic loading & unloading is enabled in the API server (VLLM_ALLOW_RUNTIME_LORA_UPDATING)")

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        request.refuse_unknown_fields()
        # (the adapter's config and safetensors header are read here: small files, no tensors)
        return PlainTextResponse(ctx.models.load(request.lora_name, request.lora_path, request.load_inplace))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        request.refuse_unknown_fields()
        return PlainTextResponse(ctx.models.unload(request.lora_name, request.lora_int_id))


def _add_profile_routes(app: FastAPI, ctx: ServingContext) -> None:
    """vLLM's profiler routes, there when --profiler-config enables a profiler: 200 and an empty
    body; a second start while a session is on is a 409."""
    logger.warning("the profiler routes /start_profile and /stop_profile are enabled (--profiler-config); "
                   "traces go to %s", ctx.engine.vllm_config.profiler_config.torch_profiler_dir)

    @app.post("/start_profile", response_class=Response)
    async def start_profile(request: StartProfileRequest | None = Body(default=None)) -> Response:
        request = request or StartProfileRequest()
        request.refuse_unknown_fields()
        try:
            await ctx.engine.start_profile(request.profile_prefix, delay_iterations=request.delay_iterations,
                                           max_iterations=request.max_iterations)
        except ProfilerAlreadyActiveError as exc:
            raise ApiError(409, "ConflictError", str(exc)) from None
        return Response(status_code=200)

    @app.post("/stop_profile", response_class=Response)
    async def stop_profile() -> Response:
        await ctx.engine.stop_profile()
        return Response(status_code=200)


def _add_engine_control_routes(app: FastAPI, ctx: ServingContext) -> None:
    """vLLM's development and RL routes (VLLM_SERVER_DEV_MODE=1), which an RL trainer drives
    around its weight updates: collective_rpc on the workers, sleep / wake_up, pause / resume,
    aborting every request, the world size. Bad arguments are a 400 naming them."""
    logger.warning("SECURITY WARNING: development endpoints are enabled (VLLM_SERVER_DEV_MODE=1): /collective_rpc "
                   "runs worker methods; do not expose this server")
    engine = ctx.engine

    @app.post("/collective_rpc")
    async def collective_rpc(request: CollectiveRpcRequest) -> JSONResponse:
        """vLLM's: a worker method by name; arguments are strings (the method decodes them), as in vLLM."""
        request.refuse_unknown_fields()
        results = await _engine_call(engine.collective_rpc(request.method, request.timeout, tuple(request.args),
                                                           request.kwargs))
        return JSONResponse({"results": [_json_result(result) for result in results]})

    @app.post("/sleep")
    async def sleep(level: int = 1, mode: str = "abort") -> JSONResponse:
        await _engine_call(engine.sleep(level, mode))
        return JSONResponse({"status": "sleeping", "level": level})

    @app.post("/release_kv_cache_memory")
    async def release_kv_cache_memory() -> JSONResponse:
        await _engine_call(engine.release_kv_cache_memory())
        return JSONResponse({"status": "kv_cache_released"})

    @app.post("/wake_up")
    async def wake_up(raw_request: Request) -> JSONResponse:
        tags = raw_request.query_params.getlist("tags") or None
        awake = await _engine_call(engine.wake_up(tags))
        return JSONResponse({"status": "awake" if awake else "sleeping", "tags": tags})

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True) -> JSONResponse:
        await _engine_call(engine.pause_generation(mode=mode, clear_cache=clear_cache))
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume() -> JSONResponse:
        await engine.resume_generation()
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": await engine.is_paused()})

    @app.post("/abort_requests")
    async def abort_requests(request: AbortRequestsRequest) -> JSONResponse:
        """vLLM's: the named requests, or every request in flight when none are named."""
        request.refuse_unknown_fields()
        request_ids = request.request_ids or engine.unfinished_request_ids()
        await engine.abort(request_ids)
        return JSONResponse({"status": "aborted", "aborted": len(request_ids)})

    @app.post("/update_weight_version")
    async def update_weight_version(request: UpdateWeightVersionRequest) -> JSONResponse:
        request.refuse_unknown_fields()
        await _engine_call(engine.update_weight_version(request.new_version))
        return JSONResponse({"success": True, "new_version": request.new_version})

    @app.get("/weight_info")
    async def weight_info() -> JSONResponse:
        return JSONResponse({"weight_version": await engine.get_weight_version()})

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True) -> JSONResponse:
        parallel = engine.vllm_config.parallel_config
        return JSONResponse({"world_size": parallel.world_size * (parallel.data_parallel_size if include_dp else 1)})


async def _engine_call(call: Awaitable[Any]) -> Any:
    """An engine control call whose arguments the engine refused (ValueError, TypeError, a
    worker method's own error) answers 400 with the reason; a timeout, 504."""
    try:
        return await call
    except (ValueError, TypeError, AttributeError) as exc:
        raise ApiError(400, "BadRequestError", str(exc)) from None
    except TimeoutError as exc:
        raise ApiError(504, "TimeoutError", str(exc) or "the call did not finish in time") from None
    except RuntimeError as exc:
        if isinstance(exc, EngineDeadError):
            raise
        raise ApiError(400, "BadRequestError", str(exc)) from None


def _json_result(result: Any) -> Any:
    """vLLM's rendering of a worker's result: None, a dict or a list as JSON, anything else as
    its str (and so is a dict or list JSON cannot hold)."""
    if result is None:
        return None
    if isinstance(result, (dict, list)):
        try:
            json.dumps(result)
            return result
        except (TypeError, ValueError):
            pass
    return str(result)


def _add_server_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/health", response_class=Response, responses={200: {"description": "the engine answers"}})
    async def health() -> Response:
        """200 when the engine answers a health check within --health-check-timeout, else 503."""
        if engine_is_dead(ctx.engine):
            raise EngineDeadError("the engine is dead")
        try:
            await asyncio.wait_for(ctx.engine.check_health(), ctx.options.health_check_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(503, "ServiceUnavailableError", "the engine did not answer a health check within "
                           f"{ctx.options.health_check_timeout_s:g} s") from None
        return Response(status_code=200)

    # vLLM's (SageMaker's) liveness route: /health under another name, GET or POST.
    no_body = {"response_class": Response, "responses": {200: {"description": "the engine answers"}}}
    app.get("/ping", operation_id="ping_get", **no_body)(health)
    app.post("/ping", operation_id="ping_post", **no_body)(health)

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        stats = await ctx.engine.get_stats()
        return Response(ctx.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        request.refuse_unknown_fields()
        request.check_form()
        ctx.served_model(request.model)
        if request.messages is not None:
            if request.tools is not None:
                tool_names(request.tools)
            text = await render_chat(ctx, request.conversation(), add_generation_prompt=request.add_generation_prompt,
                                     continue_final_message=request.continue_final_message,
                                     chat_template=request.chat_template,
                                     chat_template_kwargs=request.chat_template_kwargs, tools=request.tools)
            token_ids = await off_loop(ctx, ctx.require_tokenizer("messages").encode, text,
                                       add_special_tokens=request.special_tokens())
        else:
            prompt = await encode_prompt(ctx, request.prompt, request.special_tokens(), check_fits=False)
            token_ids = prompt["prompt_token_ids"]
        token_strs = None
        if request.return_token_strs:
            token_strs = await off_loop(ctx, ctx.require_tokenizer("return_token_strs").convert_ids_to_tokens,
                                        token_ids)
        return TokenizeResponse(count=len(token_ids), max_model_len=ctx.max_model_len, tokens=token_ids,
                                token_strs=token_strs)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        request.refuse_unknown_fields()
        ctx.served_model(request.model)
        check_token_ids(ctx, request.tokens, "tokens")
        return DetokenizeResponse(prompt=await off_loop(ctx, ctx.require_tokenizer("tokens").decode, request.tokens))

    if ctx.options.dev_mode:
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False) -> JSONResponse:
            """vLLM's development route (VLLM_SERVER_DEV_MODE=1): forget the prefix cache's blocks;
            {"success": false} while requests hold blocks. There is no external cache to reset."""
            if reset_running_requests:
                raise ApiError(400, "BadRequestError", "reset_running_requests=true (preempting the running requests "
                               "to reset the cache) is not supported; retry when they have finished",
                               "reset_running_requests")
            logger.info("resetting the prefix cache")
            return JSONResponse({"success": bool(await ctx.engine.reset_prefix_cache())})

        @app.post("/reset_mm_cache")
        async def reset_mm_cache() -> Response:
            """vLLM's development route: this server forgets the processed images it keeps."""
            logger.info("resetting the multi-modal processor cache")
            await ctx.engine.reset_mm_cache()
            return Response(status_code=200)

        @app.post("/reset_encoder_cache")
        async def reset_encoder_cache() -> Response:
            """vLLM's development route: the workers forget the image features kept for reuse."""
            logger.info("resetting the encoder cache")
            await ctx.engine.reset_encoder_cache()
            return Response(status_code=200)

        _add_engine_control_routes(app, ctx)

    profiler_config = getattr(ctx.engine.vllm_config, "profiler_config", None)
    if profiler_config is not None and profiler_config.enabled:
        _add_profile_routes(app, ctx)

    if ctx.options.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info() -> TokenizerInfoResponse:
            """vLLM's: the tokenizer's configuration (tokenizer_config.json's fields, file paths
            left out), its class, and the chat template when there is one."""
            return TokenizerInfoResponse(**tokenizer_config(ctx.tokenizer))


# --------------------------------------------------------------------------- serving


def run_server(args: argparse.Namespace) -> int:
    """`vllm-lite serve`: build the engine inside the server's event loop, then serve until
    SIGINT/SIGTERM (a drain: see ShutdownDrain) or until the engine dies. Returns the exit
    status: 1 when the engine died, else 0. (--api-server-count > 1: api_server_pool.py.)"""
    return uvloop.run(serve(args, _spawned_engine(args)))


def _spawned_engine(args: argparse.Namespace) -> Callable[[], EngineClient]:
    def make() -> EngineClient:
        from vllm_lite.engine.async_llm import AsyncLLM
        from vllm_lite.entrypoints.cli_args import engine_args_from

        # (the server writes the stats line itself: --disable-log-stats is read from `args`)
        return AsyncLLM.from_engine_args(dataclasses.replace(engine_args_from(args), disable_log_stats=True))

    return make


SSL_FLAGS = ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "ssl_ciphers")


def ssl_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's TLS settings from vLLM's --ssl-* flags (HTTPS when --ssl-certfile is given); the
    files are checked here so that a wrong path is named, not an OpenSSL error."""
    given = {name: getattr(args, name, None) for name in SSL_FLAGS}
    given = {name: value for name, value in given.items() if value is not None}
    if not given:
        return {}
    if "ssl_certfile" not in given:
        raise ValueError(f"--{next(iter(given)).replace('_', '-')} needs --ssl-certfile (HTTPS is served with a "
                         "certificate)")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        if name in given and not os.path.isfile(given[name]):
            raise ValueError(f"--{name.replace('_', '-')}: no such file {given[name]!r}")
    return given


STRUCTURED_OUTPUTS_CONFIG_FIELDS = ("backend", "disable_any_whitespace")


def _compact_structured_outputs(args: argparse.Namespace) -> bool:
    """vLLM's --structured-outputs-config (a JSON object, or key by key: cli_args.vllm_argv): the backend must be
    xgrammar's (auto picks it); disable_any_whitespace makes every JSON grammar compact. Its
    other fields (reasoning, additional properties) are not implemented: refused by name."""
    config = getattr(args, "structured_outputs_config", None) or {}
    unknown = sorted(set(config) - set(STRUCTURED_OUTPUTS_CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"--structured-outputs-config: {', '.join(unknown)} not supported (only "
                         f"{', '.join(STRUCTURED_OUTPUTS_CONFIG_FIELDS)})")
    if config.get("backend", "auto") not in STRUCTURED_OUTPUT_BACKENDS:
        raise ValueError(f"--structured-outputs-config: backend must be {' or '.join(STRUCTURED_OUTPUT_BACKENDS)}, "
                         f"got {config['backend']!r}")
    compact = config.get("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise ValueError(f"--structured-outputs-config: disable_any_whitespace must be true or false, got {compact!r}")
    return compact


def _middleware_paths(args: argparse.Namespace) -> tuple[str, ...]:
    """--middleware's import paths, each checked to import (build_app adds them)."""
    paths = tuple(getattr(args, "middleware", None) or ())
    for path in paths:
        load_middleware(path)
    return paths


def _default_chat_template_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    defaults = getattr(args, "default_chat_template_kwargs", None) or {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(defaults))
    if reserved:
        raise ValueError(f"--default-chat-template-kwargs may not set {', '.join(reserved)} (the request's own fields)")
    return defaults


def dev_mode_from_environment() -> bool:
    """vLLM's VLLM_SERVER_DEV_MODE: "1" turns its development routes on, "0" (or unset) off."""
    value = os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"VLLM_SERVER_DEV_MODE must be 0 or 1, got {value!r}")
    return value == "1"


def server_options_from(args: argparse.Namespace) -> ServerOptions:
    """The server's options from `vllm-lite serve`'s flags (`run-batch` has only its request
    handling ones: the HTTP side's then keep their defaults)."""
    defaults = ServerOptions()
    return ServerOptions(api_key=tuple(getattr(args, "api_key", None) or ()) or os.environ.get("VLLM_LITE_API_KEY")
                         or os.environ.get("VLLM_API_KEY") or None,
                         dev_mode=dev_mode_from_environment(),
                         max_request_body_bytes=args.max_request_body_bytes,
                         max_n_sequences=args.max_n_sequences,
                         trust_request_chat_template=args.trust_request_chat_template,
                         enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                         tool_call_parser=getattr(args, "tool_call_parser", None),
                         reasoning_parser=getattr(args, "reasoning_parser", None),
                         max_stored_responses=getattr(args, "max_stored_responses", DEFAULT_MAX_STORED_RESPONSES),
                         enable_force_include_usage=getattr(args, "enable_force_include_usage", False),
                         enable_prompt_tokens_details=getattr(args, "enable_prompt_tokens_details", False),
                         enable_request_id_headers=getattr(args, "enable_request_id_headers", False),
                         enable_server_load_tracking=getattr(args, "enable_server_load_tracking", False),
                         enable_tokenizer_info_endpoint=getattr(args, "enable_tokenizer_info_endpoint", False),
                         root_path=getattr(args, "root_path", ""),
                         health_check_timeout_s=getattr(args, "health_check_timeout", defaults.health_check_timeout_s),
                         shutdown_timeout_s=getattr(args, "shutdown_timeout", defaults.shutdown_timeout_s),
                         chat_template_timeout_s=args.chat_template_timeout,
                         allowed_origins=tuple(getattr(args, "allowed_origins", ["*"])),
                         allowed_methods=tuple(getattr(args, "allowed_methods", ["*"])),
                         allowed_headers=tuple(getattr(args, "allowed_headers", ["*"])),
                         allow_credentials=getattr(args, "allow_credentials", False),
                         disable_fastapi_docs=getattr(args, "disable_fastapi_docs", False),
                         chat_template=load_chat_template(getattr(args, "chat_template", None)),
                         enable_log_requests=getattr(args, "enable_log_requests", False),
                         enable_log_outputs=getattr(args, "enable_log_outputs", False),
                         max_log_len=getattr(args, "max_log_len", None),
                         disable_log_stats=bool(getattr(args, "disable_log_stats", False)),
                         response_role=getattr(args, "response_role", "assistant"),
                         chat_template_content_format=getattr(args, "chat_template_content_format", "auto"),
                         middleware=_middleware_paths(args),
                         default_chat_template_kwargs=_default_chat_template_kwargs(args),
                         compact_structured_outputs=_compact_structured_outputs(args),
                         return_tokens_as_token_ids=getattr(args, "return_tokens_as_token_ids", False),
                         exclude_tools_when_tool_choice_none=getattr(args, "exclude_tools_when_tool_choice_none",
                                                                     False),
                         lora_modules=tuple(getattr(args, "lora_modules", None) or ()),
                         allow_runtime_lora_updating=runtime_lora_updating_from_environment(),
                         lora_resolver_cache_dir=lora_resolver_dir_from_environment())


def lora_resolver_dir_from_environment() -> str | None:
    """vLLM's VLLM_LORA_RESOLVER_CACHE_DIR: a folder of adapter folders (refused if it is no folder, as vLLM)."""
    folder = os.environ.get("VLLM_LORA_RESOLVER_CACHE_DIR") or None
    if folder is not None and not os.path.isdir(folder):
        raise ValueError(f"VLLM_LORA_RESOLVER_CACHE_DIR must be set to a valid directory, got {folder!r}")
    return folder


def runtime_lora_updating_from_environment() -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: "1" or "true" (any case) adds the adapter routes."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


async def serve(args: argparse.Namespace, make_engine: Callable[[], EngineClient],
                sockets: list[socket.socket] | None = None, server_class: type[DrainingServer] | None = None) -> int:
    """Serve the engine `make_engine` builds (inside this event loop) on `sockets`, or on
    --host/--port when none are given, until a signal or the engine's death (exit status 1)."""
    from vllm_lite.entrypoints.cli_args import engine_args_from

    show_info_logs()
    options = server_options_from(args)
    listen_tls = ssl_options(args)
    model = engine_args_from(args).model
    engine = make_engine()
    try:
        names = args.served_model_name or ([model] if model else [])
        app = build_app(engine, names, owns_engine=True, options=options)
        # The drain ends every request before uvicorn's own grace period (a backstop) runs out.
        config = uvicorn.Config(ServerSend(app), host=args.host, port=args.port, uds=getattr(args, "uds", None),
                                log_level=args.uvicorn_log_level,
                                access_log=not getattr(args, "disable_uvicorn_access_log", False),
                                timeout_graceful_shutdown=options.shutdown_timeout_s + 5, **listen_tls)
        _quiet_access_log_for(getattr(args, "disable_access_log_for_endpoints", None))
        server = (server_class or DrainingServer)(config, app.state.ctx)
        watchdog = asyncio.get_running_loop().create_task(_exit_when_engine_dies(server, engine))
        freeze_startup_heap()
        try:
            await server.serve(sockets)
        finally:
            watchdog.cancel()
        if engine_is_dead(engine):
            logger.error("the engine died; exiting with status 1 so that a supervisor restarts the server")
            return 1
        return 0
    finally:
        engine.shutdown()


class _EndpointAccessFilter(logging.Filter):
    """Drops uvicorn's access lines for some paths (a record's args: client, method, path with its
    query, HTTP version, status)."""

    def __init__(self, paths: frozenset[str]) -> None:
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3:
            return True
        return str(args[2]).split("?", 1)[0] not in self.paths


def _quiet_access_log_for(endpoints: str | None) -> None:
    """vLLM's --disable-access-log-for-endpoints "/health,/metrics": no access line for those
    paths (probes and scrapers), every other request still logged."""
    paths = frozenset(path.strip() for path in (endpoints or "").split(",") if path.strip())
    if paths:
        logging.getLogger("uvicorn.access").addFilter(_EndpointAccessFilter(paths))


def show_info_logs() -> None:
    """The server's own INFO lines (--enable-log-requests, the drain) on stderr, as vLLM's server
    shows its own; a handler the embedding application set up wins."""
    package_logger = logging.getLogger("vllm_lite")
    if package_logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGINT/SIGTERM also starts the request drain (uvicorn itself stops
    accepting connections and waits for the open ones)."""

    def __init__(self, config: uvicorn.Config, ctx: ServingContext) -> None:
        super().__init__(config)
        self.ctx = ctx

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        asyncio.get_event_loop().call_soon_threadsafe(begin_drain, self.ctx)
        super().handle_exit(sig, frame)


def begin_drain(ctx: ServingContext) -> None:
    """Refuse new requests; abort the ones in flight once --shutdown-timeout has passed."""
    def abort(request_ids: list[str]) -> None:
        asyncio.get_running_loop().create_task(ctx.engine.abort(request_ids))

    ctx.drain.begin(ctx.options.shutdown_timeout_s, abort)


async def _exit_when_engine_dies(server: Any, engine: EngineClient, interval_s: float = 0.5) -> None:
    """vLLM's watchdog: a dead engine ends the server (exit status 1), whose supervisor restarts it."""
    while not engine_is_dead(engine):
        await asyncio.sleep(interval_s)
    logger.error("the engine is dead; shutting the server down")
    server.should_exit = True
