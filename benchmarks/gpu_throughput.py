"""GPU throughput: a random-weight model shaped like Qwen3-0.6B on nano-vllm's workload (uniform
input and output lengths, random token ids, ignore_eos), bf16, with async scheduling on and off
and with CUDA graphs off. Prints tokens/s per mode, the gain of async scheduling, and whether the
greedy outputs of every mode agree (in bf16 they may part: bf16 results depend on which requests
share a step, and with the engine core in its own process that depends on when requests arrive). With `--split`, the host time of
each phase of a steady decode step, async scheduling on (launching step N+1 before step N is finished,
the GPU's default, or finishing first) and off (benchmarks/engine_overhead.py's split, in-process
engine core, greedy whatever the sampling flags): where the host, not the GPU, sets the pace.

    python benchmarks/gpu_throughput.py --requests 256 --input-range 100 1024 --output-range 100 1024 [--split]
        [--temperature 0.8 --top-p 0.95 --top-k 50]   (default greedy)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchlib import EngineLimits, Workload, print_table, random_workload
from engine_overhead import PHASES, profile_steps

QWEN3_06B_SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6)


@dataclass(frozen=True, slots=True)
class ModeResult:
    name: str
    seconds: float
    output_tokens: int
    token_ids: list[list[int]]

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def build_qwen3_shaped(out_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_06B_SHAPE)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def run_mode(name: str, model_dir: Path, workload: Workload, kv_bytes: int, max_model_len: int = 2048,
             sampling: dict | None = None, **engine_args) -> ModeResult:
    """`sampling`: SamplingParams fields for every request (default greedy)."""
    from vllm_lite import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=max_model_len, skip_tokenizer_init=True,
              kv_cache_memory_bytes=kv_bytes, multiprocess=True, **engine_args)
    try:
        params = [SamplingParams(**(sampling or {"temperature": 0.0}), max_tokens=n, ignore_eos=True,
                                 detokenize=False) for n in workload.max_tokens]
        warm = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)]
        llm.generate([{"prompt_token_ids": workload.prompts[0]}], warm, use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    return ModeResult(name, seconds, sum(len(t) for t in token_ids), token_ids)


def first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            position = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return f"request {index} differs from token {position}"
    return "identical"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input-range", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--output-range", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--kv-cache-gib", type=float, default=24.0)
    parser.add_argument("--modes", nargs="+", default=["async", "sync", "async-eager"],
                        choices=["async", "sync", "async-eager", "sync-eager"])
    parser.add_argument("--split", action="store_true", help="also the per-step host split, async on and off")
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (default greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    args = parser.parse_args()
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    workload = random_workload(args.requests, tuple(args.input_range), tuple(args.output_range), 151936)
    engine_args = {"async": dict(async_scheduling=True), "sync": dict(async_scheduling=False),
                   "async-eager": dict(async_scheduling=True, enforce_eager=True),
                   "sync-eager": dict(async_scheduling=False, enforce_eager=True)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_qwen3_shaped(Path(tmp))
        results = [run_mode(mode, model_dir, workload, int(args.kv_cache_gib * 2**30), sampling=sampling,
                            **engine_args[mode])
                   for mode in args.modes]
        limits = EngineLimits(max_model_len=2048, max_num_seqs=args.requests, max_num_batched_tokens=8192,
                              kv_cache_gib=args.kv_cache_gib, threads=torch.get_num_threads())
        variants = {"on": (True, None), "on, finish first": (True, False), "off": (False, None)}
        splits = {name: profile_steps(model_dir, workload, limits, flag, device="cuda", dtype="bfloat16",
                                      with_client=False, launch_ahead=ahead)
                  for name, (flag, ahead) in variants.items()} if args.split else {}
    print(f"\n{torch.cuda.get_device_name()}: Qwen3-0.6B-shaped random weights, bf16, {args.requests} requests, "
          f"input {args.input_range}, output {args.output_range}, {workload.num_input_tokens} prompt tokens, "
          f"sampling {sampling}")
    sampled = args.temperature > 0  # unseeded: the outputs of two modes differ anyway
    print(f"{'mode':<14}{'seconds':>9}{'out tok':>9}{'tok/s':>9}{'vs first':>10}  "
          f"{'' if sampled else 'greedy vs first'}")
    for result in results:
        print(f"{result.name:<14}{result.seconds:>9.2f}{result.output_tokens:>9}{result.tokens_per_second:>9.0f}"
              f"{result.tokens_per_second / results[0].tokens_per_second:>9.2f}x  "
              f"{'' if sampled else first_difference(results[0].token_ids, result.token_ids)}")
    if splits:
        print("\nhost ms per steady decode step (in-process engine core; forward = launch or graph replay, the "
              "wait for the GPU is in logits+sample; 'finish first': async scheduling without launching step N+1 "
              "before step N's tokens reach the host)")
        print_table(("async", *PHASES, "core step"),
                    [(name, *(f"{split[p]:.2f}" for p in (*PHASES, "core step"))) for name, split in splits.items()])


if __name__ == "__main__":
    main()
