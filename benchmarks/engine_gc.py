"""Garbage collection in the engine-core process during steady-state decode.

A client spawns an engine core (EngineCoreProc, which calls gc.freeze() after start-up), sends
N requests that decode for a long time, waits until every request is past its prefill, then
measures a window of decode steps inside the engine-core process through its `get_stats`
utility (step counter, gc.get_stats() collections per generation, gc.get_count()):

* collections: automatic gen-0 / gen-1 / gen-2 collections in the window;
* gc allocs/step: GC-tracked container objects allocated per step, net of those freed before
  the collector ran. CPython 3.11 collects when the gen-0 counter (+1 per container allocated,
  -1 per container freed while positive) passes its threshold, so over a window this is
  `collections * (threshold0 + 1) + delta(gen-0 counter)`: the collector's workload, which per
  step must not grow with the number of requests.

The model is a tiny random Llama built into benchmarks/results/ (nothing is written elsewhere;
the engine's ipc socket lives in a private temporary directory removed at shutdown).

    python benchmarks/engine_gc.py [--requests 256,64,1024] [--steps 1000] [--no-lockstep]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_lite.config import EngineArgs
from vllm_lite.engine.core_client import SyncMPClient
from vllm_lite.wire import EngineCoreRequest
from vllm_lite.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"
# Prompt lengths 8 .. 23: requests cross KV-block boundaries (16 tokens) on different steps, as
# in real traffic. The last run is the worst case, lockstep: every request gets its next block in
# the same step.
PROMPT_LEN, BLOCK_SIZE = 8, 16
WARMUP_TOKENS = 16  # every request has decoded this many tokens before the window opens


def max_tokens_for(num_steps: int) -> int:
    """Past the window with room to spare: the engine runs ahead of the client a little, and
    no request may finish inside the window."""
    return WARMUP_TOKENS + num_steps + num_steps // 2 + 64


@dataclass(frozen=True, slots=True)
class GCReport:
    num_requests: int
    lockstep: bool
    steps: int
    gen0: int
    gen1: int
    gen2: int
    allocs_per_step: float  # net: gen-0's count also falls as tracked objects are freed
    steps_per_s: float


def build_model(out_dir: Path, max_len: int) -> Path:
    """A 2-layer random Llama (no tokenizer: the engine core only sees token ids)."""
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                         eos_token_id=2, bos_token_id=0, dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def start_engine(model_dir: Path, num_requests: int, num_steps: int) -> SyncMPClient:
    max_len = PROMPT_LEN + BLOCK_SIZE + max_tokens_for(num_steps)
    blocks_per_request = -(-max_len // BLOCK_SIZE)
    args = EngineArgs(model=str(model_dir), max_model_len=max_len, block_size=BLOCK_SIZE,
                      max_num_seqs=num_requests, num_kv_blocks=num_requests * blocks_per_request + 1,
                      max_num_batched_tokens=max(2048, num_requests * (PROMPT_LEN + BLOCK_SIZE)), device="cpu")
    return SyncMPClient(args.create_engine_config())


def add_requests(client: SyncMPClient, num_requests: int, max_tokens: int, lockstep: bool) -> list[str]:
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request_ids = [f"gc-{i}" for i in range(num_requests)]
    for i, request_id in enumerate(request_ids):
        length = PROMPT_LEN if lockstep else PROMPT_LEN + i % BLOCK_SIZE
        prompt = rng.integers(3, 1000, length, dtype=np.int32)
        client.add_request(EngineCoreRequest(request_id, prompt, params, (), time.time(), max_tokens))
    return request_ids


def decode_until(client: SyncMPClient, counts: dict[str, int], min_tokens: int) -> None:
    """Read step outputs until every request has at least `min_tokens` tokens."""
    while min(counts.values()) < min_tokens:
        outputs = client.get_output()
        for request_id in outputs.req_ids:
            counts[request_id] += 1


def measure(model_dir: Path, num_requests: int, num_steps: int, lockstep: bool = False) -> GCReport:
    client = start_engine(model_dir, num_requests, num_steps)
    try:
        request_ids = add_requests(client, num_requests, max_tokens_for(num_steps), lockstep)
        counts = dict.fromkeys(request_ids, 0)
        decode_until(client, counts, WARMUP_TOKENS)
        before, start = client.get_stats(), time.perf_counter()
        after = run_window(client, counts, before, num_steps)
        elapsed = time.perf_counter() - start
        client.abort_requests(request_ids)
        return window_report(num_requests, before, after, elapsed, lockstep)
    finally:
        client.shutdown()


def run_window(client: SyncMPClient, counts: dict[str, int], before: dict[str, Any],
               num_steps: int) -> dict[str, Any]:
    """Decode until the engine core has stepped `num_steps` times since `before` (it runs a
    little ahead of what this client has read); returns the stats at the end."""
    target, remaining = min(counts.values()), num_steps
    while True:
        target += remaining
        decode_until(client, counts, target)
        after = client.get_stats()
        remaining = num_steps - (after["num_steps"] - before["num_steps"])
        if remaining <= 0:
            return after


def window_report(num_requests: int, before: dict[str, Any], after: dict[str, Any], elapsed_s: float,
                  lockstep: bool = False) -> GCReport:
    steps = after["num_steps"] - before["num_steps"]
    gen0, gen1, gen2 = (a - b for a, b in zip(after["gc_collections"], before["gc_collections"]))
    allocs = (gen0 + gen1 + gen2) * (after["gc_threshold"][0] + 1) + after["gc_count"][0] - before["gc_count"][0]
    return GCReport(num_requests, lockstep, steps, gen0, gen1, gen2, allocs / max(steps, 1), steps / elapsed_s)


def print_table(reports: list[GCReport]) -> None:
    header = f"{'requests':>8} {'prompts':>8} {'steps':>6} {'gen0':>6} {'gen1':>5} {'gen2':>5} " \
             f"{'gen0/1k steps':>13} {'gc allocs/step':>14} {'steps/s':>8}"
    print(header)
    print("-" * len(header))
    for r in reports:
        print(f"{r.num_requests:>8} {'lockstep' if r.lockstep else 'spread':>8} {r.steps:>6} {r.gen0:>6} "
              f"{r.gen1:>5} {r.gen2:>5} "
              f"{1000 * r.gen0 / max(r.steps, 1):>13.1f} {r.allocs_per_step:>14.1f} {r.steps_per_s:>8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", default="256,64,1024", help="concurrent request counts, comma-separated")
    parser.add_argument("--steps", type=int, default=1000, help="decode steps in each measured window")
    parser.add_argument("--no-lockstep", action="store_true", help="skip the lockstep run at the largest count")
    args = parser.parse_args()
    counts = [int(n) for n in args.requests.split(",") if n]
    max_len = PROMPT_LEN + BLOCK_SIZE + max_tokens_for(args.steps)
    model_dir = build_model(RESULTS / "engine_gc_model", max_len=max(2048, max_len))
    reports = [measure(model_dir, n, args.steps) for n in counts]
    if not args.no_lockstep:
        reports.append(measure(model_dir, max(counts), args.steps, lockstep=True))
    (RESULTS / "engine_gc.json").write_text(json.dumps([asdict(r) for r in reports], indent=2) + "\n")
    print_table(reports)
    base = min(reports, key=lambda r: r.num_requests)
    for r in reports:
        if r is base:
            continue
        print(f"gc allocs/step at {r.num_requests} ({'lockstep' if r.lockstep else 'spread'}) vs "
              f"{base.num_requests}: {r.allocs_per_step:.2f} vs {base.allocs_per_step:.2f}")


if __name__ == "__main__":
    main()
