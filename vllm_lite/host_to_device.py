"""The one way host batch arrays reach the device."""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device`. On CUDA the copy leaves from pinned memory (torch's caching host
    allocator: no allocation per step once warm, and the block is not reused before the copy has
    run), so it is asynchronous; from numpy's pageable memory the driver would stage it and the
    host would wait. On CPU the result shares the array's memory."""
    if device.type != "cuda":
        return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)
    # Copied into the pinned block through numpy, not through `torch.from_numpy(array)`: arrays
    # decoded off the wire are read-only, which torch.from_numpy warns about.
    pinned = torch.empty(array.shape, dtype=torch.from_numpy(np.empty(0, array.dtype)).dtype, pin_memory=True)
    pinned.numpy()[...] = array
    return pinned.to(device, non_blocking=True)


class StepInputTensors:
    """A step's input arrays as tensors, one kept per input name from step to step. On CPU an
    array is copied into its name's tensor while shape and dtype stay those of the last step's
    (every steady decode step), so building a step's inputs makes no torch call: the first
    torch call after a forward pass costs 30-90 us on a CPU whose caches the forward pass has
    refilled (its code and data are cold), several numpy copies' worth. Elsewhere each array
    goes through `host_to_device`. A kept tensor is overwritten by the next step's inputs: a
    step's inputs are not read once the next step's are built (on CPU a step's forward pass
    and sampling are done by then)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._kept: dict[str, tuple[np.ndarray, torch.Tensor]] = {}

    def put(self, name: str, array: np.ndarray, dtype: type[np.generic] | None = None) -> torch.Tensor:
        """`array` (as `dtype`, when given) on the device, in the tensor kept for `name`."""
        if self.device.type != "cpu":
            return host_to_device(array if dtype is None else array.astype(dtype, copy=False), self.device)
        np.copyto(self.host(name, array.shape, array.dtype if dtype is None else dtype), array)
        return self._kept[name][1]

    def host(self, name: str, shape: tuple[int, ...], dtype: type[np.generic] | np.dtype) -> np.ndarray:
        """The host array kept for `name`, of this shape and dtype, for the caller to fill in
        place; `tensor(name)` then puts it on the device."""
        kept = self._kept.get(name)
        if kept is None or kept[0].shape != shape or kept[0].dtype != dtype:
            host = np.empty(shape, dtype)
            kept = self._kept[name] = (host, torch.from_numpy(host))
        return kept[0]

    def tensor(self, name: str) -> torch.Tensor:
        """`name`'s host array (`host`) on the device: on CPU its own memory."""
        host, tensor = self._kept[name]
        return tensor if self.device.type == "cpu" else host_to_device(host, self.device)
