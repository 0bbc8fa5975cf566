"""vLLM's development and RL routes (VLLM_SERVER_DEV_MODE=1), as an RL trainer drives a live
server around a weight update: /pause, /collective_rpc (a `--worker-extension-cls` method loading
the trainer's checkpoint), /reset_prefix_cache, /resume, then completions of the new weights;
/sleep and /wake_up (level 1 releases the KV cache, level 2 the weights too), /is_sleeping, /is_paused, /abort_requests,
/get_world_size. Bad arguments are a 400 naming them; without dev mode the routes do not exist."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine
from live_server import LONG_GENERATION, LiveServer, running_long_server

from hf_reference import build_tiny_model, hf_greedy
from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.entrypoints.openai.server_state import ServerOptions

MODEL = "tiny"
API_KEY = "sk-control"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [5, 6, 7, 8, 9]
ROUTES = (("POST", "/collective_rpc"), ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
          ("POST", "/release_kv_cache_memory"),
          ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/abort_requests"),
          ("GET", "/get_world_size"), ("POST", "/update_weight_version"), ("GET", "/weight_info"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("trained"), "llama", tie_word_embeddings=False, seed=5)


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_SERVER_DEV_MODE", "1")
        # (room for a reply still running when the control routes end it, whatever the CPU's speed)
        with running_long_server(tiny_llama, tmp_path_factory.mktemp("control") / "server.log", MODEL, API_KEY,
                                 ("--worker-extension-cls", "tests.worker_extensions.WeightSync")) as live:
            yield live


def completion_ids(client: httpx.Client, max_tokens: int = 8) -> list[int]:
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
                                                    "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_a_trainers_weight_update_over_http(server: LiveServer, tiny_llama: Path, trained: Path) -> None:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        assert completion_ids(client) == hf_greedy(tiny_llama, [PROMPT], 8)[0]
        assert client.post("/pause").json() == {"status": "paused"}
        assert client.get("/is_paused").json() == {"is_paused": True}
        loaded = client.post("/collective_rpc", json={"method": "load_checkpoint",
                                                      "args": [str(trained / "model.safetensors")]})
        assert loaded.json() == {"results": ["15"]}  # (vLLM renders a result that is no dict or list as its str)
        assert client.post("/reset_prefix_cache").json() == {"success": True}
        assert client.post("/resume").json() == {"status": "resumed"}
        assert client.get("/is_paused").json() == {"is_paused": False}
        assert completion_ids(client) == hf_greedy(trained, [PROMPT], 8)[0]
        ranks = client.post("/collective_rpc", json={"method": "rank_and_device"}).json()
        assert ranks == {"results": [{"rank": 0, "local_rank": 0, "device": "cpu"}]}
        assert client.get("/get_world_size").json() == {"world_size": 1}
        assert client.get("/weight_info").json() == {"weight_version": "default"}
        updated = client.post("/update_weight_version", json={"new_version": "trained-1"})
        assert updated.json() == {"success": True, "new_version": "trained-1"}
        assert client.get("/weight_info").json() == {"weight_version": "trained-1"}
        assert client.post("/update_weight_version", json={"new_version": ""}).status_code == 400


def test_a_level_2_sleep_and_a_trainers_checkpoint_over_http(server: LiveServer, tiny_llama: Path,
                                                             trained: Path) -> None:
    """The colocated cycle over HTTP: /sleep?level=2 lets the weights go, /wake_up?tags=weights
    brings them back empty, waking the rest before they are loaded is a 400, then the trainer's
    checkpoint loads and the server answers with its tokens (the original's again after)."""
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        for checkpoint in (trained, tiny_llama):
            assert client.post("/sleep", params={"level": 2}).json() == {"status": "sleeping", "level": 2}
            assert client.post("/collective_rpc", json={"method": "weight_elements"}).json() == {"results": ["0"]}
            assert client.post("/wake_up", params={"tags": "weights"}).json() == {"status": "sleeping",
                                                                                 "tags": ["weights"]}
            early = client.post("/wake_up")
            assert early.status_code == 400
            assert "have not been loaded whole since wake_up" in early.json()["error"]["message"]
            loaded = client.post("/collective_rpc", json={"method": "load_checkpoint",
                                                          "args": [str(checkpoint / "model.safetensors")]})
            assert loaded.status_code == 200
            assert client.post("/wake_up").json() == {"status": "awake", "tags": None}
            assert completion_ids(client) == hf_greedy(checkpoint, [PROMPT], 8)[0]


def test_sleep_wake_up_and_refusals_over_http(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        before = completion_ids(client)
        assert client.post("/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1}
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        layers = client.post("/collective_rpc", json={"method": "kv_cache_layers"}).json()
        assert layers == {"results": ["0"]}  # (vLLM's rendering: a result that is no dict or list is its str)
        waking = client.post("/wake_up", params={"tags": "scheduling"}).json()
        assert waking == {"status": "sleeping", "tags": ["scheduling"]}
        assert client.post("/wake_up").json() == {"status": "awake", "tags": None}
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        assert completion_ids(client) == before
        assert client.post("/release_kv_cache_memory").status_code == 400  # (no completed pause)
        assert client.post("/sleep", params={"level": 0}).json() == {"status": "sleeping", "level": 0}
        assert client.post("/release_kv_cache_memory").json() == {"status": "kv_cache_released"}
        assert client.post("/collective_rpc", json={"method": "kv_cache_layers"}).json() == {"results": ["0"]}
        assert client.post("/wake_up", params={"tags": "kv_cache"}).json() == {"status": "awake", "tags": ["kv_cache"]}
        refusals = {
            "level=3": client.post("/sleep", params={"level": 3}),
            "mode": client.post("/pause", params={"mode": "later"}),
            "tags": client.post("/wake_up", params={"tags": "gpu"}),
            "method": client.post("/collective_rpc", json={"method": "no_such_method"}),
            "private": client.post("/collective_rpc", json={"method": "_reply"}),
            "field": client.post("/collective_rpc", json={"method": "rank_and_device", "unknown": 1}),
            "args": client.post("/collective_rpc", json={"method": "fail", "args": [3]}),
            "timeout": client.post("/collective_rpc", json={"method": "sleep_for", "args": ["2"], "timeout": 0.2}),
        }
        messages = {name: (response.status_code, response.json()["error"]["message"])
                    for name, response in refusals.items()}
        assert messages["level=3"][0] == 400 and "sleep level must be 0, 1 or 2" in messages["level=3"][1]
        assert messages["mode"][0] == 400 and "pause mode must be one of" in messages["mode"][1]
        assert messages["tags"][0] == 400 and "wake_up tags must be among" in messages["tags"][1]
        assert messages["method"][0] == 400 and "has no method 'no_such_method'" in messages["method"][1]
        assert messages["private"][0] == 400 and "is not a worker method" in messages["private"][1]
        assert messages["field"][0] == 400 and "unknown" in messages["field"][1]
        assert messages["args"][0] == 400 and "args" in messages["args"][1]
        assert messages["timeout"][0] == 504, messages["timeout"]
        assert completion_ids(client) == before


def wait_until_running(client: httpx.Client) -> None:
    deadline = time.monotonic() + 30
    while f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 1.0' not in client.get("/metrics").text:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.01)


def test_pause_abort_and_abort_requests_end_streams_in_flight(server: LiveServer) -> None:
    def stream(client: httpx.Client, finish: list[Any]) -> None:
        with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                            "max_tokens": LONG_GENERATION, "ignore_eos": True,
                                                            "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    reason = httpx.Response(200, content=line[6:]).json()["choices"][0]["finish_reason"]
                    if reason is not None:
                        finish.append(reason)

    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        for end in (lambda: client.post("/pause", params={"mode": "abort"}),
                    lambda: client.post("/abort_requests", json={})):
            finish: list[Any] = []
            thread = threading.Thread(target=stream, args=(client, finish))
            thread.start()
            wait_until_running(client)
            ended = end()
            thread.join(30)
            assert ended.status_code == 200 and finish == ["abort"]
            client.post("/resume")
        assert client.post("/abort_requests", json={"request_ids": ["nobody"]}).json() == {"status": "aborted",
                                                                                          "aborted": 1}


def test_without_dev_mode_there_are_no_control_routes(tokenizer: Any) -> None:
    async def go() -> list[int]:
        app = build_app(FakeEngine(tokenizer, max_model_len=64), [MODEL], options=ServerOptions(api_key=API_KEY))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     headers=AUTH) as client:
            return [(await client.request(method, path)).status_code for method, path in ROUTES]

    assert asyncio.run(go()) == [404] * len(ROUTES)
