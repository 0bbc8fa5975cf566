"""Mixture-of-experts MLP as one batched computation: a softmax top-k router, then every
(token, expert) assignment sorted by expert and run through a grouped matmul over the stacked
expert weights (`w13` [E, 2 * I, H] = gate and up, `w2` [E, H, I]) — no loop over experts.

Tensor parallelism splits every expert's intermediate dimension across ranks (as vLLM's
FusedMoE does): each rank computes a partial down projection for all tokens and one all-reduce
sums them. The router is replicated.

quantization="int8" makes every expert's two projections int8 layers (layers/quantization.py:
per output channel, activations per token); the rows of each expert then take one int8 matmul
each, as torch has no grouped int8 matmul. The router stays in the model dtype (vLLM's rule for
every quantization: routing from rounded logits would pick other experts).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.linear import ReplicatedLinear, _divide, materialize, narrow_loaded
from vllm_lite.model.layers.quantization import Int8Weight, int8_linear


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k]): softmax in fp32 over all
    experts, the top k, optionally renormalised to sum to one (Mixtral always; Qwen3-MoE per
    `norm_topk_prob`)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), expert_ids


def sorted_assignments(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (token, expert) assignment sorted by expert, so each expert's rows are contiguous:
    (the order of the flat assignments, the token of each sorted row, the rows per expert)."""
    top_k = expert_ids.shape[1]
    flat_experts = expert_ids.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    # scatter_add, not bincount: bincount sizes its output from the data, a device-to-host sync in
    # every MoE layer of every step on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.int32, device=expert_ids.device)
    counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts, dtype=torch.int32))
    return order, order // top_k, counts


def combined(x: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
             token_of_row: torch.Tensor) -> torch.Tensor:
    """Each token's sum of its experts' outputs (`down`, sorted rows), weighted by the router."""
    down = down * weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, token_of_row, down)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    expert_ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = expert_ids[t, k].

    `grouped_mm` takes the end offset of every expert's group of sorted rows (experts with no
    rows get an empty group)."""
    order, token_of_row, counts = sorted_assignments(expert_ids, w13.shape[0])
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    gate_up = F.grouped_mm(x[token_of_row], w13.transpose(1, 2), offs=ends)
    gate, up = gate_up.chunk(2, dim=-1)
    down = F.grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=ends)
    return combined(x, down, weights, order, token_of_row)


def per_expert_int8(rows: torch.Tensor, experts: list[Int8Weight], counts: list[int]) -> torch.Tensor:
    """Each expert's int8 layer over its contiguous group of `rows` (`counts[e]` rows)."""
    out = rows.new_empty(rows.shape[0], experts[0].scale.shape[0])
    start = 0
    for expert, count in enumerate(counts):
        if count:
            out[start:start + count] = int8_linear(rows[start:start + count], experts[expert])
            start += count
    return out


def grouped_int8_experts(x: torch.Tensor, w13: list[Int8Weight], w2: list[Int8Weight], weights: torch.Tensor,
                         expert_ids: torch.Tensor) -> torch.Tensor:
    """`grouped_experts` with each expert's projections int8 (CPU: the counts are read on the host)."""
    order, token_of_row, counts = sorted_assignments(expert_ids, len(w13))
    rows_per_expert = counts.tolist()
    gate, up = per_expert_int8(x[token_of_row], w13, rows_per_expert).chunk(2, dim=-1)
    down = per_expert_int8(F.silu(gate) * up, w2, rows_per_expert)
    return combined(x, down, weights, order, token_of_row)


