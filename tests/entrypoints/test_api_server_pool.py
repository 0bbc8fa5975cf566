"""`vllm-lite serve --api-server-count 2` as a live process tree: two API servers listening on
one port, one engine core; /metrics sums the pool; SIGTERM drains every server and reaps every
process; the death of any process ends the pool with exit status 1 (vLLM's
test_multi_api_server_shutdown and its multi-API-server mode are the reference)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import REPO_ROOT, LiveServer, free_port, running_server, started_children

MODEL = "tiny-pool"
API_KEY = "sk-pool"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
POOL_ARGS = ("--api-server-count", "2", "--max-model-len", "256")


def listening_pids(port: int) -> set[int]:
    """Processes holding a listening TCP socket on `port` (from /proc/net/tcp and /proc/*/fd)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                inodes.add(f"socket:[{fields[9]}]")
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def pool_processes(server: LiveServer) -> tuple[set[int], set[int]]:
    """(API server pids, engine core pids) among the server's spawned children."""
    spawned = started_children(server.proc.pid, server.children)
    api_servers = spawned & listening_pids(server.port)
    return api_servers, spawned - api_servers


def wait_all_listening(server: LiveServer, count: int = 2, timeout_s: float = 120.0) -> None:
    """/health answers once one server is up; the other may still be loading its tokenizer."""
    deadline = time.monotonic() + timeout_s
    while len(pool_processes(server)[0]) < count:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)


@pytest.fixture
def pool(tiny_llama: Path, tmp_path: Path) -> Iterator[LiveServer]:
    with running_server(tiny_llama, tmp_path / "server.log", MODEL, API_KEY, POOL_ARGS) as live:
        wait_all_listening(live)
        yield live


def _complete_on_fresh_connections(server: LiveServer, count: int, max_tokens: int) -> list[httpx.Response]:
    """`count` concurrent completions, each on its own connection (the kernel spreads new
    connections over the servers' SO_REUSEPORT sockets)."""
    async def one(index: int) -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as http:
            return await http.post("/v1/completions", json={
                "model": MODEL, "prompt": [5 + index, 6, 7], "max_tokens": max_tokens, "ignore_eos": True})

    async def all_of_them() -> list[httpx.Response]:
        return list(await asyncio.gather(*(one(i) for i in range(count))))

    return asyncio.run(all_of_them())


def _metric(text: str, name: str) -> float:
    return sum(float(value) for value in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


def test_two_servers_one_engine_metrics_summed_then_sigterm_drains_and_reaps(pool: LiveServer) -> None:
    """One pool for both halves (a pool takes ~10 s to start): the servers share an engine and its
    metrics; then SIGTERM drains both and the pool exits."""
    _check_one_engine_and_pooled_metrics(pool)
    _check_sigterm_drains_every_server_then_reaps_the_pool(pool)


def _check_one_engine_and_pooled_metrics(pool: LiveServer) -> None:
    api_servers, engine_cores = pool_processes(pool)
    assert len(api_servers) == 2 and len(engine_cores) == 1, (api_servers, engine_cores)
    responses = _complete_on_fresh_connections(pool, count=16, max_tokens=3)
    assert [r.status_code for r in responses] == [200] * 16
    prompt_tokens = sum(r.json()["usage"]["prompt_tokens"] for r in responses)
    # Every scrape, whichever server answers it, counts all 16 requests: 16 connections land on
    # one server of two with probability 2**-15, so a per-server count would show here.
    for _ in range(6):
        text = httpx.get(f"{pool.base_url}/metrics", headers=AUTH, timeout=30).text
        assert _metric(text, "vllm:request_success_total") == 16
        assert _metric(text, "vllm:generation_tokens_total") == 48
        assert _metric(text, "vllm:prompt_tokens_total") == prompt_tokens
        assert _metric(text, "vllm:e2e_request_latency_seconds_count") == 16
        assert len(re.findall(r"^vllm:cache_config_info\{", text, re.M)) == 1
        assert _metric(text, "vllm:num_requests_running") == 0


def _check_sigterm_drains_every_server_then_reaps_the_pool(pool: LiveServer) -> None:
    """vLLM's test_multi_api_server_shutdown: streams in flight when the supervisor gets
    SIGTERM run to their end (all their tokens); a new request is refused; the pool exits 0 and
    leaves no process behind."""
    max_tokens = 250

    async def scenario() -> tuple[list[int], str]:
        started = asyncio.Event()
        first_chunks = 0

        async def one(index: int) -> int:
            nonlocal first_chunks
            body = {"model": MODEL, "prompt": [5 + index, 6], "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": True}
            tokens = 0
            async with httpx.AsyncClient(base_url=pool.base_url, headers=AUTH, timeout=120) as http:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            tokens += 1
                            if tokens == 1:
                                first_chunks += 1
                                if first_chunks == 8:
                                    started.set()
            return tokens

        tasks = [asyncio.ensure_future(one(i)) for i in range(8)]
        await asyncio.wait_for(started.wait(), 60)
        pool.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        try:
            async with httpx.AsyncClient(base_url=pool.base_url, headers=AUTH, timeout=10) as http:
                refused = str((await http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})).status_code)
        except httpx.TransportError:
            refused = "connection refused"
        return list(await asyncio.gather(*tasks)), refused

    chunks, refused = asyncio.run(scenario())
    assert chunks == [max_tokens] * 8  # one chunk per token; none cut short
    assert refused in ("503", "connection refused"), refused
    assert pool.proc.wait(60) == 0, pool.log()
    assert pool.leftover_processes() == set()


@pytest.mark.parametrize("victim", ["engine core", "API server"])
def test_any_death_ends_the_pool_with_status_1(pool: LiveServer, victim: str) -> None:
    api_servers, engine_cores = pool_processes(pool)
    os.kill(min(engine_cores if victim == "engine core" else api_servers), signal.SIGKILL)
    assert pool.proc.wait(60) == 1, pool.log()
    assert "stopping the API server pool" in pool.log()
    assert pool.leftover_processes() == set()


def test_bad_count_and_taken_port_are_refused_at_start(tiny_llama: Path) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve", str(tiny_llama), *args],
                              capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})

    result = serve("--api-server-count", "0")
    assert result.returncode == 2 and "--api-server-count must be >= 1, got 0" in result.stderr
    port = free_port()
    with subprocess.Popen([sys.executable, "-c", "import socket, sys, time; s = socket.socket(); "
                           f"s.bind(('127.0.0.1', {port})); s.listen(); print('ok', flush=True); time.sleep(60)"],
                          stdout=subprocess.PIPE) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == b"ok"
            result = serve("--api-server-count", "2", "--port", str(port))
        finally:
            holder.kill()
    assert result.returncode == 2 and f"--port {port}: cannot listen there" in result.stderr, result.stderr
