"""In-process EngineCore on the demo model with the throughput workload (benchmarks/
throughput_demo.py's requests): where the engine core's time goes, without the client process and
IPC. By default cProfile over the engine steps, op by op (tottime); with --steps, the wall time of
every step, summed by kind (steps that prefill, decode steps by batch size), which is how the
workload's time splits between prefill and decode.

    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=2 python benchmarks/profile_engine.py [PRECISION] [NUM_REQUESTS]
        [--steps] [--kv-cache-dtype auto|bfloat16|int8_per_token_head|fp8|fp8_e4m3|fp8_e5m2]

PRECISION: float32, bfloat16, or either with `+int8` (quantization="int8").

Set the OpenMP variables yourself: an in-process engine keeps what its process started with.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import defaultdict

import numpy as np
import torch
from benchlib import demo_model, print_table, random_workload

from vllm_lite.config import EngineArgs
from vllm_lite.engine.core import EngineCore
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.wire import EngineCoreRequest

DECODE_BATCHES = ((1, 16), (17, 48), (49, 64), (65, 256))


def make_core(precision: str, num_requests: int, kv_cache_dtype: str) -> tuple[EngineCore, int]:
    """The engine core with the workload's requests added, and their output tokens in all."""
    dtype, _, quantization = precision.partition("+")
    torch.set_num_threads(2)
    workload = random_workload(num_requests, (64, 512), (64, 256), vocab_size=49152)
    # Async scheduling would run the model on the step thread, where cProfile does not look and a
    # step's wall time would be another step's.
    args = EngineArgs(model=str(demo_model()), dtype=dtype, max_model_len=768, max_num_seqs=256,
                      max_num_batched_tokens=2048, kv_cache_memory_bytes=2 * 1024**3, device="cpu",
                      async_scheduling=False, quantization=quantization or None, kv_cache_dtype=kv_cache_dtype)
    core = EngineCore(args.create_engine_config())
    for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.max_tokens)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        core.add_request(EngineCoreRequest(f"p{i}", np.asarray(prompt, dtype=np.int32), params, (),
                                           time.time(), max_tokens))
    return core, sum(workload.max_tokens)


def step_kind(num_tokens: int, num_requests: int) -> str:
    if num_tokens > num_requests:
        return "prefill (with decodes)"
    low, high = next((lo, hi) for lo, hi in DECODE_BATCHES if num_requests <= hi)
    return f"decode, {low}-{high} requests"


def time_steps(core: EngineCore) -> dict[str, list[float]]:
    """Wall seconds of every step, by kind (from the step's schedule)."""
    schedule = core.scheduler.schedule
    scheduled: list[tuple[int, int]] = []

    def recording_schedule():
        output = schedule()
        scheduled.append((output.total_num_scheduled_tokens, len(output.num_scheduled_tokens)))
        return output

    core.scheduler.schedule = recording_schedule
    steps: dict[str, list[float]] = defaultdict(list)
    while core.has_unfinished_requests():
        start = time.perf_counter()
        core.step()
        elapsed = time.perf_counter() - start
        num_tokens, num_requests = scheduled[-1]
        if num_requests:
            steps[step_kind(num_tokens, num_requests)].append(elapsed)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("precision", nargs="?", default="float32")
    parser.add_argument("num_requests", nargs="?", type=int, default=32)
    parser.add_argument("--steps", action="store_true", help="step times by kind instead of cProfile")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", "bfloat16", "int8_per_token_head", "fp8", "fp8_e4m3", "fp8_e5m2"])
    args = parser.parse_args()
    core, output_tokens = make_core(args.precision, args.num_requests, args.kv_cache_dtype)
    label = f"{args.precision} (KV {args.kv_cache_dtype}) n={args.num_requests}"
    if args.steps:
        start = time.perf_counter()
        steps = time_steps(core)
        elapsed = time.perf_counter() - start
        print(f"{label}: {sum(map(len, steps.values()))} steps, {elapsed:.1f}s, {output_tokens / elapsed:.1f} tok/s")
        print_table(("steps", "count", "total (s)", "ms per step"),
                    [(kind, len(times), sum(times), 1e3 * sum(times) / len(times)) for kind, times in sorted(steps.items())])
        return
    profile = cProfile.Profile()
    start, steps = time.perf_counter(), 0
    profile.enable()
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    profile.disable()
    elapsed = time.perf_counter() - start
    print(f"{label}: {steps} steps, {elapsed:.1f}s, {output_tokens / elapsed:.1f} tok/s")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