class FusedMoE(nn.Module):
    # F.grouped_mm copied between host and device under CUDA graph capture (H200, torch 2.11, fp32).
    cuda_graph_capturable = False
    # A padded row would be routed to experts and computed (ModelRunner._padded_to_bucket): the
    # CPU runner leaves a model with this layer unpadded (its linears pad their own inputs).
    takes_padded_rows = False

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.shard = _divide(intermediate_size, tp.size, "moe intermediate_size")
        self.gate = RouterLinear(hidden_size, num_experts)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.shard, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.shard), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        # quantization="int8": each expert's (gate_up, down) int8 layers; w13 / w2 then meta
        self.int8_experts: tuple[list[Int8Weight], list[Int8Weight]] | None = None
        # a W8A8 checkpoint's scales of w13 / w2 ([experts, rows] each) until the weights are placed
        self.int8_row_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def quantize_int8(self) -> None:
        """quantization="int8": every expert's projections become int8 layers (the float stacks
        released, their shapes kept); the router stays as it is."""
        self._use_int8_experts([Int8Weight.quantize(w) for w in self.w13], [Int8Weight.quantize(w) for w in self.w2])

    def use_int8_weights(self, w13_scales: torch.Tensor, w2_scales: torch.Tensor) -> None:
        """A W8A8 checkpoint's experts (model/loader.py): w13 and w2 hold its int8 values (loaded
        as floats, exactly; kept int8 until `process_weights_after_loading`), the scales one per
        output row of each expert ([experts, rows])."""
        self.w13 = nn.Parameter(self.w13.detach().to(torch.int8), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.detach().to(torch.int8), requires_grad=False)
        self.int8_row_scales = (w13_scales, w2_scales)

    def process_weights_after_loading(self) -> None:
        """A W8A8 checkpoint's int8 experts become the int8 layers quantization="int8" makes."""
        if self.int8_row_scales is None:
            return
        (w13_scales, w2_scales), self.int8_row_scales = self.int8_row_scales, None
        self._use_int8_experts([Int8Weight.of(w, s) for w, s in zip(self.w13.detach(), w13_scales)],
                               [Int8Weight.of(w, s) for w, s in zip(self.w2.detach(), w2_scales)])

    def _use_int8_experts(self, w13: list[Int8Weight], w2: list[Int8Weight]) -> None:
        self.int8_experts = (w13, w2)
        self.w13 = nn.Parameter(torch.empty_like(self.w13, device="meta"), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty_like(self.w2, device="meta"), requires_grad=False)

    def row_scale_loader(self, scales: torch.Tensor, loaded: torch.Tensor, shard_id: tuple[str, int | None]) -> None:
        """A W8A8 checkpoint's scales of one expert's projection (one per output row) into
        `scales [experts, rows]`, sliced as its weight's rows are: gate / up rows are this rank's
        part of the intermediate dimension, down's rows (the hidden size) are whole on every rank."""
        which, expert = shard_id
        if expert is None:
            raise ValueError("checkpoint: int8 experts stacked in one tensor are not implemented (one tensor per "
                             "expert and projection is)")
        if which == "down":
            scales[expert].copy_(loaded)
            return
        self.weight_loader(scales, loaded, shard_id)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: tuple[str, int | None]) -> None:
        """shard_id = (which, expert): which is "gate" / "up" (rows of w13) or "down" (w2); each
        rank reads its slice of the intermediate dimension. Expert None: every expert's in one
        tensor (`_load_stacked`)."""
        which, expert = shard_id
        if expert is None:
            self._load_stacked(param, loaded, which)
            return
        start = self.tp.rank * self.shard
        if which == "down":
            param.data[expert].copy_(materialize(narrow_loaded(loaded, 1, start, self.shard)))
            return
        offset = 0 if which == "gate" else self.shard
        param.data[expert, offset:offset + self.shard].copy_(materialize(narrow_loaded(loaded, 0, start, self.shard)))

    def _load_stacked(self, param: nn.Parameter, loaded: Any, which: str) -> None:
        """Qwen3-VL-MoE's stacked experts, [experts, in, out] as its checkpoints hold them:
        gate_up [experts, hidden, 2 x intermediate] (gate columns, then up) into w13, down
        [experts, intermediate, hidden] into w2, each rank's slice of the intermediate dimension."""
        experts, hidden = param.shape[0], self.w2.shape[1]
        intermediate = self.shard * self.tp.size
        shape = tuple(loaded.shape if isinstance(loaded, torch.Tensor) else loaded.get_shape())
        expected = (experts, hidden, 2 * intermediate) if which == "gate_up" else (experts, intermediate, hidden)
        if shape != expected:
            raise ValueError(f"stacked experts' {which} tensor of shape {list(shape)}: expected {list(expected)} "
                             "([experts, in, out])")
        start = self.tp.rank * self.shard
        if which == "down":
            param.data.copy_(materialize(narrow_loaded(loaded, 1, start, self.shard)).transpose(1, 2))
            return
        for offset, first in ((0, start), (self.shard, intermediate + start)):  # (gate rows, then up rows)
            param.data[:, offset:offset + self.shard].copy_(
                materialize(narrow_loaded(loaded, 2, first, self.shard)).transpose(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = route(self.gate(x), self.top_k, self.renormalize)
        if self.int8_experts is not None:
            return self.tp.all_reduce(grouped_int8_experts(x, *self.int8_experts, weights, expert_ids))
        return self.tp.all_reduce(grouped_experts(x, self.w13, self.w2, weights, expert_ids))


class RouterLinear(ReplicatedLinear):
    """An MoE router (or a shared expert's gate): the whole weight on every rank, kept in the
    model dtype under quantization="int8" (vLLM quantizes no router: routing from rounded logits
    would pick other experts)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__(input_size, output_size, bias=False)

    def quantize_int8(self) -> None:
        """Left in the model dtype (the class's rule); packed for the CPU matmul as any layer."""
