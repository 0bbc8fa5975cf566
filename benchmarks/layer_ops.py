"""The fused csrc decoder-layer ops against the torch ops they replace, per decoder layer, on the
demo model's shapes (hidden 576, 9 query / 3 KV heads of 64, intermediate 1,536).

One layer's elementwise work: two residual-add + RMSNorm, rotary on q and k, SiLU-and-mul. Both
paths run in the same process through the same layer modules (`_custom_ops.takes_layer_ops`
switched off for the torch path), alternating call by call, so a load that comes and goes hits
both alike; the median of each is reported.

    python benchmarks/layer_ops.py [--dtype bfloat16] [--threads 2] [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_lite import _custom_ops as ops
from vllm_lite.model.layers.activation import SiluAndMul
from vllm_lite.model.layers.norm import RMSNorm
from vllm_lite.model.layers.rotary import RotaryEmbedding

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536


def layer_elementwise(tokens: int, dtype: torch.dtype):
    """A closure running one layer's elementwise ops on fresh copies of fixed inputs."""
    norm = RMSNorm(HIDDEN, 1e-5).to(dtype)
    rotary = RotaryEmbedding(HEAD_DIM, 2048, 10000.0, None).to(dtype)
    act = SiluAndMul()
    hidden, residual = torch.randn(tokens, HIDDEN, dtype=dtype), torch.randn(tokens, HIDDEN, dtype=dtype)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, dtype=dtype)
    positions = torch.randint(0, 2048, (tokens,))

    def run() -> None:
        h, r = norm(hidden.clone(), residual.clone())
        q, k, _ = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        rotary(positions, q.view(tokens, HEADS, HEAD_DIM), k.view(tokens, KV_HEADS, HEAD_DIM))
        h, r = norm(h, r)
        act(gate_up)

    return run


def require_csrc(threads: int) -> None:
    """A benchmark of csrc ops: exits when the extension is not built, else runs on `threads`."""
    if not ops.is_available():
        raise SystemExit("vllm_lite._C is not built (make setup)")
    torch.set_num_threads(threads)


def time_both(run, repeats: int) -> tuple[float, float]:
    """Median seconds of (fused, torch), alternating."""
    fused, reference = [], []
    original = ops.takes_layer_ops
    for _ in range(repeats):
        for samples, switch in ((fused, original), (reference, lambda x: False)):
            ops.takes_layer_ops = switch
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
    ops.takes_layer_ops = original
    return statistics.median(fused), statistics.median(reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    require_csrc(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"{'tokens':>7} {'fused (us)':>11} {'torch (us)':>11} {'speed-up':>9}")
    for tokens in (1, 32, 256, 2048):
        run = layer_elementwise(tokens, dtype)
        run()
        fused, reference = time_both(run, args.repeats if tokens < 2048 else args.repeats // 4)
        print(f"{tokens:>7} {fused * 1e6:>11.1f} {reference * 1e6:>11.1f} {reference / fused:>8.2f}x")


if __name__ == "__main__":
    main()
