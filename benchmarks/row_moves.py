"""Benchmark 4: persistent-batch row moves (the shape of vLLM's own swap_states benchmark).

512 live requests whose active lengths are uniform in 100-1,500 tokens, in an InputBatch built
for max_model_len 2,048 and 32,768. Times 1,000 `swap_states` of random row pairs, and 1,000
`condense` rounds (remove 8 random requests, re-add 8, condense). Because moves copy only a row's
active prefix, the time must not depend on max_model_len. As a reference, the same swaps done
the way vLLM once did them (whole `max_model_len` rows, fancy-indexed) are timed too.

    python benchmarks/row_moves.py [--requests 512] [--iters 1000] [--max-model-lens 2048 32768]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchlib import machine_line, print_table, write_results
from vllm_lite.core.scheduler_output import NewRequestData
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.input_batch import InputBatch

BLOCK_SIZE = 16
ACTIVE_LEN = (100, 1500)


def filled_batch(num_requests: int, max_model_len: int, seed: int = 0) -> tuple[InputBatch, list[NewRequestData]]:
    rng = np.random.default_rng(seed)
    batch = InputBatch(num_requests, max_model_len, -(-(max_model_len + 1) // BLOCK_SIZE))
    params = SamplingParams(temperature=0.0)
    requests = []
    for i in range(num_requests):
        n = int(rng.integers(ACTIVE_LEN[0], ACTIVE_LEN[1] + 1))
        blocks = rng.integers(1, 1 << 20, -(-n // BLOCK_SIZE)).tolist()
        requests.append(NewRequestData(f"r{i}", rng.integers(0, 32000, n, dtype=np.int32), n, params, blocks, n))
        batch.add_request(requests[-1])
    return batch, requests


def time_swaps(batch: InputBatch, pairs: np.ndarray) -> float:
    start = time.perf_counter()
    for a, b in pairs:
        batch.swap_states(int(a), int(b))
    return time.perf_counter() - start


def time_whole_row_swaps(batch: InputBatch, pairs: np.ndarray) -> float:
    """The reference: every per-row array swapped in full, max_model_len wide."""
    token_ids, block_ids = batch.token_ids, batch.block_table.block_ids
    start = time.perf_counter()
    for a, b in pairs:
        token_ids[[a, b]] = token_ids[[b, a]]
        block_ids[[a, b]] = block_ids[[b, a]]
    return time.perf_counter() - start


def time_condense(batch: InputBatch, requests: list[NewRequestData], rounds: int, seed: int = 1) -> float:
    rng = np.random.default_rng(seed)
    by_id = {r.req_id: r for r in requests}
    elapsed = 0.0
    for _ in range(rounds):
        victims = rng.choice(batch.live_req_ids, 8, replace=False)
        for req_id in victims:
            batch.remove_request(str(req_id))
        start = time.perf_counter()
        batch.condense()
        elapsed += time.perf_counter() - start
        for req_id in victims:
            batch.add_request(by_id[str(req_id)])
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--max-model-lens", type=int, nargs="+", default=[2048, 32768])
    args = parser.parse_args()
    pairs = np.random.default_rng(2).integers(0, args.requests, (args.iters, 2))
    rows = []
    for max_model_len in args.max_model_lens:
        batch, requests = filled_batch(args.requests, max_model_len)
        swaps = time_swaps(batch, pairs)
        whole = time_whole_row_swaps(batch, pairs)
        condense = time_condense(batch, requests, args.iters)
        rows.append({"max_model_len": max_model_len, "swap_states_ms": 1e3 * swaps,
                     "whole_row_swaps_ms": 1e3 * whole, "condense_ms": 1e3 * condense})
    base = rows[0]
    write_results("row_moves", {"args": vars(args), "rows": rows})
    print(machine_line())
    print(f"{args.requests} requests, active lengths {ACTIVE_LEN[0]}-{ACTIVE_LEN[1]} tokens, "
          f"{args.iters} operations each; ratios are to max_model_len {base['max_model_len']}\n")
    print_table(("max_model_len", "swap_states (ms)", "ratio", "whole-row swaps (ms)", "ratio",
                 "condense (ms)", "ratio"),
                [(r["max_model_len"], r["swap_states_ms"], f"{r['swap_states_ms'] / base['swap_states_ms']:.2f}x",
                  r["whole_row_swaps_ms"], f"{r['whole_row_swaps_ms'] / base['whole_row_swaps_ms']:.2f}x",
                  r["condense_ms"], f"{r['condense_ms'] / base['condense_ms']:.2f}x") for r in rows])


if __name__ == "__main__":
    main()
