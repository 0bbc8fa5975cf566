"""LoRA on a linear layer: out += scaling * (x @ A.T) @ B.T, each token with its request's adapter.

Two forms, chosen per step (`LoRAStep`):
- every token runs with one adapter: its two matmuls over the step's rows;
- otherwise (several adapters, or some tokens on the base model): the step's adapters stacked,
  `x @ A_all.T` for every token, the columns of other adapters zeroed by a [tokens, ranks] mask,
  then one matmul with B_all. Four operations a layer whatever the number of adapters (vLLM's
  punica kernels gather each token's adapter instead; on a CPU a gather and a scatter per adapter
  and layer cost more than the few extra columns: four adapters mixed 1.9x faster than with a
  gather per adapter, benchmarks/lora_serving.py).

The step's grouping is one object the model runner fills before each forward pass and every
adapted layer reads: the linear layers take no per-step arguments, as vLLM's LoRA layers share its
punica wrapper."""

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
    """The step's adapters. `adapters`: their ids, ascending (empty: no token has one);
    `whole`: the one adapter every token runs with (0: not so); `token_adapters`: each token's
    adapter id (0: none; int32 on the device), for the mixed form; `masks`: the mixed form's
    column masks made this step, by (column layout, rows)."""

    adapters: tuple[int, ...] = ()
    whole: int = 0
    num_tokens: int = 0
    token_adapters: torch.Tensor | None = None
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def mask(self, layout: tuple[tuple[int, int], ...], columns: torch.Tensor, rows: int,
             dtype: torch.dtype) -> torch.Tensor:
        """[rows, ranks]: 1 where a token's adapter owns the column (rows past the step's tokens,
        the padding, are 0). Made once per step for each layout (adapters and their ranks)."""
        key = (layout, rows, dtype)
        mask = self.masks.get(key)
        if mask is None:
            tokens = self.token_adapters
            if rows > len(tokens):
                tokens = torch.nn.functional.pad(tokens, (0, rows - len(tokens)))
            mask = (tokens[:rows, None] == columns[None, :]).to(dtype)
            self.masks[key] = mask
        return mask


@dataclass(slots=True)
class _Stacked:
    """A layer's weights of the step's adapters, stacked for the mixed form."""

    layout: tuple[tuple[int, int], ...]  # (adapter id, its rank here), in column order
    a: torch.Tensor  # [sum of ranks, in]
    b: torch.Tensor  # [out, sum of ranks]
    columns: torch.Tensor  # int32 [sum of ranks]: each column's adapter id


class LinearLoRA:
    """What an adaptable linear layer holds: the loaded adapters' weights on it, by adapter id,
    and the shared step grouping. `stacked` keeps the mixed form's weights for the last set of
    adapters (a step's set changes only when requests come and go)."""

    __slots__ = ("step", "weights", "_stacked")

    def __init__(self, step: LoRAStep) -> None:
        self.step = step
        self.weights: dict[int, LoRAWeights] = {}
        self._stacked: tuple[tuple[int, ...], _Stacked | None] | None = None

    def set_weights(self, adapter_id: int, weights: LoRAWeights | None) -> None:
        if weights is None:
            self.weights.pop(adapter_id, None)
        else:
            self.weights[adapter_id] = weights
        self._stacked = None

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base layer's output for `x`, [rows, out]) with the adapters' updates added in place."""
        step = self.step
        if not step.adapters:
            return out
        if step.whole:
            weights = self.weights.get(step.whole)
            if weights is not None:
                rows = slice(0, step.num_tokens)
                out[rows].addmm_(x[rows] @ weights.a.T, weights.b.T)
            return out
        stacked = self._stacked_for(step.adapters)
        if stacked is None:  # (no adapter of the step changes this layer)
            return out
        shrunk = x @ stacked.a.T
        shrunk.mul_(step.mask(stacked.layout, stacked.columns, x.shape[0], shrunk.dtype))
        return out.addmm_(shrunk, stacked.b.T)

    def _stacked_for(self, adapters: tuple[int, ...]) -> _Stacked | None:
        if self._stacked is not None and self._stacked[0] == adapters:
            return self._stacked[1]
        present = [(adapter_id, self.weights[adapter_id]) for adapter_id in adapters if adapter_id in self.weights]
        stacked = None
        if present:
            layout = tuple((adapter_id, w.a.shape[0]) for adapter_id, w in present)
            columns = torch.tensor([adapter_id for adapter_id, rank in layout for _ in range(rank)],
                                   dtype=torch.int32, device=present[0][1].a.device)
            stacked = _Stacked(layout, torch.cat([w.a for _, w in present]), torch.cat([w.b for _, w in present], 1),
                               columns)
        self._stacked = (adapters, stacked)
        return stacked
