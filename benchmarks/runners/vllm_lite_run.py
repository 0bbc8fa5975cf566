"""Benchmark runner: vllm_lite's `LLM` (engine core in its own process) on a job file.

    python benchmarks/runners/vllm_lite_run.py JOB.json RESULT.json

The job and result formats are those of benchmarks/benchlib.py (run_engine / engine_job); a job
with `json_schema` constrains its first `num_constrained` requests to it (structured outputs); a
job with `lora` ({"paths", "of_request", "max_loras", "max_lora_rank"}) runs request i with
adapter `paths[of_request[i]]` (-1: the base model).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

from vllm_lite import LLM, SamplingParams


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    optional = {"quantization": job["quantization"]} if job.get("quantization") else {}
    if job.get("kv_cache_dtype", "auto") != "auto":  # only then: a baseline checkout may predate the option
        optional["kv_cache_dtype"] = job["kv_cache_dtype"]
    if job.get("async_scheduling") is not None:  # only then: a baseline checkout may predate the option
        optional["async_scheduling"] = job["async_scheduling"]
    lora = job.get("lora")
    if lora:
        optional.update(enable_lora=True, max_loras=lora["max_loras"], max_lora_rank=lora["max_lora_rank"])
    llm = LLM(job["model"], dtype=job.get("dtype", "float32"), max_model_len=job["max_model_len"],
              max_num_seqs=job["max_num_seqs"], max_num_batched_tokens=job["max_num_batched_tokens"],
              kv_cache_memory_bytes=job["kv_cache_gib"] * 1024 ** 3, seed=0, **optional)
    try:
        detokenize = job.get("detokenize", True)
        prompts = [{"prompt_token_ids": prompt} for prompt in job["prompts"]]
        num_constrained = job.get("num_constrained", 0) if job.get("json_schema") else 0
        constrained = {}
        if num_constrained:  # only then: a baseline checkout may predate structured outputs
            from vllm_lite.sampling_params import StructuredOutputsParams

            constrained = {"structured_outputs": StructuredOutputsParams(json=job["json_schema"])}
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=detokenize,
                                 **(constrained if i < num_constrained else {}))
                  for i, n in enumerate(job["max_tokens"])]
        # Warm-up (with the grammar, when there is one: its compilation is cached, as in vLLM).
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, **constrained), use_tqdm=False)
        adapters = {}
        if lora:
            from vllm_lite.lora.request import LoRARequest

            requests = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(lora["paths"])]
            adapters = {"lora_request": [requests[i] if i >= 0 else None for i in lora["of_request"]]}
            llm.generate(prompts[:len(requests)], SamplingParams(max_tokens=4), use_tqdm=False,
                         lora_request=requests)  # (warm-up: the workers read the adapters)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, **adapters)
        elapsed = time.perf_counter() - start
        dtype = llm.llm_engine.vllm_config.model_config.dtype  # what dtype="auto" resolved to
        async_scheduling = llm.llm_engine.vllm_config.scheduler_config.async_scheduling  # what the default was
    finally:
        llm.shutdown()
    token_ids = [[int(t) for t in out.outputs[0].token_ids] for out in outputs]
    Path(result_path).write_text(json.dumps({
        "elapsed_s": elapsed, "num_requests": len(outputs),
        "input_tokens": sum(len(p) for p in job["prompts"]),
        "output_tokens": sum(len(t) for t in token_ids),
        "outputs": token_ids[:job.get("keep_outputs", 0)],
        "extra": {"async_scheduling": async_scheduling, "outputs_sha256": outputs_digest(token_ids),
                  "dtype": dtype},
    }))


def outputs_digest(token_ids: list[list[int]]) -> str:
    """One hash of every request's output tokens: equal digests, equal outputs (run to run)."""
    digest = hashlib.sha256()
    for tokens in token_ids:
        digest.update(json.dumps(tokens).encode() + b"\n")
    return digest.hexdigest()


if __name__ == "__main__":
    main(*sys.argv[1:3])
