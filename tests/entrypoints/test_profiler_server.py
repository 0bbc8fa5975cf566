"""`vllm-lite serve --profiler-config`: vLLM's /start_profile and /stop_profile (one session at a
time: a second start is a 409), the engine core's and the API server's traces written into the
folder; without the flag the routes do not exist, as in vLLM."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fake_engine import FakeEngine
from live_server import LiveServer, running_server

from test_profiling import RANK0, trace_events
from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.entrypoints.openai.server_state import ServerOptions
from vllm_lite.worker.profiler import STEP_EVENT

MODEL = "tiny"
API_KEY = "sk-profile"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def server(tiny_llama: Path, traces: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = {"profiler": "torch", "torch_profiler_dir": str(traces), "torch_profiler_with_stack": False}
    with running_server(tiny_llama, tmp_path_factory.mktemp("profile") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "128", "--profiler-config", json.dumps(config))) as live:
        yield live


def test_a_profiled_session_writes_the_engines_and_the_servers_traces(server: LiveServer, traces: Path) -> None:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        started = client.post("/start_profile", json={"profile_prefix": "srv"})
        again = client.post("/start_profile")
        completion = client.post("/v1/completions", json={"model": MODEL, "prompt": "the cat", "max_tokens": 6,
                                                          "ignore_eos": True})
        stopped = client.post("/stop_profile")
        unknown = client.post("/start_profile", json={"profile_prefix": "x", "record": True})
        bad_prefix = client.post("/start_profile", json={"profile_prefix": "../up"})
    assert (started.status_code, started.text) == (200, "")
    assert again.status_code == 409 and "A profiling session is already active" in again.json()["error"]["message"]
    assert completion.status_code == 200 and stopped.status_code == 200
    assert unknown.status_code == 400 and "record" in unknown.json()["error"]["message"]
    assert bad_prefix.status_code == 400 and "profile_prefix" in bad_prefix.json()["error"]["message"]
    assert trace_events(traces, f"srv_{RANK0}").count(STEP_EVENT) >= 6
    assert len(list(traces.glob("srv_*.async_llm.*.pt.trace.json.gz"))) == 1
    assert (traces / f"srv_{RANK0}.profiler_out.txt").is_file()


def test_without_profiler_config_there_are_no_profiler_routes(tokenizer) -> None:
    import asyncio

    async def go() -> list[int]:
        app = build_app(FakeEngine(tokenizer, max_model_len=64), [MODEL], options=ServerOptions(api_key=API_KEY))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     headers=AUTH) as client:
            return [(await client.post(path)).status_code for path in ("/start_profile", "/stop_profile")]

    assert asyncio.run(go()) == [404, 404]
