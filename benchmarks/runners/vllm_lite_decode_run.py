"""Benchmark runner: vllm_lite's `LLM` (engine core in its own process) on a single-stream decode
job; the same job and result formats as benchmarks/runners/llama_cpp_run.py, plus "model" (a
.gguf file or a folder), "dtype" and optional "quantization".

Prefix caching is off, so the N-token generation recomputes the prompt as the 1-token one did;
decode tokens/s = (N - 1) / (time(N) - time(1)).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from decode_rate import decode_rates  # this folder (on sys.path when run as a script)

from vllm_lite import LLM, SamplingParams


def generate(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return time.perf_counter() - start, [int(t) for t in out.outputs[0].token_ids]


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    n = job["max_tokens"]
    optional = {"quantization": job["quantization"]} if job.get("quantization") else {}
    llm = LLM(job["model"], dtype=job["dtype"], max_model_len=len(job["prompt"]) + n + 8, max_num_seqs=1,
              enable_prefix_caching=False, seed=0, **optional)
    try:
        rates, outputs = decode_rates(lambda prompt, tokens: generate(llm, prompt, tokens), job["prompt"], n,
                                      job["repeats"])
    finally:
        llm.shutdown()
    Path(result_path).write_text(json.dumps({"decode_tokens_per_s": rates, "outputs": outputs}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
