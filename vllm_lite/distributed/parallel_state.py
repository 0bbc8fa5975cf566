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

    def union_of_failures(self, failed: dict[str, str] | None) -> dict[str, str] | None:
        """Every rank's {request id: why} merged, on every rank: the requests a rank could not
        take into its batch must leave every rank's batch before the forward pass, or the ranks'
        collectives would disagree on the number of tokens. One one-element all-reduce per call;
        the dictionaries travel only when some rank has a failure."""
        if self.size == 1:
            return failed
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        any_failed = torch.tensor([1 if failed else 0], dtype=torch.int32, device=device)
        dist.all_reduce(any_failed, op=dist.ReduceOp.MAX, group=self.group)
        if not any_failed.item():
            return None
        every_rank: list[dict[str, str] | None] = [None] * self.size
        dist.all_gather_object(every_rank, failed, group=self.group)
        return {req_id: why for part in every_rank if part for req_id, why in part.items()}


SINGLE_RANK = TensorParallelGroup()


def join_launcher_group(tp_size: int, device: str) -> tuple[TensorParallelGroup, bool]:
    """vLLM's external_launcher: this process (one of torchrun's, or of a job that has its own
    process group) is one rank of an engine of `tp_size` consecutive ranks of the world. Joins
    the world first where nobody has (torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT);
    every rank makes every engine's group, in order, as torch.distributed requires. Returns the
    group and whether this call joined the world (and so leaves it at shutdown)."""
    if tp_size == 1:
        return SINGLE_RANK, False
    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method="env://")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp_size:
        raise ValueError(f"distributed_executor_backend='external_launcher': the world's {world} processes cannot "
                         f"be split into engines of tensor_parallel_size={tp_size}")
    if world == tp_size:
        return TensorParallelGroup(rank=rank, size=tp_size, group=dist.group.WORLD), joined
    groups = [dist.new_group(list(range(first, first + tp_size))) for first in range(0, world, tp_size)]
    return TensorParallelGroup(rank=rank % tp_size, size=tp_size, group=groups[rank // tp_size]), joined


def init_tensor_parallel_group(store: dist.Store, rank: int, world_size: int,
                               device: str) -> TensorParallelGroup:
    """Join the default process group through `store` (gloo on CPU, NCCL on CUDA)."""
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    return TensorParallelGroup(rank=rank, size=world_size, group=dist.group.WORLD)
