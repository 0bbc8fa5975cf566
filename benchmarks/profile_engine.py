"""In-process EngineCore on the demo model with the throughput workload (benchmarks/
throughput_demo.py's requests), cProfile over the engine steps: where the engine core's time goes,
op by op (tottime), without the client process and IPC.

    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=2 python benchmarks/profile_engine.py [PRECISION] [NUM_REQUESTS]

PRECISION: float32, bfloat16, or either with `+int8` (quantization="int8").

Set the OpenMP variables yourself: an in-process engine keeps what its process started with.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import numpy as np
import torch
from benchlib import demo_model, random_workload

from vllm_lite.config import EngineArgs
from vllm_lite.engine.core import EngineCore
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.wire import EngineCoreRequest


def main(precision: str = "float32", num_requests: int = 32) -> None:
    dtype, _, quantization = precision.partition("+")
    torch.set_num_threads(2)
    workload = random_workload(num_requests, (64, 512), (64, 256), vocab_size=49152)
    # Async scheduling would run the model on the step thread, where cProfile does not look.
    args = EngineArgs(model=str(demo_model()), dtype=dtype, max_model_len=768, max_num_seqs=256,
                      max_num_batched_tokens=2048, kv_cache_memory_bytes=2 * 1024**3, device="cpu",
                      async_scheduling=False, quantization=quantization or None)
    core = EngineCore(args.create_engine_config())
    for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.max_tokens)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        core.add_request(EngineCoreRequest(f"p{i}", np.asarray(prompt, dtype=np.int32), params, (),
                                           time.time(), max_tokens))
    profile = cProfile.Profile()
    start, steps = time.perf_counter(), 0
    profile.enable()
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    profile.disable()
    elapsed = time.perf_counter() - start
    print(f"{precision} n={num_requests}: {steps} steps, {elapsed:.1f}s, {sum(workload.max_tokens) / elapsed:.1f} tok/s")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "float32", int(sys.argv[2]) if len(sys.argv) > 2 else 32)
