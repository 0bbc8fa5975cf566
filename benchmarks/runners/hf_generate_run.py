"""Benchmark runner: Hugging Face transformers `generate`, static batches with left padding,
greedy, exactly `max_tokens` new tokens per request (no EOS stop), on a job file.

Besides the timed run it generates the first `check_outputs` requests alone (batch of one, no
padding, untimed): the reference the benchmark compares vllm_lite's greedy tokens with.

    python benchmarks/runners/hf_generate_run.py JOB.json RESULT.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def generate_batch(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, pad_id: int) -> torch.Tensor:
    """Left-padded batch -> the new tokens, [batch, new_tokens]."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                         max_new_tokens=new_tokens, pad_token_id=pad_id)
    return out[:, width:]


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    # No EOS: every request gets exactly its length, as ignore_eos gives the engines.
    model.generation_config.eos_token_id = None
    pad_id = 0
    prompts, max_tokens = job["prompts"], job["max_tokens"]
    batch_size = job.get("hf_batch_size", 16)
    with torch.inference_mode():
        generate_batch(model, prompts[:1], 4, pad_id)  # warm-up
        start = time.perf_counter()
        for first in range(0, len(prompts), batch_size):
            generate_batch(model, prompts[first:first + batch_size], max(max_tokens[first:first + batch_size]), pad_id)
        elapsed = time.perf_counter() - start
        checked = [generate_batch(model, [prompts[i]], max_tokens[i], pad_id)[0].tolist()
                   for i in range(min(job.get("check_outputs", 0), len(prompts)))]
    Path(result_path).write_text(json.dumps({
        "elapsed_s": elapsed, "num_requests": len(prompts),
        "input_tokens": sum(len(p) for p in prompts),
        "output_tokens": sum(max_tokens),  # the useful ones; padding rows' extra steps are the cost of static batches
        "outputs": checked,
        "extra": {"batch_size": batch_size},
    }))


if __name__ == "__main__":
    main(*sys.argv[1:3])
