"""Benchmark: the demo model (SmolLM2-135M-Instruct) as the quantized checkpoints a vLLM user
brings, written from its float weights by tests' writers (the packers' own rules): AWQ (4-bit,
group 64: kept in Q4_1 blocks), GPTQ act-order (dequantized at load), compressed-tensors W8A8
int8, FP8 blocks (DeepSeek / Qwen's form), beside the float model, all in one run: the weight
bytes each loading holds, single-stream decode tokens/s, and the wall time of 16 requests of
300 prompt + 64 generated tokens. Also teacher-forced mean |dlogprob| against the float model
of the same run (the quantization's accuracy cost, not the loader's: the loaders are exact,
tests/test_*_checkpoint.py).

    PYTHONPATH=tests .venv/bin/python benchmarks/quantized_checkpoints.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def checkpoints(source: Path, out: Path) -> list[tuple[str, Path]]:
    from test_fp8_checkpoint import write_fp8
    from test_int8_checkpoint import write_w8a8
    from test_wna16_checkpoint import AWQ_CONFIG, GPTQ_CONFIG, write_quantized

    awq, _ = write_quantized(source, out / "awq", {**AWQ_CONFIG, "group_size": 64})
    gptq, _ = write_quantized(source, out / "gptq", {**GPTQ_CONFIG, "group_size": 64, "desc_act": True},
                              act_order=True)
    return [("float (the checkpoint)", source), ("W8A8 int8 (compressed-tensors)", write_w8a8(source, out / "w8a8")[0]),
            ("AWQ 4-bit g64 (Q4_1 blocks)", awq), ("GPTQ 4-bit act-order (dequantized)", gptq),
            ("FP8 blocks 32x32 (dequantized)", write_fp8(source, out / "fp8", "fp8 blocks")[0])]


def measure(model: Path, dtype: str, prompts: list[list[int]], sequences: list[list[int]]) -> dict:
    from test_reduced_precision import teacher_forced_logprobs

    from vllm_lite import LLM, SamplingParams
    from vllm_lite.model.loader import weight_bytes

    llm = LLM(str(model), dtype=dtype, max_model_len=1024, multiprocess=False, device="cpu")
    try:
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        row = {"weight MiB": weight_bytes(runner.model) / 2**20}
        one = [{"prompt_token_ids": prompts[0][:32]}]
        llm.generate(one, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
        timings = []
        for tokens in (1, 129):
            start = time.perf_counter()
            llm.generate(one, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0), use_tqdm=False)
            timings.append(time.perf_counter() - start)
        row["decode tok/s"] = 128 / (timings[1] - timings[0])
        batch = [{"prompt_token_ids": p} for p in prompts]
        start = time.perf_counter()
        llm.generate(batch, SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0), use_tqdm=False)
        row["16 x (300+64) s"] = time.perf_counter() - start
        row["logprobs"] = teacher_forced_logprobs(llm, sequences, [300] * len(sequences))
        return row
    finally:
        llm.shutdown()
        gc.collect()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    import random

    from vllm_lite.gguf_convert import ensure_demo_model

    source = ensure_demo_model()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(300)] for _ in range(16)]
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        reference = None
        for label, model in checkpoints(source, Path(tmp)):
            if reference is None:  # the float model's own greedy continuations, teacher-forced for all
                from test_reduced_precision import greedy

                from vllm_lite import LLM

                llm = LLM(str(model), dtype=args.dtype, max_model_len=1024, multiprocess=False, device="cpu")
                reference = [p + r for p, r in zip(prompts[:4], greedy(llm, prompts[:4]))]
                llm.shutdown()
            rows.append((label, measure(model, args.dtype, prompts, reference)))
    base = rows[0][1]["logprobs"]
    print(f"demo model, dtype={args.dtype}, {len(prompts)} requests")
    print(f"{'checkpoint':38s} {'weight MiB':>10s} {'decode tok/s':>12s} {'16x(300+64) s':>14s} {'|dlogprob|':>10s}")
    for label, row in rows:
        diffs = [abs(a - b) for ra, rb in zip(base, row["logprobs"]) for a, b in zip(ra, rb)]
        print(f"{label:38s} {row['weight MiB']:10.1f} {row['decode tok/s']:12.1f} {row['16 x (300+64) s']:14.2f} "
              f"{sum(diffs) / len(diffs):10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
