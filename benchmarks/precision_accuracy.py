"""Accuracy of each reduced precision against float32 on the demo model (SmolLM2-135M-Instruct).

For a set of text prompts: greedy float32 outputs are the reference; each precision reports
where its greedy tokens first leave them (per prompt), and, feeding it the float32 sequences
(teacher forcing, `prompt_logprobs`), the mean and max |logprob difference| of the tokens float32
chose, plus how often its own argmax at those positions differs from float32's token.

    python benchmarks/precision_accuracy.py [--max-tokens 64] [--precision bfloat16 bfloat16+int8 ...]

A precision is DTYPE[+QUANTIZATION][/KV_CACHE_DTYPE], e.g. `bfloat16/int8_per_token_head` (a bf16
model with an int8 KV cache) or `float32/bfloat16`.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchlib import demo_model, machine_line, print_table, write_results

PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain how a refrigerator works in simple terms.",
    "List three uses of copper.",
    "Once upon a time, in a village at the edge of a forest,",
    "What is the difference between a list and a tuple in Python?",
    "Translate to French: I would like a cup of coffee, please.",
    "The three primary colors are",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", nargs="+",
                        default=["bfloat16", "bfloat16+int8", "bfloat16/int8_per_token_head", "float32/int8_per_token_head"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from vllm_lite import LLM, SamplingParams

    model = str(demo_model())
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)

    def run(precision: str, sequences: list[list[int]] | None) -> tuple[list[list[int]], list[list[int]], list]:
        """(greedy tokens, the scored sequences: prompt + float32's tokens, prompt_logprobs)."""
        weights, _, kv_cache_dtype = precision.partition("/")
        dtype, _, quantization = weights.partition("+")
        llm = LLM(model, dtype=dtype, quantization=quantization or None, kv_cache_dtype=kv_cache_dtype or "auto",
                  max_model_len=512, multiprocess=False)
        try:
            outs = llm.generate(list(PROMPTS), greedy, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            if sequences is None:
                sequences = [list(o.prompt_token_ids) + t for o, t in zip(outs, tokens)]
            scored = llm.generate([{"prompt_token_ids": s} for s in sequences], forced, use_tqdm=False)
            return tokens, sequences, [o.prompt_logprobs for o in scored]
        finally:
            llm.shutdown()

    ref_tokens, sequences, ref_lp = run("float32", None)
    prompt_lens = [len(s) - len(t) for s, t in zip(sequences, ref_tokens)]
    rows, report = [], {"args": vars(args), "precisions": {}}
    for precision in args.precision:
        tokens, _, lp = run(precision, sequences)
        divergence = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y))
                      for x, y in zip(tokens, ref_tokens)]
        diffs, flips = [], 0
        for seq, start, ref_entries, entries in zip(sequences, prompt_lens, ref_lp, lp):
            for i in range(start, len(seq)):
                diffs.append(abs(entries[i][seq[i]].logprob - ref_entries[i][seq[i]].logprob))
                top = max(entries[i].items(), key=lambda kv: kv[1].logprob)[0]
                flips += top != seq[i]
        mean_diff = statistics.fmean(diffs)
        rows.append((precision, " ".join(map(str, divergence)), f"{mean_diff:.4f}", f"{max(diffs):.3f}",
                     f"{flips}/{len(diffs)}"))
        report["precisions"][precision] = {"first_divergence": divergence, "mean_abs_dlogprob": mean_diff,
                                           "max_abs_dlogprob": max(diffs), "argmax_flips": flips,
                                           "scored_tokens": len(diffs)}
    write_results("precision_accuracy", report)
    print(machine_line())
    print(f"demo model, {len(PROMPTS)} prompts, {args.max_tokens} greedy tokens each; reference float32\n")
    print_table(("precision", f"first divergence per prompt (of {args.max_tokens})", "mean |dlogprob|",
                 "max |dlogprob|", "teacher-forced argmax flips"), rows)


if __name__ == "__main__":
    main()
