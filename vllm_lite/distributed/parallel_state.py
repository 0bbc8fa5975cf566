"""The tensor-parallel group a model is built for, passed down explicitly (no global state)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE_RANK = TensorParallelGroup()


def init_tensor_parallel_group(store: dist.Store, rank: int, world_size: int,
                               device: str) -> TensorParallelGroup:
    """Join the default process group through `store` (gloo on CPU, NCCL on CUDA)."""
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    return TensorParallelGroup(rank=rank, size=world_size, group=dist.group.WORLD)
