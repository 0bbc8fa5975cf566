"""Decode step time at small batches through `LLM` (engine core in its own process, async
scheduling as configured by default): the demo model, N requests of 200 prompt tokens each,
200 greedy tokens each, all decoding together; milliseconds per step. This is the regime where a
step's fixed costs (waking threads, dispatch) weigh most against reading the weights.

    python benchmarks/decode_steps.py [--requests 1 8] [--dtype bfloat16] [--rounds 2]

To compare two builds, run it with `PYTHONPATH` pointing at each checkout, alternating.
"""

from __future__ import annotations

import argparse
import time

from benchlib import demo_model, machine_line, print_table

from vllm_lite import LLM, SamplingParams

PROMPT_LEN = 200
OUTPUT_LEN = 200


def ms_per_step(llm: LLM, num_requests: int) -> float:
    prompts = [{"prompt_token_ids": list(range(1000 + 300 * i, 1000 + 300 * i + PROMPT_LEN))}
               for i in range(num_requests)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return 1e3 * (time.perf_counter() - start) / OUTPUT_LEN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.rounds < 1 or min(args.requests) < 1:
        parser.error("--rounds and every --requests must be at least 1")
    llm = LLM(model=str(demo_model()), dtype=args.dtype, max_model_len=1024, max_num_seqs=max(args.requests),
              kv_cache_memory_bytes=1 << 30)
    try:
        rows = []
        for num_requests in args.requests:
            times = [ms_per_step(llm, num_requests) for _ in range(args.rounds)]
            rows.append((num_requests, min(times), max(times)))
    finally:
        llm.shutdown()
    print(machine_line())
    print(f"demo model, {args.dtype}; {PROMPT_LEN}-token prompts, {OUTPUT_LEN} greedy tokens; ms per step "
          f"(the whole generate call / {OUTPUT_LEN}), {args.rounds} rounds")
    print_table(("requests", "best ms/step", "worst ms/step"), rows)


if __name__ == "__main__":
    main()
