"""LoRA on a linear layer: out += scaling * (x @ A.T) @ B.T for the tokens of each request that
runs with an adapter, computed per adapter over its tokens (a batch has few adapters; the
matmuls of rank r cost r / out of the base layer's). vLLM's punica kernels do the same by
gathering each token's adapter; on a CPU grouping by adapter reads each adapter's weights once.

The step's grouping (`LoRAStep`) is one object the model runner fills before each forward pass
and every adapted layer reads: the linear layers take no per-step arguments, as vLLM's
punica wrapper is shared by its LoRA layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class LoRAWeights:
    """One adapter's update of one layer, this rank's part: out += (x @ a.T) @ b.T. The pieces
    of a fused layer (q, k and v; gate and up) are stacked: `a` holds every piece's rows, `b`
    places each piece's output rows in the layer's output (zeros elsewhere) with its scaling
    folded in."""

    a: torch.Tensor  # [sum of the pieces' ranks, in]
    b: torch.Tensor  # [out, sum of the pieces' ranks]


@dataclass(slots=True)
class LoRAStep:
    """The step's tokens by adapter: (adapter id, token rows) for each adapter in the step, rows a
    slice where they are consecutive (a batch with one adapter). Empty: no token has one."""

    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)


class LinearLoRA:
    """What an adaptable linear layer holds: the loaded adapters' weights on it, by adapter id,
    and the shared step grouping."""

    __slots__ = ("step", "weights")

    def __init__(self, step: LoRAStep) -> None:
        self.step = step
        self.weights: dict[int, LoRAWeights] = {}

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base layer's output for `x`) with each adapter's update added in place."""
        for adapter_id, rows in self.step.groups:
            weights = self.weights.get(adapter_id)
            if weights is None:  # (the adapter leaves this layer alone)
                continue
            if isinstance(rows, slice):
                out[rows].addmm_(x[rows] @ weights.a.T, weights.b.T)
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ weights.a.T) @ weights.b.T)
        return out
