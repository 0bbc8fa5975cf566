"""An MoE layer's experts under quantization="int8" (one int8 matmul per expert with rows in the
step) against the same layer in the model dtype (two grouped matmuls over the stacked experts),
for two expert shapes: Mixtral-like (8 experts, top-2, wide) and Qwen3-MoE-like (64 experts,
top-8, narrow), at decode and prefill row counts. The router stays in the model dtype in both.

    python benchmarks/moe_int8.py [--threads 2] [--repeats 20]
"""

from __future__ import annotations

import argparse

import torch
from int8_linear import median_seconds

from vllm_lite.cpu_info import cpu_summary, has_native_bf16
from vllm_lite.model.layers.fused_moe import FusedMoE

# (name, experts, top-k, hidden, intermediate per expert)
SHAPES = (("8 x top-2", 8, 2, 1024, 2816), ("64 x top-8", 64, 8, 1024, 512))


def layer_pair(experts: int, top_k: int, hidden: int, intermediate: int,
               dtype: torch.dtype) -> tuple[FusedMoE, FusedMoE]:
    """The float layer and its int8 copy (same weights), their routers packed as at load."""
    torch.manual_seed(0)
    layers = [FusedMoE(experts, top_k, hidden, intermediate, renormalize=True) for _ in range(2)]
    for param in (layers[0].gate.weight, layers[0].w13, layers[0].w2):
        param.data.normal_(0, 0.02)
    layers[1].load_state_dict(layers[0].state_dict())
    layers = [layer.to(dtype) for layer in layers]
    layers[1].quantize_int8()
    for layer in layers:
        layer.gate.process_weights_after_loading()
    return layers[0], layers[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if has_native_bf16() else torch.float32
    print(f"{cpu_summary()}; {args.threads} threads; activations {dtype}")
    print(f"{'experts':>11} {'rows':>5} {'float (ms)':>11} {'int8 (ms)':>10} {'float / int8':>13}")
    for name, experts, top_k, hidden, intermediate in SHAPES:
        float_layer, int8_layer = layer_pair(experts, top_k, hidden, intermediate, dtype)
        for rows in (1, 16, 256):
            x = torch.randn(rows, hidden, dtype=dtype)
            times = []
            with torch.no_grad():
                for layer in (float_layer, int8_layer):
                    layer(x)  # warm-up
                    times.append(median_seconds(lambda: layer(x), args.repeats))
            print(f"{name:>11} {rows:>5} {times[0] * 1e3:>11.2f} {times[1] * 1e3:>10.2f} {times[0] / times[1]:>12.2f}x")


if __name__ == "__main__":
    main()
