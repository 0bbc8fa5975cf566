"""Custom logits processors (vllm_lite.logits_processor) as the sampler applies them: vLLM's
order, the ones that can change an argmax after logit_bias and before the penalties, the others
(argmax-invariant) after temperature and min-p, for random rows only."""

from __future__ import annotations

import torch

from vllm_lite.logits_processor import LogitsProcessor


class CustomLogitsStep:
    """What the sampler applies: the processors, with the logits' rows placed in the batch."""

    __slots__ = ("non_argmax_invariant", "argmax_invariant", "batch_rows", "batch_size")

    def __init__(self, non_argmax_invariant: list[LogitsProcessor], argmax_invariant: list[LogitsProcessor],
                 batch_rows: torch.Tensor | None, batch_size: int) -> None:
        self.non_argmax_invariant = non_argmax_invariant
        self.argmax_invariant = argmax_invariant
        self.batch_rows = batch_rows  # None: logits row i is batch row i
        self.batch_size = batch_size

    def apply(self, logits: torch.Tensor, processors: list[LogitsProcessor]) -> None:
        """`processors` over `logits` (float32, edited in place) as the batch's rows: a batch
        whose rows do not all sample is padded to its size (rows that do not sample are zeros)."""
        if not processors:
            return
        rows = self.batch_rows
        full = logits
        if rows is not None:
            full = logits.new_zeros((self.batch_size, logits.shape[1]))
            full[rows] = logits
        processed = full
        for processor in processors:
            processed = processor.apply(processed)
        if rows is not None:
            logits.copy_(processed[rows])
        elif processed is not logits:
            logits.copy_(processed)
