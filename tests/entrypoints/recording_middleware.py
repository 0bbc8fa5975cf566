"""An ASGI middleware that records every message a response sends through it, importable by
path for --middleware (tests/entrypoints/test_api_server_app.py)."""

from __future__ import annotations

from typing import Any


class Recorder:
    messages: list[dict[str, Any]] = []  # every instance's, in order (the tests clear it)

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def recording(message: Any) -> None:
            Recorder.messages.append(message)
            await send(message)
        await self.app(scope, receive, recording if scope["type"] == "http" else send)
