"""Issue 12 against a live `vllm-lite serve` subprocess: a huge prompt does not stall /health
(finding 6), and SIGTERM drains, then ends what is left with errors and exits (finding 9).
Engine death -> exit status 1 (finding 8) is the last test of test_openai_server.py."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer, running_server

MODEL = "tiny-qwen3"
API_KEY = "sk-lifecycle"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_qwen3, tmp_path_factory.mktemp("lifecycle") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "512", "--shutdown-timeout", "0.25")) as live:
        yield live


def test_huge_prompts_do_not_stall_health(server: LiveServer) -> None:
    """A 10 MB body is refused (413) before it is read; 3 MB completion prompts and chat messages
    are refused (400) before they are tokenized; a 2 MB text sent to /tokenize is tokenized off
    the event loop, so /health, sent while it runs, is answered first."""
    async def scenario() -> list[str]:
        order: list[str] = []
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as http:
            async def completion() -> None:
                response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 10_000_000})
                assert response.status_code == 413 and response.json()["error"]["param"] == "body"
                response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 3_000_000})
                assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
                messages = [{"role": "user", "content": "x" * 3_000_000}]
                response = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
                assert response.status_code == 400 and response.json()["error"]["param"] == "messages"

            async def tokenize() -> None:
                response = await http.post("/tokenize", json={"model": MODEL, "prompt": "river mountain " * 140_000})
                assert response.status_code == 200 and response.json()["count"] > 100_000
                order.append("tokenize")

            async def health() -> None:
                await asyncio.sleep(0.3)  # the tokenization has begun
                assert (await http.get("/health")).status_code == 200
                order.append("health")

            await asyncio.gather(completion(), tokenize(), health())
        return order

    assert asyncio.run(scenario()) == ["health", "tokenize"]


def test_sigterm_drains_then_ends_streams_with_an_error_and_done(server: LiveServer) -> None:
    """With --shutdown-timeout 0.25, requests of 500 tokens (~2.5 s here) outlive the drain: the stream gets an
    error event and [DONE], the non-streaming request a 503 body; no new request is served; the
    server exits and leaves no process behind."""
    long_body = {"model": MODEL, "prompt": "The river", "max_tokens": 500, "ignore_eos": True}

    async def scenario() -> tuple[list[str], httpx.Response, str]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as http:
            full = asyncio.ensure_future(http.post("/v1/completions", json=long_body))
            events: list[str] = []
            async with http.stream("POST", "/v1/completions", json={**long_body, "stream": True}) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        if len(events) == 2:
                            server.proc.send_signal(signal.SIGTERM)
                            refused = await _new_request_after_sigterm(server)
            return events, await full, refused

    events, full, refused = asyncio.run(scenario())
    assert refused in ("connection refused", "503"), refused
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "--shutdown-timeout" in error["message"]
    tokens = [json.loads(event)["choices"][0]["text"] for event in events[:-2]]
    assert 2 <= len(tokens) < 500, len(tokens)
    assert full.status_code == 503 and "--shutdown-timeout" in full.json()["error"]["message"]
    # uvicorn re-raises the signal after its graceful shutdown: exit status -SIGTERM.
    assert server.proc.wait(60) in (0, -signal.SIGTERM), server.log()
    assert server.leftover_processes() == set()


async def _new_request_after_sigterm(server: LiveServer) -> str:
    await asyncio.sleep(0.1)  # the signal has been handled
    try:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=30) as fresh:
            response = await fresh.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    except httpx.TransportError:
        return "connection refused"
    return str(response.status_code)
