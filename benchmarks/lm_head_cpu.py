"""The fp32 LM head's greedy kernels on CPU side by side (csrc/greedy_head_ops.cpp): oneDNN's
matmul + argmax (`F.linear` over the plain weight), `greedy_head` (fp32 panels, the logits never written) and, on a CPU with
AVX-512 VNNI or AVX2, `greedy_head_screened` (int16 estimates with a proven bound, the candidates
recomputed). Random weights N(0, 0.05^2) and hidden states N(0, 1) at the tiny benchmark model's
head (128 -> 8,192) and the demo model's (576 -> 49,152), interleaved calls with the caches
evicted (32 MB written) before each; the screened tokens are checked equal to greedy_head's.

    python benchmarks/lm_head_cpu.py [--threads 2] [--repeats 15]
"""

from __future__ import annotations

import argparse

import torch
from benchlib import best_seconds

from vllm_lite import _custom_ops as cpu_native

CASES = ((1024, 128, 8192), (64, 128, 8192), (1, 576, 49152), (8, 576, 49152), (64, 576, 49152),
         (256, 576, 49152))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if not cpu_native.is_available():
        raise SystemExit("vllm_lite._C is not built (python setup.py build_ext --inplace)")
    torch.set_num_threads(args.threads)
    screen = cpu_native.head_screen_supported()
    print(f"{args.threads} threads, level {cpu_native.cpu_capability()}, int16 screen: {'yes' if screen else 'no'}; "
          f"best of {args.repeats} interleaved calls (ms)")
    print(f"{'rows x hidden -> vocab':>26}  {'oneDNN+argmax':>13}  {'greedy_head':>11}  {'screened':>8}  "
          f"{'screened speed-up':>17}")
    generator = torch.Generator().manual_seed(0)
    for rows, hidden, vocab in CASES:
        weight = torch.randn(vocab, hidden, generator=generator) * 0.05
        x = torch.randn(rows, hidden, generator=generator)
        panels = cpu_native.pack_head_panels(weight)
        calls = {"onednn": lambda: torch.nn.functional.linear(x, weight).argmax(dim=-1),
                 "greedy_head": lambda: cpu_native.greedy_head(x, panels, vocab)}
        expected = calls["greedy_head"]()  # (oneDNN sums in its own order: near ties may differ from it)
        if screen:
            codes, stats = cpu_native.pack_head_screen(weight)
            calls["screened"] = lambda: cpu_native.greedy_head_screened(x, panels, codes, stats, vocab)[0]
            if not torch.equal(calls["screened"](), expected):
                raise SystemExit(f"greedy_head_screened differs from greedy_head at {rows} x {hidden} -> {vocab}")
        ms = {name: 1e3 * seconds for name, seconds in best_seconds(calls, args.repeats, evict_bytes=32 << 20).items()}
        screened = f"{ms['screened']:8.2f}" if screen else f"{'-':>8}"
        ratio = f"{ms['greedy_head'] / ms['screened']:16.2f}x" if screen else f"{'-':>17}"
        print(f"{f'{rows} x {hidden} -> {vocab}':>26}  {ms['onednn']:13.2f}  {ms['greedy_head']:11.2f}  {screened}  {ratio}")


if __name__ == "__main__":
    main()
