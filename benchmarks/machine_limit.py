"""Benchmark 5: the machine's limit, and how close the demo model gets to it, per precision.

Measures matmul peaks (a large square product: fp32 and bf16 `torch.mm`, int8 `torch._int_mm`
with int32 accumulation) and memory bandwidth (reading and copying a 512 MiB tensor) with the
given threads, then runs vllm_lite on the demo model at each precision:

* throughput: benchmark 1's workload (64 requests, inputs 64-512, outputs 64-256, greedy);
  FLOPs = 2 x parameters per processed token (prompt and output tokens both), set against the
  peak of the precision the linear layers compute in;
* single-stream decode: 1 request, 128 output tokens; each step reads every weight once, so
  tokens/s x weight bytes is the bandwidth decode reaches;
* the workload's floor: what no engine can go below on this machine with these weights and a
  KV cache of the model's dtype, i.e. every decode step reading every weight and every active
  sequence's K/V once at the measured read bandwidth, plus every prompt token's matmuls at the
  precision's matmul peak (prefill attention and everything else taken as free), against the
  measured time.

    python benchmarks/machine_limit.py [--threads 2] [--num-requests 64] [--precision float32 bfloat16 int8]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from benchlib import (EngineLimits, RunResult, Workload, count_parameters, demo_model, engine_job, machine_line,
                      print_table, random_workload, run_engine, write_results)

from vllm_lite.config import HFModelConfig
from vllm_lite.cpu_info import has_native_bf16

# precision -> (engine arguments, bytes per weight, name of the matmul peak it runs at)
PRECISIONS = {
    "float32": ({"dtype": "float32"}, 4, "float32"),
    "bfloat16": ({"dtype": "bfloat16"}, 2, "bfloat16"),
    # activations in bf16 where the CPU has it natively, else fp32 (bf16 would be emulated)
    "int8": ({"dtype": "bfloat16" if has_native_bf16() else "float32", "quantization": "int8"}, 1, "int8"),
}


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_flops(dtype: str, n: int = 2048, repeats: int = 10) -> float:
    """Multiply-adds x 2 per second of one large square product in `dtype`."""
    if dtype == "int8":
        a = torch.randint(-127, 128, (n, n), dtype=torch.int8)
        b = torch.randint(-127, 128, (n, n), dtype=torch.int8)
        return 2 * n ** 3 / best_of(lambda: torch._int_mm(a, b), repeats)
    a, b = torch.randn(n, n, dtype=getattr(torch, dtype)), torch.randn(n, n, dtype=getattr(torch, dtype))
    out = torch.empty(n, n, dtype=a.dtype)
    return 2 * n ** 3 / best_of(lambda: torch.mm(a, b, out=out), repeats)


def memory_bandwidth(num_bytes: int = 512 * 1024 ** 2, repeats: int = 10) -> tuple[float, float]:
    """(read bytes/s, copy bytes/s counting read + write)."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    read = num_bytes / best_of(lambda: src.sum(), repeats)
    copy = 2 * num_bytes / best_of(lambda: dst.copy_(src), repeats)
    return read, copy


def model_config(model: Path) -> HFModelConfig:
    """The model's config.json as the engine reads it (head_dim and KV heads resolved)."""
    return HFModelConfig.from_dict(json.loads((model / "config.json").read_text()), {})


