"""The CPU's half precisions side by side: the demo model's linear shapes through oneDNN's packed
matmul (what the engine runs for a float weight) in float32, bfloat16 and float16, at decode and
prefill row counts. On a CPU without AMX-FP16 the engine warns at start when dtype="float16" is
asked for (config._warn_slow_float16); this is the measurement behind it.

    python benchmarks/half_precision.py [--threads 2] [--repeats 50]
"""

from __future__ import annotations

import argparse

import torch
from int8_linear import SHAPES, median_seconds

from vllm_lite.cpu_info import cpu_summary, has_fast_fp16_matmul

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def packed_matmul_seconds(weight: torch.Tensor, rows: int, repeats: int) -> float:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    x = torch.randn(rows, weight.shape[1]).to(weight.dtype)
    return median_seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_summary()}; AMX-FP16: {'yes' if has_fast_fp16_matmul() else 'no'}; {args.threads} threads")
    print(f"{'layer':>13} {'rows':>5} {'fp32 (us)':>10} {'bf16 (us)':>10} {'fp16 (us)':>10} {'fp16 / bf16':>12} "
          f"{'fp16 / fp32':>12}")
    for name, out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features)
        for rows in (8, 128, 1024):
            repeats = args.repeats if rows <= 128 else max(5, args.repeats // 5)
            fp32, bf16, fp16 = (packed_matmul_seconds(weight.to(dtype), rows, repeats) for dtype in DTYPES)
            print(f"{name:>13} {rows:>5} {fp32 * 1e6:>10.1f} {bf16 * 1e6:>10.1f} {fp16 * 1e6:>10.1f} "
                  f"{fp16 / bf16:>11.2f}x {fp16 / fp32:>11.2f}x")


if __name__ == "__main__":
    main()
