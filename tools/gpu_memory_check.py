"""gpu_memory_utilization on a CUDA GPU (part of `make gpu-check`): a Qwen3-0.6B-shaped random
model in bf16 under shares of 0.5 and vLLM's default 0.92, with max_num_seqs x max_model_len large
enough that the share, not the cap, sizes the KV cache. For each: the blocks the engine core
measured, the GPU memory in use once a batch ran (the engine core's process holds it; this
process only reads the device's free memory), and whether that stays within the share. Exits 1
if not."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from gpu_throughput import build_qwen3_shaped  # noqa: E402

from vllm_lite import LLM, SamplingParams  # noqa: E402

GIB = 1 << 30
SLACK_BYTES = GIB // 2  # the CUDA contexts of this process and the engine core's, outside any share


def check(model_dir: Path, utilization: float | None, in_use_before: int) -> bool:
    args = {} if utilization is None else {"gpu_memory_utilization": utilization}
    llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=32768, max_num_seqs=256, skip_tokenizer_init=True,
              **args)
    try:
        config = llm.llm_engine.vllm_config
        blocks = config.num_kv_blocks()
        kv_gib = blocks * config.kv_block_bytes() / GIB
        prompts = [{"prompt_token_ids": [(i * 7 + j) % 1000 + 10 for j in range(2048)]} for i in range(64)]
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True,
                                                       detokenize=False), use_tqdm=False)
        free, total = torch.cuda.mem_get_info()
        in_use = total - free - in_use_before
        share = config.cache_config.gpu_memory_utilization * total
        ok = in_use <= share + SLACK_BYTES and all(len(o.outputs[0].token_ids) == 64 for o in outputs)
        print(f"gpu_memory_utilization={config.cache_config.gpu_memory_utilization}: {blocks} blocks "
              f"({kv_gib:.2f} GiB KV cache), engine in use {in_use / GIB:.2f} GiB of a {share / GIB:.2f} GiB share "
              f"(GPU {total / GIB:.2f} GiB): {'ok' if ok else 'OVER THE SHARE'}", flush=True)
        return ok
    finally:
        llm.shutdown()


def main() -> int:
    torch.cuda.init()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_qwen3_shaped(Path(tmp))
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        in_use_before = total - free  # this process's context and whatever else runs on the GPU
        results = [check(model_dir, utilization, in_use_before) for utilization in (0.5, None)]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
