"""The one way host batch arrays reach the device."""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device`. On CUDA the copy leaves from pinned memory (torch's caching host
    allocator: no allocation per step once warm, and the block is not reused before the copy has
    run), so it is asynchronous; from numpy's pageable memory the driver would stage it and the
    host would wait. On CPU the result shares the array's memory."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