def kv_bytes_per_token(config: HFModelConfig, dtype_size: int) -> int:
    """K and V of one token in every layer, in a cache of the model's dtype."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_size


def workload_floor_s(workload: Workload, weight_bytes: float, kv_token_bytes: int, read_bw: float,
                     flops_per_token: float, peak: float) -> float:
    """Seconds no engine can beat: decode steps (all requests decode together, as after their
    prefill; a request leaves after its outputs) each read every weight and each active
    sequence's K/V once; prompt tokens cost their matmul FLOPs at the peak."""
    prompt_lens = np.array([len(prompt) for prompt in workload.prompts])
    output_lens = np.array(workload.max_tokens)
    decode_bytes = 0.0
    for step in range(int(output_lens.max())):
        active = output_lens > step
        decode_bytes += weight_bytes + kv_token_bytes * float((prompt_lens[active] + step).sum())
    return decode_bytes / read_bw + flops_per_token * float(prompt_lens.sum()) / peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--precision", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peaks = {name: matmul_flops(name) for name in ("float32", "bfloat16", "int8")}
    read_bw, copy_bw = memory_bandwidth()

    model = demo_model()
    params = count_parameters(model)
    limits = EngineLimits(max_model_len=768, max_num_seqs=256, max_num_batched_tokens=2048, kv_cache_gib=2,
                          threads=args.threads)
    workload = random_workload(args.num_requests, (64, 512), (64, 256), vocab_size=49152)
    single = Workload(workload.prompts[:1], [128])

    rows = [(f"{name} matmul (2048^3)", f"{flops / 1e9:.1f} GFLOP/s", "", "") for name, flops in peaks.items()]
    rows += [("memory read (512 MiB sum)", f"{read_bw / 1e9:.1f} GB/s", "", ""),
             ("memory copy (512 MiB, read+write)", f"{copy_bw / 1e9:.1f} GB/s", "", "")]
    report = {"args": vars(args), "matmul_flops": peaks, "read_bytes_per_s": read_bw, "copy_bytes_per_s": copy_bw,
              "parameters": params, "precisions": {}}
    for precision in args.precision:
        engine_args, weight_size, peak_name = PRECISIONS[precision]
        throughput = run_engine("vllm_lite", "vllm_lite_run.py", engine_job(model, workload, limits, **engine_args))
        decode = run_engine("vllm_lite", "vllm_lite_run.py", engine_job(model, single, limits, **engine_args))
        entry = report["precisions"][precision] = {}
        if isinstance(throughput, RunResult):
            processed = throughput.input_tokens + throughput.output_tokens
            achieved = 2 * params * processed / throughput.elapsed_s
            rows.append((f"{precision}: demo model, {args.num_requests} requests",
                         f"{throughput.tokens_per_s:.1f} output tok/s", f"{achieved / 1e9:.1f} GFLOP/s",
                         f"{achieved / peaks[peak_name]:.0%} of {peak_name} matmul peak"))
            kv_size = 2 if engine_args["dtype"] == "bfloat16" else 4
            config = model_config(model)
            # A prompt token's matmuls: every weight but the embedding (the LM head runs for
            # sampled positions only).
            prompt_flops = 2 * (params - config.vocab_size * config.hidden_size)
            floor = workload_floor_s(workload, weight_size * params, kv_bytes_per_token(config, kv_size), read_bw,
                                     prompt_flops, peaks[peak_name])
            measured = throughput.elapsed_s
            rows.append((f"{precision}: floor of that workload", f"{floor:.1f} s", f"measured {measured:.1f} s",
                         f"{floor / measured:.0%} of the floor's speed"))
            entry["throughput"] = {"tokens_per_s": throughput.tokens_per_s, "flops": achieved,
                                   "elapsed_s": throughput.elapsed_s, "floor_s": floor}
        if isinstance(decode, RunResult):
            # The embedding and LM head stay in the model dtype under int8; counted at weight_size
            # (a lower bound on the bytes read).
            reached = decode.tokens_per_s * weight_size * params
            rows.append((f"{precision}: demo model, 1 request decode", f"{decode.tokens_per_s:.1f} output tok/s",
                         f"{reached / 1e9:.1f} GB/s of weights", f"{reached / read_bw:.0%} of read bandwidth"))
            entry["single_decode"] = {"tokens_per_s": decode.tokens_per_s, "weight_bytes_per_s": reached}
    write_results("machine_limit", report)
    print(machine_line())
    print(f"demo model: {params / 1e6:.1f} M parameters; {args.threads} threads\n")
    print_table(("measure", "value", "work rate", "fraction"), rows)


if __name__ == "__main__":
    main()
