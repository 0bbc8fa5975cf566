"""How much memory the KV cache may take under vLLM's gpu_memory_utilization: that share of the
device's memory, less what this engine's rank already uses (weights, a full step's activations,
the runtime's own). On CUDA the rank measures a profile step; on CPU, as vLLM's CPU backend, the
share is of the host's memory and what the rank uses is its resident set."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    free: int  # bytes another allocation can take now
    total: int


def device_memory(device: torch.device) -> DeviceMemory:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(free, total)
    return host_memory()


def host_memory() -> DeviceMemory:
    """MemAvailable and MemTotal from /proc/meminfo (Linux)."""
    fields = _meminfo()
    return DeviceMemory(fields["MemAvailable"], fields["MemTotal"])


def _meminfo() -> dict[str, int]:
    path = Path("/proc/meminfo")
    if not path.is_file():
        raise ValueError("gpu_memory_utilization on CPU reads the host's memory from /proc/meminfo (Linux); "
                         "give kv_cache_memory_bytes instead")
    fields = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        value = rest.split()
        if value and value[0].isdigit():
            fields[name] = int(value[0]) * 1024  # kB
    return fields


def resident_bytes() -> int:
    """This process's resident set (what vLLM's CPU backend counts as the rank's own use)."""
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def kv_cache_budget(utilization: float, at_start: DeviceMemory, used: int, now_free: int,
                    sharers: int = 1, device: str = "cuda") -> int:
    """The bytes the KV cache may take: `utilization` of the device's total (split between the
    `sharers`, ranks on one host's memory), less `used`, this rank's own use, and no more than is
    free now (said in a warning: the engine caps its cache at what max_num_seqs requests can use,
    often far less, so a share larger than what is free need not fail the start). Refused, naming
    the field, when the share was not free when the engine started or leaves nothing."""
    share = int(at_start.total * utilization) // sharers
    where = f"the {'GPU' if device == 'cuda' else 'host'}'s {at_start.total / GIB:.2f} GiB"
    if sharers > 1:
        where += f" split between {sharers} ranks"
    if device == "cuda" and share > at_start.free:
        raise ValueError(f"gpu_memory_utilization={utilization} asks for {share / GIB:.2f} GiB of {where}, but only "
                         f"{at_start.free / GIB:.2f} GiB were free when the engine started (other processes use "
                         "the rest); lower gpu_memory_utilization")
    budget = share - used
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization} gives this engine {share / GIB:.2f} GiB of {where}, "
                         f"but the weights and a step's activations already take {used / GIB:.2f} GiB, leaving "
                         "nothing for the KV cache; raise gpu_memory_utilization")
    if budget > now_free:
        logger.warning("gpu_memory_utilization=%s leaves %.2f GiB for the KV cache, but only %.2f GiB are free: the "
                       "KV cache takes at most that", utilization, budget / GIB, now_free / GIB)
    return min(budget, now_free)


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): the worker keeps
    freed buffers in its heap for the next step (`worker.keep_freed_memory_in_heap`), which a
    released KV cache must not stay in."""
    if not sys.platform.startswith("linux"):
        return
    malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if malloc_trim is not None:  # (glibc only)
        malloc_trim(0)
