"""An fp32 LM head on CPU, kept in the layout of the native LM-head kernels (csrc/greedy_head_ops.cpp)
in place of oneDNN's packed copy: the same weight bytes, and two entry points.

* logits: `head_logits`, for every step that samples from the distribution or returns logprobs;
* greedy tokens straight from the hidden states (`greedy_tokens`): an all-greedy step that asks
  for nothing else (no logprobs, penalties, bias, grammar, ...) never writes its logits. At 1,024
  rows of a small model's vocabulary the logits are 32 MB a step, written by the LM head and read
  back once by the argmax (benchmarks/RESULTS.md, twenty-fifth session). On a CPU with AVX-512
  VNNI or AVX2 the greedy tokens are screened first by int16 dot products with a proven error bound
  (`greedy_head_screened`: the same tokens, 1.3-1.9x faster where the bound is narrow), as long
  as the screen pays for the model's hidden states (`HeadScreen`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_lite import _custom_ops as cpu_native


# The screen pays while what it computes again costs well under what it saves (about half of
# greedy_head's time): its recomputation cost, averaged over the calls (exponentially, weight
# SCREEN_COST_WEIGHT for the latest), must stay below SCREEN_MAX_COST, judged from the
# SCREEN_TRIAL_CALLS-th call on. Random-weight models stay far below (0.1-0.15 at vocab 8,192);
# the demo model's hidden states, with a few activations 50x the rest, do not: their codes are
# coarse, the bound wide, the candidates many.
SCREEN_MAX_COST = 0.3
SCREEN_COST_WEIGHT = 0.25
SCREEN_TRIAL_CALLS = 8


@dataclass(slots=True)
class HeadScreen:
    """`pack_head_screen(weight)`: the weight's int16 codes and the column terms of the error
    bound, for `greedy_head_screened`; dropped (codes and stats released) once the screen is seen
    not to pay for this model's hidden states. Either way the tokens are greedy_head's."""

    codes: torch.Tensor | None
    stats: torch.Tensor | None
    calls: int = 0
    mean_cost: float = 0.0

    @property
    def active(self) -> bool:
        return self.codes is not None

    def record(self, cost: float) -> None:
        self.calls += 1
        self.mean_cost = cost if self.calls == 1 else (
            (1 - SCREEN_COST_WEIGHT) * self.mean_cost + SCREEN_COST_WEIGHT * cost)
        if self.calls >= SCREEN_TRIAL_CALLS and self.mean_cost > SCREEN_MAX_COST:
            self.codes = self.stats = None


@dataclass(frozen=True, slots=True)
class HeadPanels:
    """`panels`: `pack_head_panels(weight)`; `out_features`: the weight's rows (this rank's
    vocabulary slice); `screen`: the int16 screen of greedy steps, on CPUs with AVX-512 VNNI or AVX2
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

    def unpack(self) -> torch.Tensor:
        """The weight `pack` was given ([vocab, hidden]: the panels' entries back in rows)."""
        panels = self.panels
        return panels.permute(0, 2, 1).reshape(-1, panels.shape[1])[: self.out_features].contiguous()


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
    screen = weight.screen
    if screen is not None and screen.active:
        tokens, cost = cpu_native.greedy_head_screened(x.float(), weight.panels, screen.codes, screen.stats,
                                                       weight.out_features)
        screen.record(cost)
        return tokens
    return cpu_native.greedy_head(x.float(), weight.panels, weight.out_features)
