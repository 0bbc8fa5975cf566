"""A/B of the client's per-step work: one `OutputProcessor` (the tiny model's tokenizer,
detokenization on) takes steady decode steps of N requests, each step's output tokens appended
by csrc's loop (`OutputTokenStore.append_and_look` in C) or by its numpy twin, by a random draw
per step, so both sides see the same VM phases. Final-only requests (what `LLM` asks for) and
streams (a delta per request per step, what the server's streams ask for).

    python benchmarks/client_ab.py [--requests 64 1024] [--steps 400]

Prints the median per side of a step's `process_outputs` plus the outputs it makes.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from benchlib import RESULTS_DIR, print_table, tiny_llama

from vllm_lite.bookkeeping import native_loops
from vllm_lite.engine.output_processor import OutputProcessor
from vllm_lite.engine.tokenizer import load_tokenizer
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams
from vllm_lite.wire import EngineCoreOutputs

VOCAB = (100, 8000)


def run(tokenizer: object, kind: RequestOutputKind, num_requests: int, steps: int,
        rng: np.random.Generator) -> dict[bool, float]:
    processor = OutputProcessor(tokenizer, 1)
    req_ids = [f"r{i}" for i in range(num_requests)]
    for req_id in req_ids:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 10, ignore_eos=True, output_kind=kind)
        processor.add_request(req_id, None, rng.integers(*VOCAB, 20).tolist(), params)
    store = processor.token_store
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for step in range(steps):
        on = bool(rng.integers(2))
        store._native = native_loops if on else None
        outputs = EngineCoreOutputs(req_ids, rng.integers(*VOCAB, num_requests).astype(np.int32))
        start = time.perf_counter()
        states, _ = processor.process_outputs(outputs)
        for state in states:
            state.make_output()
        if step >= 20:  # (past the first outputs and the store's growth)
            seconds[on].append(time.perf_counter() - start)
    return {on: 1e6 * float(np.median(samples)) for on, samples in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    if native_loops is None:
        raise SystemExit("vllm_lite._bookkeeping is not built: nothing to compare")
    model = tiny_llama(RESULTS_DIR / "tiny_llama_h128_l2_v8192_t8192", truncate_tokenizer=True)
    tokenizer = load_tokenizer(str(model))
    rng = np.random.default_rng(0)
    rows = []
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA):
        for num_requests in args.requests:
            medians = run(tokenizer, kind, num_requests, args.steps, rng)
            rows.append((kind.name.lower(), num_requests, f"{medians[False]:.1f}", f"{medians[True]:.1f}",
                         f"{medians[True] - medians[False]:+.1f}"))
    print(f"{args.steps} steps each, numpy or C by a random draw per step; us per step (median)")
    print_table(("outputs", "requests", "numpy", "C", "difference"), rows)


if __name__ == "__main__":
    main()
