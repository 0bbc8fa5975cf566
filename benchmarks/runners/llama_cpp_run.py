"""Benchmark runner: llama.cpp through llama-cpp-python (the peer environment of
benchmarks/peers/make_llama_cpp_venv.sh) on a GGUF decode job.

    python benchmarks/runners/llama_cpp_run.py JOB.json RESULT.json

Job: {"gguf": path, "prompt": [token ids], "max_tokens": N, "threads": T, "repeats": R}.
Each repeat times a greedy generation of 1 token and of N tokens from a reset context (no reuse
of the prompt's KV between them); decode tokens/s = (N - 1) / (time(N) - time(1)).
Result: {"decode_tokens_per_s": [per repeat], "outputs": [the N token ids]}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from decode_rate import decode_rates  # this folder (on sys.path when run as a script)
from llama_cpp import Llama


def generate(llm: Llama, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    llm.reset()
    tokens: list[int] = []
    start = time.perf_counter()
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == max_tokens:
            break
    return time.perf_counter() - start, tokens


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    threads, n = job["threads"], job["max_tokens"]
    llm = Llama(model_path=job["gguf"], n_ctx=len(job["prompt"]) + n + 8, n_batch=512, n_threads=threads,
                n_threads_batch=threads, seed=0, verbose=False)
    rates, outputs = decode_rates(lambda prompt, tokens: generate(llm, prompt, tokens), job["prompt"], n,
                                  job["repeats"])
    Path(result_path).write_text(json.dumps({"decode_tokens_per_s": rates, "outputs": outputs}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
