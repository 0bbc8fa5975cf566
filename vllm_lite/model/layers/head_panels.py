"""An fp32 LM head on CPU, kept in the layout of the native LM-head kernels (csrc/greedy_head_ops.cpp)
in place of oneDNN's packed copy: the same weight bytes, and two entry points.

* logits: `head_logits`, for every step that samples from the distribution or returns logprobs;
* greedy tokens straight from the hidden states (`greedy_tokens`): an all-greedy step that asks
  for nothing else (no logprobs, penalties, bias, grammar, ...) never writes its logits. At 1,024
  rows of a small model's vocabulary the logits are 32 MB a step, written by the LM head and read
  back once by the argmax (benchmarks/RESULTS.md, twenty-fifth session).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_lite import _custom_ops as cpu_native


@dataclass(frozen=True, slots=True)
class HeadScreen:
    """`pack_head_screen(weight)`: the weight's int16 codes and the column terms of the error
    bound, for `greedy_head_screened`."""

    codes: torch.Tensor
    stats: torch.Tensor


@dataclass(frozen=True, slots=True)
class HeadPanels:
    """`panels`: `pack_head_panels(weight)`; `out_features`: the weight's rows (this rank's
    vocabulary slice); `screen`: the int16 screen of greedy steps, on CPUs with AVX-512 VNNI
    (half the head's fp32 bytes again; greedy steps then read half the bytes and do half the
    multiply instructions), else None."""

    panels: torch.Tensor
    out_features: int
    screen: HeadScreen | None = None

    @staticmethod
    def pack(weight: torch.Tensor) -> HeadPanels:
        weight = weight.detach()
        screen = None
        if cpu_native.head_screen_supported() and bool(torch.isfinite(weight).all()):
            screen = HeadScreen(*cpu_native.pack_head_screen(weight))
        return HeadPanels(cpu_native.pack_head_panels(weight), weight.shape[0], screen)


def head_panels_usable(weight: torch.Tensor) -> bool:
    """Whether an LM head weight runs on the native LM-head kernels: float32 on CPU, with the
    extension built and running at AVX2 or AVX-512 (else oneDNN's packed copy, as the other
    linear layers: the kernels' 4-lane baseline build ran 4-5x slower than oneDNN)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and cpu_native.is_available()
            and cpu_native.cpu_capability() != "default")


def head_linear(x: torch.Tensor, weight: HeadPanels, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight)` for x `[..., hidden]` (an LM head has no bias)."""
    if bias is not None:
        raise ValueError("an LM head kept as HeadPanels has no bias")
    flat = x.reshape(-1, x.shape[-1]).float()
    return cpu_native.head_logits(flat, weight.panels, weight.out_features).view(*x.shape[:-1], weight.out_features)


def greedy_tokens(x: torch.Tensor, weight: HeadPanels) -> torch.Tensor:
    """The argmax of `head_linear(x, weight)` over its last dimension (first maximum), int64
    `[rows]` for x `[rows, hidden]`, the logits never written."""
    if weight.screen is not None:
        return cpu_native.greedy_head_screened(x.float(), weight.panels, weight.screen.codes, weight.screen.stats,
                                               weight.out_features)
    return cpu_native.greedy_head(x.float(), weight.panels, weight.out_features)
