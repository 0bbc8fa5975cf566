"""The CPU worker's allocator set-up (worker.keep_freed_memory_in_heap): a step's large buffers
reuse the pages freed by the previous step instead of faulting fresh ones in."""

from __future__ import annotations

import subprocess
import sys

import pytest

# One process per case: the set-up is process-wide and cannot be undone.
FAULTS_PER_ALLOCATION = """
import resource, sys, torch
from vllm_lite.worker.worker import keep_freed_memory_in_heap
if sys.argv[1] == "set-up":
    keep_freed_memory_in_heap()
for _ in range(3):  # reach the steady state (the heap at its peak size)
    torch.empty(16 << 20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(16 << 20).fill_(1.0)  # 64 MiB, as a step's logits or activations
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""
PAGES_PER_ALLOCATION = (64 << 20) // 4096


def faults_per_allocation(mode: str) -> float:
    result = subprocess.run([sys.executable, "-c", FAULTS_PER_ALLOCATION, mode], capture_output=True, text=True,
                            timeout=120, check=True)
    return float(result.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_buffers_over_32_mib_reuse_freed_pages() -> None:
    default = faults_per_allocation("default")
    if default < PAGES_PER_ALLOCATION / 2:
        pytest.skip(f"this allocator already reuses the pages ({default:.0f} faults per 64 MiB buffer)")
    assert faults_per_allocation("set-up") < PAGES_PER_ALLOCATION / 8
