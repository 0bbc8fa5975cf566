"""The API server's client side of one engine step, alone: 1,024 (or N) streaming requests
(delta outputs, a stream interval, no stop strings), a synthetic step's tokens through
`OutputProcessor.process_outputs` with the step's metrics on (as `vllm-lite serve` runs it), each
returned state's `make_output`, and `ServerMetrics.record_iteration`. Prints the best of three
rounds of the mean CPU time per step (100 steps after 20 of warm-up). No engine, no HTTP.

    python benchmarks/client_stream_step.py [--streams 1024] [--stream-interval 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from benchlib import RESULTS_DIR, tiny_llama

from vllm_lite.engine.output_processor import OutputProcessor
from vllm_lite.engine.stats import IterationStats
from vllm_lite.engine.tokenizer import load_tokenizer
from vllm_lite.entrypoints.openai.metrics import ServerMetrics
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams
from vllm_lite.wire import EngineCoreOutputs

STEPS, WARMUP, ROUNDS = 120, 20, 3
STEP_SECONDS = 0.04  # the engine-core timestamps' spacing (only the latencies' values depend on it)


def seconds_per_step(tokenizer, num_streams: int, stream_interval: int, rng: np.random.Generator) -> float:
    processor = OutputProcessor(tokenizer, stream_interval)
    metrics = ServerMetrics("tiny", 256)
    request_ids = [f"r{i}" for i in range(num_streams)]
    for request_id in request_ids:
        processor.add_request(request_id, None, [1, 2, 3], SamplingParams(
            max_tokens=STEPS + 1, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
    total = 0.0
    for step in range(STEPS):
        outputs = EngineCoreOutputs(request_ids, rng.integers(300, 8000, size=num_streams).astype(np.int32), [],
                                    timestamp=100.0 + STEP_SECONDS * step)
        start = time.process_time()
        stats = IterationStats()
        states, _ = processor.process_outputs(outputs, stats)
        for state in states:
            state.make_output()
        metrics.record_iteration(stats)
        if step >= WARMUP:
            total += time.process_time() - start
    return total / (STEPS - WARMUP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1024)
    parser.add_argument("--stream-interval", type=int, default=1)
    args = parser.parse_args()
    tokenizer = load_tokenizer(str(tiny_llama(RESULTS_DIR / "tiny_llama_h128_l2_v8192_t8192", truncate_tokenizer=True)))
    rng = np.random.default_rng(0)
    best = min(seconds_per_step(tokenizer, args.streams, args.stream_interval, rng) for _ in range(ROUNDS))
    print(f"{args.streams} streams, stream interval {args.stream_interval}: {best * 1e3:.2f} ms of CPU per step "
          f"({best / args.streams * 1e6:.2f} us per stream)")


if __name__ == "__main__":
    main()
