"""Qwen3.5 (Gated DeltaNet linear attention beside gated attention) served by vllm_lite against
transformers' own generate on the same weights, in the same run: a random-weight checkpoint of
a Qwen3.5-0.8B-like shape (24 layers, 3 linear-attention layers to 1 of attention, hidden 1024,
16 key / value heads of 128 in the linear layers), bfloat16 on CPU.

    .venv/bin/python benchmarks/linear_attention.py [--layers 24] [--batch 16] [--threads 2]

Workloads (after one warm-up call each, then `--rounds` rounds alternating the two sides, medians
printed): a batch of `--batch` requests of 100 prompt + 64 generated tokens (equal lengths:
transformers pads nothing), and one request generating 128 tokens. transformers runs its reference PyTorch Gated DeltaNet (the CPU has no FLA kernels), as
a CPU user of it gets. Prints the times and each ratio."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vllm_lite import LLM, SamplingParams

PROMPT, GENERATED, DECODE = 100, 64, 128


def write_checkpoint(folder: Path, layers: int) -> Path:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
        tie_word_embeddings=True, max_position_embeddings=4096, eos_token_id=0, bos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def prompts(batch: int) -> list[list[int]]:
    return [[(7 * i + j) % 200_000 + 10 for j in range(PROMPT)] for i in range(batch)]


def seconds(run, *args) -> float:
    start = time.perf_counter()
    run(*args)
    return time.perf_counter() - start


def engine_generate(model: Path) -> tuple[LLM, object]:
    llm = LLM(str(model), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=512)

    def generate(token_ids: list[list[int]], max_tokens: int) -> None:
        llm.generate([{"prompt_token_ids": ids} for ids in token_ids],
                     SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0), use_tqdm=False)
    return llm, generate


def transformers_generate(model: Path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)

    def generate(token_ids: list[list[int]], max_tokens: int) -> None:
        with torch.inference_mode():
            hf.generate(torch.tensor(token_ids), attention_mask=torch.ones(len(token_ids), len(token_ids[0])),
                        max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="each workload on each side, alternately")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workloads = ((f"{args.batch} x ({PROMPT} prompt + {GENERATED} generated)", prompts(args.batch), GENERATED),
                 (f"1 x {DECODE} generated", [[11, 12, 13]], DECODE))
    with tempfile.TemporaryDirectory() as folder:
        model = write_checkpoint(Path(folder), args.layers)
        llm, ours = engine_generate(model)
        try:
            theirs = transformers_generate(model)
            times = {name: ([], []) for name, _, _ in workloads}
            for _, token_ids, max_tokens in workloads:  # (warm-up)
                ours(token_ids, max_tokens)
                theirs(token_ids, max_tokens)
            for _ in range(args.rounds):  # (alternating: the VM's drift reaches both sides alike)
                for name, token_ids, max_tokens in workloads:
                    times[name][0].append(seconds(ours, token_ids, max_tokens))
                    times[name][1].append(seconds(theirs, token_ids, max_tokens))
        finally:
            llm.shutdown()
    print(f"{'workload (median of ' + str(args.rounds) + ' rounds)':<44}{'vllm_lite s':>12}{'transformers s':>16}"
          f"{'speed-up':>10}")
    for name, (mine, peer) in times.items():
        mine_s, peer_s = statistics.median(mine), statistics.median(peer)
        print(f"{name:<44}{mine_s:>12.2f}{peer_s:>16.2f}{peer_s / mine_s:>9.2f}x")


if __name__ == "__main__":
    main()
