"""The one way host batch arrays reach the device."""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device` (asynchronous from pinned memory on CUDA)."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)
