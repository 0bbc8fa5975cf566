"""Soak: many short requests through `vllm-lite serve`; RSS of the server and of its engine
core at checkpoints (issue 12, acceptance 3). Pass: RSS growth of each over the last half of the
run under 2 %, and at the end no request running or waiting and every KV block free.

    python benchmarks/soak.py --requests 20000 --concurrency 32 --max-tokens 4

The model is a tiny random-weight Llama (benchlib.tiny_llama) so the run measures the
engine's bookkeeping, not the model; prompts are 8-24 random token ids, outputs ignore EOS.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (RESULTS_DIR, descendant_pids, free_port, print_table, start_server, stop_server,  # noqa: E402
                      tiny_llama, write_results)

MIB = 1024 * 1024


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def engine_core_pid(server_pid: int) -> int:
    """The server's descendant with the largest RSS (the multiprocessing resource tracker is small)."""
    return max(descendant_pids(server_pid), key=rss_mib)


def start_soak_server(model: Path, port: int, log: Path, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve", str(model), "--port", str(port),
               "--max-model-len", "256", *extra]
    return start_server(command, port, log, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout_s=300)


async def soak(base_url: str, model: str, args: argparse.Namespace, server_pid: int) -> list[dict]:
    rng = np.random.default_rng(0)
    checkpoints = sorted(set(args.checkpoints) | {args.requests})
    rows: list[dict] = []
    done = 0
    next_request = 0
    failures = 0
    lock = asyncio.Lock()
    reached = asyncio.Event()
    start = time.monotonic()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done, next_request, failures
        while True:
            async with lock:
                if next_request >= args.requests:
                    return
                next_request += 1
            prompt = rng.integers(100, 8000, int(rng.integers(8, 25))).tolist()
            body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "stream": bool(done % 2)}
            response = await client.post("/v1/completions", json=body)
            failures += response.status_code != 200
            done += 1
            if checkpoints and done >= checkpoints[0]:
                checkpoints.pop(0)
                core = engine_core_pid(server_pid)
                rows.append({"requests": done, "seconds": round(time.monotonic() - start, 1),
                             "server_rss_mib": round(rss_mib(server_pid), 1),
                             "engine_core_rss_mib": round(rss_mib(core), 1), "failures": failures})
                print(rows[-1], flush=True)

    # Idle connections expire before uvicorn closes them (5 s): no keep-alive race reads as a failure.
    limits = httpx.Limits(max_connections=args.concurrency, keepalive_expiry=1.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        metrics = (await client.get("/metrics")).text
    rows.append({"final_metrics": [line for line in metrics.splitlines()
                                   if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                       "vllm:kv_cache_usage_perc"))]})
    return rows


def growth(rows: list[dict], key: str) -> float:
    points = [r for r in rows if key in r]
    half = min(points, key=lambda r: abs(r["requests"] - points[-1]["requests"] / 2))
    return 100.0 * (points[-1][key] - half[key]) / half[key]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--checkpoints", type=int, nargs="*", default=[2_000, 10_000, 20_000])
    parser.add_argument("--server-arg", action="append", default=[], help="extra `serve` flag (repeatable)")
    args = parser.parse_args()
    model = tiny_llama(RESULTS_DIR.parent / "results" / "models" / "soak-llama")
    port = free_port()
    # The server's log stays beside the results: a failed soak is diagnosed from it.
    log = RESULTS_DIR / "soak-server.log"
    server = start_soak_server(model, port, log, args.server_arg)
    try:
        rows = asyncio.run(soak(f"http://127.0.0.1:{port}", str(model), args, server.pid))
    finally:
        stop_server(server)
    points = [r for r in rows if "requests" in r]
    print_table(["requests", "seconds", "server RSS MiB", "engine core RSS MiB", "failures"],
                [[r["requests"], r["seconds"], r["server_rss_mib"], r["engine_core_rss_mib"], r["failures"]]
                 for r in points])
    summary = {"server_growth_last_half_pct": round(growth(rows, "server_rss_mib"), 2),
               "engine_core_growth_last_half_pct": round(growth(rows, "engine_core_rss_mib"), 2),
               "final": rows[-1]["final_metrics"]}
    print(summary)
    write_results("soak", {"args": vars(args), "rows": rows, "summary": summary})
    ok = (abs(summary["server_growth_last_half_pct"]) < 2 and abs(summary["engine_core_growth_last_half_pct"]) < 2
          and all(line.endswith((" 0.0", " 0")) for line in summary["final"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
