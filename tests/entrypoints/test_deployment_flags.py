"""vLLM server flags that deployment scripts carry: CORS (--allowed-origins / -methods / -headers,
--allow-credentials; vLLM answers every origin by default), --disable-fastapi-docs,
--disable-uvicorn-access-log, and --trust-remote-code (taken; a repository's code is never run).
One live server with all of them; the default CORS answer is checked on a default server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer, running_server

MODEL = "tiny-llama"
API_KEY = "sk-deploy"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
UI = "https://ui.example"


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_llama, tmp_path_factory.mktemp("deploy") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "128", "--allowed-origins", f'["{UI}"]', "--allowed-methods",
                         '["GET", "POST"]', "--allow-credentials", "--disable-fastapi-docs",
                         "--disable-uvicorn-access-log", "--uvicorn-log-level", "info",
                         "--trust-remote-code")) as live:
        yield live


def preflight(server: LiveServer, origin: str) -> httpx.Response:
    return httpx.options(f"{server.base_url}/v1/chat/completions", timeout=10,
                         headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                  "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_answers_the_allowed_origin_only(server: LiveServer) -> None:
    allowed = preflight(server, UI)  # a browser's preflight carries no API key
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["access-control-allow-origin"] == UI
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert preflight(server, "https://elsewhere.example").status_code == 400
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60, headers={**AUTH, "Origin": UI},
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == UI


def test_no_docs_no_access_log_and_remote_code_flag_taken(server: LiveServer) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.base_url}{path}", headers=AUTH, timeout=10).status_code == 404
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60, headers=AUTH,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 200  # served with --trust-remote-code: a native model, no code run
    log = server.log()
    assert "Application startup complete" in log  # uvicorn's info lines are on...
    assert '"POST /v1/completions HTTP/1.1"' not in log  # ...its access lines are not


def test_default_cors_answers_every_origin(tiny_llama: Path, tmp_path: Path) -> None:
    with running_server(tiny_llama, tmp_path / "server.log", MODEL, API_KEY, ("--max-model-len", "128",
                        "--uvicorn-log-level", "info")) as default:
        answer = preflight(default, "https://anywhere.example")
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
        assert httpx.get(f"{default.base_url}/openapi.json", headers=AUTH, timeout=10).status_code == 200
        httpx.post(f"{default.base_url}/v1/completions", timeout=60, headers=AUTH,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert '"POST /v1/completions HTTP/1.1" 200' in default.log()
