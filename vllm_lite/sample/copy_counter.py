"""Counts the tensors of the logits' size that the sampler allocates: the measure behind
"an all-greedy batch makes no copy of the logits" (used by the sampler benchmark and tests)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LogitsCopyCounter(TorchDispatchMode):
    """Within the `with` block, records every op whose output is a new tensor (not a view or
    in-place result of an input) with at least `numel` elements. `ops` counts them by op name."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.numel = logits.numel()
        self.ops: Counter[str] = Counter()

    @property
    def num_copies(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if (isinstance(tensor, torch.Tensor) and tensor.numel() >= self.numel
                    and tensor.untyped_storage().data_ptr() not in inputs):
                self.ops[func.overloadpacket.__name__] += 1
        return out
