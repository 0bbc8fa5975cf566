"""Benchmark: single-stream decode of the demo model kept in its GGUF blocks (Q4_1, with a Q8_0
embedding / LM head) against llama.cpp (llama-cpp-python, benchmarks/peers/make_llama_cpp_venv.sh)
on the same GGUF file, the same prompt token ids, the same number of greedy tokens and the same
thread count. Also reports the resident weight memory of the demo model per loading.

Each engine runs in its own subprocess; decode tokens/s = (N - 1) / (time for N tokens - time for
1 token), both from a fresh prompt (no KV reuse), median over `--repeats`. vllm_lite rows: the
GGUF file (quantization="gguf", implied) per `--dtype` for activations, and, unless
`--skip-dense`, the converted fp32 folder loaded dequantized.

    python benchmarks/gguf_decode.py [--threads 2] [--max-tokens 128] [--repeats 3]
        [--dtype float32 bfloat16] [--skip-dense] [--skip-llama-cpp] [--skip-memory]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from benchlib import (RESULTS_DIR, Skipped, llama_cpp_python, machine_line, print_table, ratio, run_runner,
                      write_results)

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
LLAMA_CPP = "llama.cpp"


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def weight_memory(gguf_file: Path, folder: Path) -> list[tuple[str, int]]:
    """Resident weight bytes of the demo model as each loading holds it (weights only)."""
    import torch

    from vllm_lite.attention.selector import get_attn_backend
    from vllm_lite.config import EngineArgs
    from vllm_lite.model.loader import load_model, weight_bytes

    rows = []
    for label, model, dtype in (("dequantized fp32 (before)", folder, "float32"),
                                ("dequantized bf16", folder, "bfloat16"),
                                ("GGUF kept (Q4_1 + Q8_0)", gguf_file, "float32")):
        config = EngineArgs(model=str(model), dtype=dtype).create_engine_config().model_config
        cpu = torch.device("cpu")
        loaded = load_model(config, get_attn_backend("torch", cpu, getattr(torch, dtype)), cpu)
        rows.append((label, weight_bytes(loaded)))
        del loaded
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--skip-dense", action="store_true", help="no dequantized vllm_lite row")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from vllm_lite.gguf_convert import ensure_demo_model, find_demo_gguf

    gguf_file, folder = find_demo_gguf(), ensure_demo_model()
    prompt = AutoTokenizer.from_pretrained(str(folder)).encode(args.prompt)
    job: dict[str, Any] = {"prompt": prompt, "max_tokens": args.max_tokens, "threads": args.threads,
                           "repeats": args.repeats}
    runs: list[tuple[str, str, str, dict[str, Any] | Skipped]] = []
    if not args.skip_llama_cpp:
        python = llama_cpp_python()
        result = (run_runner(LLAMA_CPP, "llama_cpp_run.py", {**job, "gguf": str(gguf_file)}, python) if python
                  else Skipped(LLAMA_CPP, "no peer environment (benchmarks/peers/make_llama_cpp_venv.sh, "
                                          "or LLAMA_CPP_PYTHON)"))
        runs.append((LLAMA_CPP, "GGUF Q4_1", "-", result))
    for dtype in args.dtype:
        result = run_runner("vllm_lite", "vllm_lite_decode_run.py", {**job, "model": str(gguf_file), "dtype": dtype})
        runs.append(("vllm_lite", "GGUF Q4_1 kept", dtype, result))
    if not args.skip_dense:
        for dtype in args.dtype:
            result = run_runner("vllm_lite", "vllm_lite_decode_run.py", {**job, "model": str(folder), "dtype": dtype})
            runs.append(("vllm_lite", "dequantized at load", dtype, result))

    peer = next((r for name, _, _, r in runs if name == LLAMA_CPP and not isinstance(r, Skipped)), None)
    peer_rate = statistics.median(peer["decode_tokens_per_s"]) if peer else None
    rows = []
    for name, weights, dtype, result in runs:
        if isinstance(result, Skipped):
            rows.append((name, weights, dtype, "-", "-", "-", f"skipped: {result.reason}"))
            continue
        rate = statistics.median(result["decode_tokens_per_s"])
        same = f"{first_divergence(result['outputs'], peer['outputs'])}/{args.max_tokens}" if peer else "-"
        rows.append((name, weights, dtype, f"{rate:.1f}", ratio(rate, peer_rate), same,
                     " ".join(f"{r:.1f}" for r in result["decode_tokens_per_s"])))
    print(machine_line())
    print(f"demo model {gguf_file.name}; prompt {len(prompt)} tokens; {args.max_tokens} greedy tokens; "
          f"{args.threads} threads; median of {args.repeats}")
    print_table(["engine", "weights", "dtype", "decode tok/s", "vs llama.cpp", "same tokens as llama.cpp",
                 "per repeat"], rows)
    memory = [] if args.skip_memory else weight_memory(gguf_file, folder)
    if memory:
        print()
        print_table(["demo model weights", "resident MiB"], [(label, f"{b / 2 ** 20:.1f}") for label, b in memory])
    path = write_results("gguf_decode", {"machine": machine_line(), "args": vars(args), "prompt": prompt,
                                         "runs": [(n, w, d, r) for n, w, d, r in runs], "memory": memory})
    print(f"results: {path.relative_to(RESULTS_DIR.parent.parent)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
