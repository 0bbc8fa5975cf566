"""Sampler cost per step for a batch of 256 requests over a 49,152-token vocabulary:
all-greedy vs all-top-p (unseeded and seeded) vs one request with penalties (the rest greedy), side by side.

Besides time, it counts the tensors of the logits' size each path allocates (a
TorchDispatchMode that sees every op): the all-greedy path must make none.

A second table checks that cost does not depend on what it should not (64 rows): top-p on flat
vs peaked logits, and penalties on every row at 256 vs 4,096 tokens of history, in steady decode
(one token appended per row and step, the occurrence counts kept across steps). A third: the
seeded rows' draws per step, a generator per request (the old rule) against draws keyed by seed
and position (sample/seeded_draws.py), at 64 and 1,024 rows.

    python benchmarks/sampler.py [--batch 256] [--vocab 49152] [--iters 20] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_lite.core.scheduler_output import NewRequestData
from vllm_lite.sample.copy_counter import LogitsCopyCounter
from vllm_lite.sample.metadata import SamplingMetadata
from vllm_lite.sample.sampler import Sampler
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.input_batch import InputBatch
from vllm_lite.worker.sampling_inputs import build_sampling_metadata

PROMPT_LEN, OUTPUT_LEN = 128, 64


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    params_for_row: Callable[[int], SamplingParams]


CASES = (
    Case("all-greedy", lambda row: SamplingParams(temperature=0.0)),
    Case("all-top-p (p=0.9, T=1)", lambda row: SamplingParams(temperature=1.0, top_p=0.9)),
    # each request its own seed: the draws keyed by seed and position, one hash over the rows
    Case("all-top-p, seeded", lambda row: SamplingParams(temperature=1.0, top_p=0.9, seed=row)),
    Case("1 req with penalties", lambda row: SamplingParams(
        temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5)
        if row == 0 else SamplingParams(temperature=0.0)),
)


def build_metadata(case: Case, batch_size: int, vocab: int) -> SamplingMetadata:
    rng = np.random.default_rng(0)
    batch = InputBatch(batch_size, PROMPT_LEN + OUTPUT_LEN + 1, 1)
    for row in range(batch_size):
        tokens = rng.integers(0, vocab, PROMPT_LEN + OUTPUT_LEN, dtype=np.int32)
        batch.add_request(NewRequestData(f"r{row}", tokens, PROMPT_LEN, case.params_for_row(row), [], 0))
    rows = np.arange(batch_size)
    return build_sampling_metadata(batch, rows, {}, torch.device("cpu"))


@torch.inference_mode()
def time_case(metadata: SamplingMetadata, logits: torch.Tensor, iters: int) -> list[float]:
    sampler = Sampler()
    times = []
    for i in range(iters + 3):
        fresh = logits.clone()  # the sampler may edit its logits in place
        start = time.perf_counter()
        sampler(fresh, metadata)
        if i >= 3:  # warm-up
            times.append(time.perf_counter() - start)
    return times


@torch.inference_mode()
def count_copies(metadata: SamplingMetadata, logits: torch.Tensor) -> LogitsCopyCounter:
    fresh = logits.clone()
    with LogitsCopyCounter(fresh) as counter:
        Sampler()(fresh, metadata)
    return counter


SCALING_ROWS = 64


def top_p_step_ms(logits_scale: float, vocab: int, iters: int) -> float:
    case = Case("top-p", lambda row: SamplingParams(temperature=1.0, top_p=0.9))
    metadata = build_metadata(case, SCALING_ROWS, vocab)
    logits = torch.randn(SCALING_ROWS, vocab, generator=torch.Generator().manual_seed(1)) * logits_scale
    return statistics.median(time_case(metadata, logits, iters)) * 1e3


@torch.inference_mode()
def penalties_step_ms(history_len: int, vocab: int, iters: int) -> float:
    """Every row penalized; each timed step appends one token per row first (steady decode)."""
    rng = np.random.default_rng(0)
    batch = InputBatch(SCALING_ROWS, history_len + iters + 8, 1)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5)
    for row in range(SCALING_ROWS):
        tokens = rng.integers(0, vocab, history_len, dtype=np.int32)
        batch.add_request(NewRequestData(f"r{row}", tokens, history_len // 2, params, [], 0))
    rows = np.arange(SCALING_ROWS)
    metadata = build_sampling_metadata(batch, rows, {}, torch.device("cpu"))
    logits = torch.randn(SCALING_ROWS, vocab, generator=torch.Generator().manual_seed(2))
    sampler = Sampler()
    times = []
    for i in range(iters + 3):
        batch.token_ids[rows, batch.num_tokens[rows]] = rng.integers(0, vocab, SCALING_ROWS, dtype=np.int32)
        batch.num_tokens[rows] += 1
        fresh = logits.clone()
        start = time.perf_counter()
        sampler(fresh, metadata)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def print_scaling(vocab: int, iters: int) -> None:
    flat, peaked = top_p_step_ms(0.05, vocab, iters), top_p_step_ms(8.0, vocab, iters)
    short, long = penalties_step_ms(256, vocab, iters), penalties_step_ms(4096, vocab, iters)
    print()
    print(f"{SCALING_ROWS} rows x vocab {vocab}      {'median ms':>10}")
    print(f"{'top-p 0.9, flat logits':<30} {flat:>10.2f}")
    print(f"{'top-p 0.9, peaked logits':<30} {peaked:>10.2f}   flat/peaked {flat / peaked:.2f}x (target <= 1.5x)")
    print(f"{'penalties, 256-token history':<30} {short:>10.2f}")
    print(f"{'penalties, 4096-token history':<30} {long:>10.2f}   4096/256 {long / short:.2f}x (target <= 1.2x)")


def seeded_draws_us(num_rows: int, iters: int) -> tuple[float, float]:
    """Microseconds per step for `num_rows` seeded rows' uniforms: one torch.Generator per
    request, a torch.rand call per row (the rule before sample/seeded_draws.py), against the
    position-keyed draws of every row at once."""
    generators = [torch.Generator().manual_seed(row) for row in range(num_rows)]
    batch = InputBatch(num_rows, PROMPT_LEN + iters + 8, 1)
    for row in range(num_rows):
        params = SamplingParams(temperature=1.0, seed=row)
        batch.add_request(NewRequestData(f"r{row}", np.ones(PROMPT_LEN, dtype=np.int32), PROMPT_LEN, params, [], 0))
    seeded = build_sampling_metadata(batch, np.arange(num_rows), {}, torch.device("cpu")).seeded

    def per_generator() -> None:
        uniforms = torch.rand(num_rows)
        for row, generator in enumerate(generators):
            uniforms[row] = torch.rand(1, generator=generator)

    def keyed() -> None:
        torch.rand(num_rows)[seeded.logits_rows] = seeded.uniforms(torch.device("cpu"))
        batch.num_tokens[:num_rows] += 1

    def median_us(step: Callable[[], None]) -> float:
        times = []
        for _ in range(iters + 3):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.median(times[3:]) * 1e6

    return median_us(per_generator), median_us(keyed)


def print_seeded(iters: int) -> None:
    print()
    print(f"{'seeded rows':<12} {'generator per request us':>24} {'keyed by position us':>21}  speed-up")
    for num_rows in (64, 1024):
        old, new = seeded_draws_us(num_rows, iters)
        print(f"{num_rows:<12} {old:>24.1f} {new:>21.1f}  {old / new:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    logits = torch.randn(args.batch, args.vocab) * 4
    print(f"batch {args.batch} x vocab {args.vocab} float32 logits, {args.iters} timed steps, "
          f"torch threads {torch.get_num_threads()}")
    rows = []
    for case in CASES:
        metadata = build_metadata(case, args.batch, args.vocab)
        times = time_case(metadata, logits, args.iters)
        counter = count_copies(metadata, logits)
        ops = ", ".join(f"{name} x{n}" for name, n in sorted(counter.ops.items())) or "-"
        rows.append((case.name, statistics.median(times) * 1e3, min(times) * 1e3, counter.num_copies, ops))
    print()
    print(f"{'case':<26} {'median ms':>10} {'min ms':>8} {'logits-size copies':>19}  ops")
    for name, median, best, copies, ops in rows:
        print(f"{name:<26} {median:>10.2f} {best:>8.2f} {copies:>19}  {ops}")
    print_scaling(args.vocab, args.iters)
    print_seeded(args.iters)


if __name__ == "__main__":
    main()
