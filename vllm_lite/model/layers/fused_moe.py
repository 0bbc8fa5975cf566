"""Mixture-of-experts MLP as one batched computation: a softmax top-k router, then every
(token, expert) assignment sorted by expert and run through a grouped matmul over the stacked
expert weights (`w13` [E, 2 * I, H] = gate and up, `w2` [E, H, I]) — no loop over experts.

Tensor parallelism splits every expert's intermediate dimension across ranks (as vLLM's
FusedMoE does): each rank computes a partial down projection for all tokens and one all-reduce
sums them. The router is replicated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.linear import ReplicatedLinear, _divide, materialize, narrow_loaded


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k]): softmax in fp32 over all
    experts, the top k, optionally renormalised to sum to one (Mixtral always; Qwen3-MoE per
    `norm_topk_prob`)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), expert_ids


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    expert_ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = expert_ids[t, k].

    Assignments are sorted by expert so each expert's rows are contiguous; `grouped_mm` takes the
    end offset of every expert's group (experts with no rows get an empty group)."""
    num_tokens, top_k = expert_ids.shape
    flat_experts = expert_ids.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    token_of_row = order // top_k
    # scatter_add, not bincount: bincount sizes its output from the data, a device-to-host sync in
    # every MoE layer of every step on CUDA.
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts, dtype=torch.int32))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = x[token_of_row]
    gate_up = F.grouped_mm(rows, w13.transpose(1, 2), offs=ends)
    gate, up = gate_up.chunk(2, dim=-1)
    down = F.grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=ends)
    down = down * weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, token_of_row, down)


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
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.shard, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.shard), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader

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
        return self.tp.all_reduce(grouped_experts(x, self.w13, self.w2, weights, expert_ids))
