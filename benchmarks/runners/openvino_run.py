"""Benchmark runner: OpenVINO GenAI's ContinuousBatchingPipeline on a job file. Runs with the
peer environment's interpreter (benchmarks/peers/make_openvino_venv.sh), so it imports nothing
from vllm_lite.

    benchmarks/peers/.venv-openvino/bin/python benchmarks/runners/openvino_run.py JOB.json RESULT.json

The model folder is exported once to OpenVINO IR (fp32 weights, optimum-cli) next to the job's
cache directory; `job["dtype"]` "float32" sets INFERENCE_PRECISION_HINT=f32, "default" leaves
the runtime its own choice (bf16 on CPUs with avx512_bf16). Prompts go in as token ids, every
request with ignore_eos and its own max_new_tokens, greedy.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


def export_model(model: Path, out: Path) -> Path:
    """fp32 IR of the HF folder `model` plus its tokenizer, made once."""
    if (out / "openvino_model.xml").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(Path(sys.executable).parent / "optimum-cli"), "export", "openvino", "--model", str(model),
                    "--task", "text-generation-with-past", "--weight-format", "fp32", str(out)], check=True)
    return out


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    import openvino_genai as ov_genai

    model_dir = export_model(Path(job["model"]), Path(job["openvino_cache_dir"]) / Path(job["model"]).name)
    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = job["kv_cache_gib"]
    scheduler.max_num_seqs = job["max_num_seqs"]
    scheduler.max_num_batched_tokens = job["max_num_batched_tokens"]
    scheduler.enable_prefix_caching = False
    properties = {"INFERENCE_NUM_THREADS": job["threads"]}
    if job.get("dtype", "default") == "float32":
        properties["INFERENCE_PRECISION_HINT"] = "f32"
    pipe = ov_genai.ContinuousBatchingPipeline(str(model_dir), scheduler, "CPU", properties)
    import openvino as ov

    prompts = [ov.Tensor(_as_int64([p])) for p in job["prompts"]]
    configs = [_greedy_config(ov_genai, n) for n in job["max_tokens"]]
    pipe.generate(prompts[:1], [_greedy_config(ov_genai, 4)])  # warm-up
    start = time.perf_counter()
    results = pipe.generate(prompts, configs)
    elapsed = time.perf_counter() - start
    token_ids = [list(r.m_generation_ids[0]) for r in results]
    Path(result_path).write_text(json.dumps({
        "elapsed_s": elapsed, "num_requests": len(results),
        "input_tokens": sum(len(p) for p in job["prompts"]),
        "output_tokens": sum(len(t) for t in token_ids),
        "outputs": [[int(t) for t in ids] for ids in token_ids[:job.get("keep_outputs", 0)]],
        "extra": {"dtype": _precision(ov, properties)},
    }))


def _precision(ov, properties: dict) -> str:
    """The CPU plugin's inference precision under `properties` (its default where no hint is
    given: bf16 only on CPUs with bf16 in hardware) and its KV cache's."""
    core = ov.Core()
    inference = properties.get("INFERENCE_PRECISION_HINT") or core.get_property("CPU", "INFERENCE_PRECISION_HINT")
    kv_cache = core.get_property("CPU", "KV_CACHE_PRECISION")
    return f"{_type_name(inference)}, {_type_name(kv_cache)} KV"


def _type_name(value) -> str:
    """'f32' for an ov.Type (whose str() is "<Type: 'float32'>") or a hint string."""
    return value.to_string() if hasattr(value, "to_string") else str(value)


def _as_int64(rows: list[list[int]]):
    import numpy as np

    return np.array(rows, dtype=np.int64)


def _greedy_config(ov_genai, max_new_tokens: int):
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = max_new_tokens
    config.ignore_eos = True
    config.do_sample = False
    return config


if __name__ == "__main__":
    main(*sys.argv[1:3])
