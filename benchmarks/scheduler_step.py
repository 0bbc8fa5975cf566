"""The scheduler alone: `schedule()` and `update_from_output()` per step over steady decode
(every running request decoding, nothing finishing), with the running part of each step
computed as array code (`Scheduler._schedule_running_at_once`, the default) and by the
per-request loop it stands in for, interleaved in one run. A fake worker samples the rows whose
known tokens are all computed, as the model runner does.

    python benchmarks/scheduler_step.py [--requests 64 256 1024] [--rounds 3] [--no-prefix-caching]

Prints, per request count, the minimum over rounds of each path's mean microseconds per step
(after 20 warm-up steps of 150) and their ratio. No model, no torch threads: pure engine-core
Python and numpy.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from benchlib import print_table

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.core.request import Request
from vllm_lite.core.scheduler import Scheduler
from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.sampling_params import SamplingParams

BLOCK_SIZE = 16
PROMPT_LEN = 32
STEPS, WARMUP = 150, 20


class FakeWorker:
    """The persistent batch's token counts: a row samples when all its known tokens are computed."""

    def __init__(self) -> None:
        self.num_tokens: dict[str, int] = {}

    def execute(self, out: SchedulerOutput, token: int) -> tuple[list[str], np.ndarray, np.ndarray]:
        for new in out.scheduled_new_reqs:
            self.num_tokens[new.req_id] = len(new.token_ids)
        cached = out.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens))
        computed |= {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        req_ids = list(out.num_scheduled_tokens)
        sampled = np.array([computed[r] + n == self.num_tokens[r] for r, n in out.num_scheduled_tokens.items()],
                           dtype=np.int32)
        for req_id, samples in zip(req_ids, sampled.tolist()):
            self.num_tokens[req_id] += samples
        return req_ids, np.full((len(req_ids), 1), token, dtype=np.int32), sampled


def run(num_requests: int, at_once: bool, prefix_caching: bool) -> tuple[float, float]:
    """Mean (schedule, update) microseconds per step over the steady steps."""
    num_blocks = num_requests * (-(-(PROMPT_LEN + STEPS + 1) // BLOCK_SIZE)) + 1
    scheduler = Scheduler(SchedulerConfig(num_requests, 8192, 512, True),
                          CacheConfig(BLOCK_SIZE, num_blocks, None, prefix_caching), num_blocks)
    scheduler.AT_ONCE_MIN_RUNNING = Scheduler.AT_ONCE_MIN_RUNNING if at_once else 1 << 62
    rng = np.random.default_rng(0)
    for i in range(num_requests):
        prompt = rng.integers(10, 8000, size=PROMPT_LEN).astype(np.int32)
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(ignore_eos=True), (2,), 2 * STEPS))
    worker = FakeWorker()
    schedule_s = update_s = 0.0
    for step in range(STEPS):
        start = time.perf_counter()
        out = scheduler.schedule()
        scheduled = time.perf_counter()
        result = worker.execute(out, token=5)
        before_update = time.perf_counter()
        scheduler.update_from_output(out, *result)
        if step >= WARMUP:
            schedule_s += scheduled - start
            update_s += time.perf_counter() - before_update
    steps = STEPS - WARMUP
    return 1e6 * schedule_s / steps, 1e6 * update_s / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-prefix-caching", action="store_true")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    rows = []
    for num_requests in args.requests:
        best = {True: (float("inf"),) * 2, False: (float("inf"),) * 2}
        for _ in range(args.rounds):
            for at_once in (False, True):
                result = run(num_requests, at_once, not args.no_prefix_caching)
                best[at_once] = tuple(map(min, best[at_once], result))
        loop, array = best[False], best[True]
        rows.append((num_requests, loop[0], array[0], f"{loop[0] / array[0]:.2f}x", loop[1], array[1]))
    print(f"prefix caching {'off' if args.no_prefix_caching else 'on'}, block size {BLOCK_SIZE}, "
          f"prompts {PROMPT_LEN} tokens; us per step, min over {args.rounds} rounds")
    print_table(("requests", "schedule (loop)", "schedule (array)", "speed-up", "update (loop)", "update (array)"),
                rows)


if __name__ == "__main__":
    main()
