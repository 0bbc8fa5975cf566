"""The OpenAI-compatible server: `build_app` makes a FastAPI app around an engine (AsyncLLM),
`run_server` serves it with uvicorn (`vllm-lite serve`).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics, GET /version, POST /tokenize, POST /detokenize. Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: 400 invalid parameters (the field named),
401 a wrong API key, 404 an unknown model, 503 a dead engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from vllm_lite.version import __version__
from vllm_lite.exceptions import EngineDeadError
from vllm_lite.entrypoints.openai.metrics import ServerMetrics
from vllm_lite.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    OpenAIBaseModel,
    TokenizeRequest,
    TokenizeResponse,
)
from vllm_lite.entrypoints.openai.serving import (
    ApiError,
    EngineClient,
    ServingContext,
    describe_error,
    encode_prompt,
    error_body,
    render_chat,
)
from vllm_lite.entrypoints.openai.serving_chat import create_chat_completion
from vllm_lite.entrypoints.openai.serving_completion import create_completion

logger = logging.getLogger(__name__)


def build_app(engine: EngineClient, served_model_names: Sequence[str] = (), api_key: str | None = None, *,
              owns_engine: bool = False) -> FastAPI:
    """`engine` is an AsyncLLM (or anything with its interface). `owns_engine`: shut the engine
    down when the app's lifespan ends (what `run_server` wants)."""
    model_config = engine.vllm_config.model_config
    names = tuple(served_model_names) or (model_config.model,)
    ctx = ServingContext(engine=engine, tokenizer=engine.tokenizer, model_names=names,
                         model_path=model_config.model, max_model_len=model_config.max_model_len,
                         metrics=ServerMetrics(names[0]))
    lifespan = _shutdown_on_exit(engine) if owns_engine else None
    app = FastAPI(title="vllm_lite", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    _add_error_handlers(app)
    if api_key:
        app.middleware("http")(_require_api_key(api_key))
    _add_openai_routes(app, ctx)
    _add_server_routes(app, ctx)
    return app


def _shutdown_on_exit(engine: EngineClient) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            engine.shutdown()

    return lifespan


# --------------------------------------------------------------------------- errors


def _error_response(status_code: int, err_type: str, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status_code, err_type, message, param), status_code=status_code)


def _add_error_handlers(app: FastAPI) -> None:
    async def known_error(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(*describe_error(exc))

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        return _error_response(400, "BadRequestError", message, param)

    for exc_type in (ApiError, EngineDeadError, ValueError, TypeError):
        app.add_exception_handler(exc_type, known_error)
    app.add_exception_handler(RequestValidationError, validation_error)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's errors as one line, one error per field (a union field fails once per
    member; the first says enough); the first field is `param`."""
    first_error: dict[str, str] = {}
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "invalid JSON")
            return f"malformed JSON in the request body: {reason}", None
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        field = loc[0] if loc else "body"
        detail = ".".join(loc[1:])
        first_error.setdefault(field, f"{field}{f' ({detail})' if detail else ''}: {error.get('msg', 'invalid')}")
    param = next(iter(first_error), None)
    return "invalid request: " + "; ".join(first_error.values()), param


def _require_api_key(api_key: str) -> Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]]:
    expected = f"Bearer {api_key}".encode()

    async def check_api_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.method != "OPTIONS" and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "").encode()
            if not secrets.compare_digest(given, expected):
                return _error_response(401, "AuthenticationError", "Incorrect API key provided.", "api_key")
        return await call_next(request)

    return check_api_key


def _log_unknown_fields(request: OpenAIBaseModel) -> None:
    if request.unknown_fields():
        logger.warning("ignored unknown request fields: %s", request.unknown_fields())


# --------------------------------------------------------------------------- routes


def _add_openai_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        _log_unknown_fields(request)
        return await create_completion(ctx, request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        _log_unknown_fields(request)
        return await create_chat_completion(ctx, request, raw_request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.max_model_len)
                               for name in ctx.model_names])


def _add_server_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/health")
    async def health() -> Response:
        await ctx.engine.check_health()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await ctx.engine.get_stats()
        return Response(ctx.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        ctx.served_model(request.model)
        if request.messages is not None:
            text = render_chat(ctx, [{"role": m.role, "content": m.text()} for m in request.messages],
                               add_generation_prompt=request.add_generation_prompt)
            token_ids = ctx.tokenizer.encode(text, add_special_tokens=False)
        elif request.prompt is not None:
            token_ids = encode_prompt(ctx, request.prompt, request.add_special_tokens)["prompt_token_ids"]
        else:
            raise ApiError(400, "BadRequestError", "pass `prompt` or `messages`", "prompt")
        return TokenizeResponse(count=len(token_ids), max_model_len=ctx.max_model_len, tokens=token_ids)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        ctx.served_model(request.model)
        vocab_size = len(ctx.tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, "BadRequestError", f"tokens outside the vocabulary [0, {vocab_size}): {bad[:8]}",
                           "tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(request.tokens))


# --------------------------------------------------------------------------- serving


def run_server(args: argparse.Namespace) -> None:
    """`vllm-lite serve`: build the engine inside the server's event loop, then serve until
    SIGINT/SIGTERM; the app's lifespan shuts the engine (and its processes) down."""
    asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from vllm_lite.engine.async_llm import AsyncLLM
    from vllm_lite.entrypoints.cli_args import engine_args_from

    engine_args = engine_args_from(args)
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        names = args.served_model_name or ([engine_args.model] if engine_args.model else [])
        app = build_app(engine, names, args.api_key, owns_engine=True)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                timeout_graceful_shutdown=5)
        await uvicorn.Server(config).serve()
    finally:
        engine.shutdown()

