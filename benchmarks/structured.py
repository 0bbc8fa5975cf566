"""Structured outputs: throughput of one batch where 0%, 10% and 100% of the requests follow a
JSON schema (demo model, greedy, every request runs exactly --max-tokens tokens: ignore_eos,
and the schema asks for 100 array items, more than fit, so no constrained request closes its
object early; every case decodes the same number of tokens), and the per-step cost of the two bitmask
steps (matcher fill in the engine core, mask applied in the sampler) for m constrained rows.

The unconstrained batch is run twice, first and last, so their ratio shows the run's noise.
The vLLM CPU peer is not run here.

    python benchmarks/structured.py [--requests 32] [--max-tokens 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from benchlib import demo_model, print_table, write_results
from vllm_lite import LLM, SamplingParams
from vllm_lite.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "integer"}, "minItems": 100}},
    "required": ["name", "age", "tags"],
}


def run_batch(llm: LLM, prompt: str, num_requests: int, fraction: float, max_tokens: int) -> dict:
    num_constrained = round(num_requests * fraction)
    structured = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                             structured_outputs=structured if i < num_constrained else None)
              for i in range(num_requests)]
    start = time.perf_counter()
    outputs = llm.generate([prompt] * num_requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"constrained": f"{fraction:.0%}", "seconds": elapsed, "output_tokens": tokens,
            "tok_per_s": tokens / elapsed}


def bitmask_costs(llm: LLM, vocab: int, rows_list: list[int], iters: int) -> list[dict]:
    from vllm_lite.sample.ops.grammar_mask import GrammarBitmask, apply_grammar_bitmask

    manager = llm.llm_engine.engine_core.structured_output_manager  # the in-process engine core
    results = []
    for m in rows_list:
        logits = torch.randn(256, vocab)
        bitmask = torch.randint(-2**31, 2**31 - 1, (m, -(-vocab // 32)), dtype=torch.int32)
        grammar = GrammarBitmask(torch.arange(m), bitmask)
        apply_grammar_bitmask(logits, grammar)
        start = time.perf_counter()
        for _ in range(iters):
            apply_grammar_bitmask(logits, grammar)
        apply_ms = (time.perf_counter() - start) / iters * 1e3
        fill_ms = None
        if manager is not None:
            requests = [manager.make_request(StructuredOutputsParams(json=SCHEMA)) for _ in range(m)]
            while not all(r.is_ready() for r in requests):
                time.sleep(0.01)
            manager.grammar_bitmask(requests)
            start = time.perf_counter()
            for _ in range(iters):
                manager.grammar_bitmask(requests)
            fill_ms = (time.perf_counter() - start) / iters * 1e3
        results.append({"rows": m, "fill_ms": fill_ms, "apply_ms": apply_ms})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(str(demo_model()), max_model_len=512, multiprocess=False)
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON."}], tokenize=False, add_generation_prompt=True)
    run_batch(llm, prompt, 4, 1.0, 4)  # warm-up (and the tokenizer vocabulary load of the grammar backend)
    rows = [run_batch(llm, prompt, args.requests, f, args.max_tokens) for f in (0.0, 0.1, 1.0, 0.0)]
    base = (rows[0]["tok_per_s"] + rows[-1]["tok_per_s"]) / 2
    for row in rows:
        row["vs_unconstrained"] = f"{row['tok_per_s'] / base:.3f}x"
    vocab = llm.llm_engine.vllm_config.model_config.hf.vocab_size
    costs = bitmask_costs(llm, vocab, [1, 8, 32], args.iters)
    write_results("structured", {"batches": rows, "bitmask": costs, "args": vars(args)})
    print(f"vocabulary {vocab}; {args.requests} requests x {args.max_tokens} tokens, greedy")
    print_table(["constrained", "seconds", "output tokens", "tok/s", "vs unconstrained (mean of 2 runs)"],
                [[r["constrained"], r["seconds"], r["output_tokens"], r["tok_per_s"], r["vs_unconstrained"]]
                 for r in rows])
    print()
    print_table(["constrained rows", "bitmask fill (ms/step)", "mask apply (ms/step)"],
                [[c["rows"], "-" if c["fill_ms"] is None else c["fill_ms"], c["apply_ms"]] for c in costs])


if __name__ == "__main__":
    main()
