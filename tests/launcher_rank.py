"""One process of a torchrun job that runs vllm_lite's LLM with vLLM's
distributed_executor_backend='external_launcher' (driven by tests/test_external_launcher.py).

argv: MODEL OUT_DIR TENSOR_PARALLEL_SIZE OWN_GROUP, OWN_GROUP "1" to make the world's process
group first, as a trainer (accelerate) has before it builds the engine. Writes
OUT_DIR/rank<RANK>.json: the greedy and the seeded sampled tokens of its prompts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from vllm_lite import LLM, SamplingParams


def prompts_of(engine: int) -> list[list[int]]:
    """The same prompts on every rank of one engine, others on the next engine."""
    return [[(engine * 31 + 7 * i + j) % 900 + 3 for j in range(4 + 9 * i)] for i in range(3)]


def main() -> None:
    model, out_dir, tp, own_group = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    if own_group:
        dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    llm = LLM(model, tensor_parallel_size=tp, distributed_executor_backend="external_launcher", dtype="float32",
              max_model_len=128, max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": p} for p in prompts_of(rank // tp)]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    sampled = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
    llm.shutdown()
    result = {"greedy": [list(o.outputs[0].token_ids) for o in greedy],
              "sampled": [list(o.outputs[0].token_ids) for o in sampled],
              "initialized_after": dist.is_initialized()}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if own_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
