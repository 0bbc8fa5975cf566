"""The gate every HTTP request passes before FastAPI parses it: the API key (every route but
/health and /ping), the refusal of new requests while the server drains, and the body-size
limit. It runs before the body is read, so an unauthenticated or oversized body costs nothing.
It is also the last catch: an exception no handler knew becomes a JSON 500 (a bug, logged once).
With --enable-request-id-headers every response it passes on carries one X-Request-Id: the
caller's, else a new uuid4 hex (vLLM's XRequestIdMiddleware).

The gate also leaves in the scope where a streamed response's body chunks go (`BODY_SEND`):
the response sends its start through the whole chain and its chunks from there. Every layer
FastAPI and the server put around a route (CORS, FastAPI's exception, exit-stack, telemetry and
body-limit layers, Starlette's ServerErrorMiddleware, the HTTP metrics' instrumentator, which
reads the status and Content-Length as vLLM's does, the gate's own tracking) acts on a
response's start only and passes body chunks through unchanged, so sending the chunks past them
changes nothing on the wire and saves five or six coroutine calls per streamed token. With no
--middleware the chunks go to the HTTP server's own `send` (left in the scope by `ServerSend`,
the app as the server runs it); with some, to the `send` the gate was given: middleware added
with --middleware sits outside the gate and sees every chunk."""

from __future__ import annotations

import json
import logging
import secrets
import uuid
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_lite.entrypoints.openai.errors import route_error_body
from vllm_lite.entrypoints.openai.server_state import ServerOptions, ShutdownDrain

logger = logging.getLogger(__name__)

# Liveness probes answer without a key, as in vLLM (a load balancer has none).
UNAUTHENTICATED_PATHS = frozenset(("/health", "/ping"))
_BODY_METHODS = frozenset(("POST", "PUT", "PATCH"))
# Scope keys: where a streamed response's body chunks go, and the HTTP server's own `send`
# (see the module docstring).
BODY_SEND = "vllm_lite.body_send"
SERVER_SEND = "vllm_lite.server_send"


class ServerSend:
    """The app as the HTTP server runs it: each HTTP request's scope carries the server's own
    `send` (`SERVER_SEND`), for the request gate."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await self.app(scope, receive, send)


class RequestGate:
    def __init__(self, app: ASGIApp, options: ServerOptions, drain: ShutdownDrain) -> None:
        self.app = app
        self.options = options
        self.drain = drain
        keys = [options.api_key] if isinstance(options.api_key, str) else list(options.api_key or ())
        self._keys = [key.encode() for key in keys if key]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = route_path(scope), scope["method"]
        if path not in UNAUTHENTICATED_PATHS and method != "OPTIONS" and not self._authorized(scope):
            await _send_error(send, path, 401, "AuthenticationError", "Incorrect API key provided.", "api_key")
            return
        if self.drain.stopping and path not in UNAUTHENTICATED_PATHS:
            await _send_error(send, path, 503, "ServiceUnavailableError", "the server is shutting down")
            return
        if method in _BODY_METHODS:
            body = await self._read_body(scope, receive, send)
            if body is None:
                return
            receive = _replay(body, receive)
        await self._call_app(scope, receive, send)

    async def _call_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        request_id = _request_id(scope) if self.options.enable_request_id_headers else None

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if request_id is not None:
                    message = _with_request_id(message, request_id)
            await send(message)

        scope[BODY_SEND] = send if self.options.middleware else scope.get(SERVER_SEND, send)
        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("unexpected error while handling %s %s", scope["method"], scope["path"])
            if not started:  # else the client sees the response end early
                await _send_error(send, route_path(scope), 500, "InternalServerError", f"{type(exc).__name__}: {exc}")

    def _authorized(self, scope: Scope) -> bool:
        """`Authorization: Bearer <key>` (OpenAI's, vLLM's), or `x-api-key: <key>` (what
        Anthropic's clients send given an API key)."""
        if not self._keys:
            return True
        headers = dict(scope["headers"])  # (a repeated header: its last value)
        bearer, api_key = headers.get(b"authorization"), headers.get(b"x-api-key")
        if bearer is not None:
            if not bearer.startswith(b"Bearer "):
                return False
            given = bearer[len(b"Bearer "):]
        elif api_key is not None:
            given = api_key
        else:
            return False
        # Every key is compared (a list, not a short-circuit): the time taken says nothing of which.
        return any([secrets.compare_digest(given, key) for key in self._keys])

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None after answering 413 (as soon as the declared or received
        size passes the limit, without reading the rest)."""
        limit = self.options.max_request_body_bytes
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_too_large(send, route_path(scope), limit)
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_too_large(send, route_path(scope), limit)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _request_id(scope: Scope) -> bytes:
    given = next((value for name, value in scope["headers"] if name == b"x-request-id"), None)
    return given or uuid.uuid4().hex.encode()


def _with_request_id(start: Message, request_id: bytes) -> Message:
    """The response start with exactly one X-Request-Id (any set by a route is replaced)."""
    headers = [(name, value) for name, value in start.get("headers", []) if name.lower() != b"x-request-id"]
    return {**start, "headers": [*headers, (b"x-request-id", request_id)]}


def route_path(scope: Scope) -> str:
    """The path the routes see: without --root-path's prefix when the request carries it
    (Starlette's rule), so /llm/health is /health."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("/", ""):
        return path[len(root):] or "/"
    return path


def _replay(body: bytes, receive: Receive) -> Callable[[], Any]:
    """A `receive` that hands the buffered body over once, then defers to the connection (whose
    next message is the client's disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_too_large(send: Send, path: str, limit: int) -> None:
    await _send_error(send, path, 413, "RequestEntityTooLargeError",
                      f"the request body is larger than {limit} bytes (--max-request-body-bytes)", "body")


async def _send_error(send: Send, path: str, status_code: int, err_type: str, message: str,
                      param: str | None = None) -> None:
    payload = json.dumps(route_error_body(path, status_code, err_type, message, param)).encode()
    await send({"type": "http.response.start", "status": status_code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
