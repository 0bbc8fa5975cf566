"""What the Transformers fallback costs against a native implementation, on the same weights in
the same run: a random-weight checkpoint of a real model's shape (default: Pythia-160m, GPT-NeoX)
served with model_impl="vllm" and then "transformers".

    .venv/bin/python benchmarks/native_vs_fallback.py [--shape pythia-160m] [--dtype bfloat16]

Workloads (after one warm-up call each): a batch of 16 requests of 100 prompt + 64 generated
tokens, and one request generating 128 tokens (decode speed). Prompts are token ids
(skip_tokenizer_init): the checkpoint has no tokenizer."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from vllm_lite import LLM, SamplingParams

SHAPES = {
    "pythia-160m": ("gpt_neox", {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
                                 "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                                 "intermediate_size": 3072, "vocab_size": 50304, "rotary_pct": 0.25,
                                 "rotary_emb_base": 10000, "max_position_embeddings": 2048, "layer_norm_eps": 1e-5,
                                 "use_parallel_residual": True, "hidden_act": "gelu", "tie_word_embeddings": False,
                                 "bos_token_id": 0, "eos_token_id": 0}),
}


def write_checkpoint(shape: str, folder: Path) -> Path:
    """Random weights (std 0.02) of the shape's model, as transformers builds it, in bfloat16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _, config = SHAPES[shape]
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def timed(llm: LLM, prompts: list[dict], params: SamplingParams) -> float:
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def measure(model: Path, model_impl: str, dtype: str) -> tuple[float, float]:
    llm = LLM(str(model), model_impl=model_impl, dtype=dtype, skip_tokenizer_init=True, max_model_len=512)
    try:
        batch = [{"prompt_token_ids": [(7 * i + j) % 50000 + 10 for j in range(100)]} for i in range(16)]
        batch_time = timed(llm, batch, SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0))
        decode_time = timed(llm, [{"prompt_token_ids": [11, 12, 13]}],
                            SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0))
        return batch_time, decode_time
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="pythia-160m")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = write_checkpoint(args.shape, Path(folder))
        native = measure(model, "vllm", args.dtype)
        fallback = measure(model, "transformers", args.dtype)
    print(f"{args.shape} ({args.dtype})        native   fallback   fallback / native")
    print(f"16 x (100 + 64) tokens    {native[0]:6.2f} s  {fallback[0]:7.2f} s   {fallback[0] / native[0]:6.2f}x")
    print(f"1 x 128 generated tokens  {native[1]:6.2f} s  {fallback[1]:7.2f} s   {fallback[1] / native[1]:6.2f}x")


if __name__ == "__main__":
    main()
