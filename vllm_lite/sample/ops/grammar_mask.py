"""Structured outputs: the grammar bitmask applied to the constrained rows' logits.

Bitmask layout (xgrammar's, the engine core fills it): int32 [m, ceil(vocab / 32)], bit
`t % 32` of word `t // 32` set = token `t` allowed. Only the m constrained rows are touched;
a batch without them never reaches this module. The csrc op (`_custom_ops.
apply_token_bitmask_inplace`) does it for float32 CPU logits; the torch code is the fallback
and the reference it is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_lite import _custom_ops as cpu_native


@dataclass(slots=True)
class GrammarBitmask:
    logits_rows: torch.Tensor  # int64 [m] rows of the logits the bitmask rows belong to
    bitmask: torch.Tensor  # int32 [m, ceil(vocab / 32)]


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarBitmask) -> None:
    """Set the disallowed tokens of the constrained rows to -inf, in place."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1
            and cpu_native.is_available()):
        cpu_native.apply_token_bitmask_inplace(logits, grammar.bitmask.contiguous(), grammar.logits_rows)
        return
    apply_grammar_bitmask_torch(logits, grammar)


def apply_grammar_bitmask_torch(logits: torch.Tensor, grammar: GrammarBitmask) -> None:
    """The fallback: one vectorized unpack of the bits, one masked fill over the m rows."""
    vocab = logits.shape[1]
    bitmask = grammar.bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).to(torch.bool).flatten(1)
    if allowed.shape[1] < vocab:  # logits padded past the tokenizer's vocabulary: never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    rows = grammar.logits_rows
    logits[rows] = logits[rows].masked_fill_(~allowed[:, :vocab], float("-inf"))
