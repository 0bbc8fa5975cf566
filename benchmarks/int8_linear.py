"""The int8 W8A8 linear (quantization="int8") on the demo model's four weight shapes, against the
packed linear it replaces (fp32, or bf16 where the CPU has it natively), with its two elementwise
ends fused in csrc and as the torch ops they replace.

Per shape and row count: the packed float linear (the engine's `linear`: on an AMX CPU its bf16
tiles up to 64 rows), `int8_linear` with the csrc ends, and
`int8_linear` with the torch ends (`_custom_ops.takes_layer_ops` switched off), the two int8
paths alternating call by call (layer_ops.time_both); medians.

    python benchmarks/int8_linear.py [--threads 2] [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from layer_ops import require_csrc, time_both

from vllm_lite.cpu_info import cpu_summary, has_native_bf16
from vllm_lite.model.layers.linear import linear, prepack
from vllm_lite.model.layers.quantization import Int8Weight, int8_linear

# (name, out features, in features) of the demo model's linear layers
SHAPES = (("qkv_proj", 960, 576), ("o_proj", 576, 576), ("gate_up_proj", 3072, 576), ("down_proj", 576, 1536))


def median_seconds(run, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    require_csrc(args.threads)
    dtype = torch.bfloat16 if has_native_bf16() else torch.float32
    print(f"{cpu_summary()}; {args.threads} threads; activations {dtype}")
    print(f"{'layer':>13} {'rows':>5} {'packed float (us)':>18} {'int8 csrc ends (us)':>20} "
          f"{'int8 torch ends (us)':>21} {'int8 vs float':>14} {'csrc vs torch ends':>19}")
    for name, out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features)
        packed = prepack(weight.to(dtype))
        quantized = Int8Weight.quantize(weight)
        for rows in (8, 64, 512, 2048):
            x = torch.randn(rows, in_features, dtype=dtype)
            repeats = args.repeats if rows <= 512 else max(5, args.repeats // 5)
            # (the engine's float path: oneDNN's packed matmul, AMX tiles at decode sizes on AMX CPUs)
            float_s = median_seconds(lambda: linear(x, weight, packed), repeats)
            fused_s, torch_s = time_both(lambda: int8_linear(x, quantized), repeats)
            print(f"{name:>13} {rows:>5} {float_s * 1e6:>18.1f} {fused_s * 1e6:>20.1f} {torch_s * 1e6:>21.1f} "
                  f"{float_s / fused_s:>13.2f}x {torch_s / fused_s:>18.2f}x")


if __name__ == "__main__":
    main()
