"""Worker extensions written as vLLM's RLHF examples write them (`worker_extension_cls`), for
tests/test_collective_rpc.py: importable by name from the engine's processes
(`worker_extensions.WeightSync`; the tests' folder is on their path)."""

from __future__ import annotations

from typing import Any

import torch


class WeightSync:
    """A trainer's weight updates: tensors sent through collective_rpc, loaded by the model's
    `load_weights` (vLLM's model interface)."""

    def update_weights(self, weights: dict[str, torch.Tensor]) -> list[str]:
        return sorted(self.model_runner.model.load_weights(weights=list(weights.items())))

    def update_weight(self, name: str, weight: torch.Tensor) -> None:
        self.model_runner.model.load_weights(weights=[(name, weight)])

    def rank_and_device(self) -> dict[str, Any]:
        return {"rank": self.rank, "local_rank": self.local_rank, "device": str(self.device)}

    def load_checkpoint(self, path: str) -> int:
        """A trainer's checkpoint by path (an HTTP client's collective_rpc passes strings only)."""
        from safetensors.torch import load_file

        return len(self.model_runner.model.load_weights(weights=load_file(path).items()))

    def cpu_affinity(self) -> list[int]:
        import os

        return sorted(os.sched_getaffinity(0))

    def weight_elements(self) -> int:
        """The model's parameter elements held in memory on this rank (0 while asleep at level 2; a
        layer packed for the CPU matmul holds its weight elsewhere, its parameter is a meta tensor)."""
        return sum(param.numel() for param in self.model_runner.model.parameters() if not param.is_meta)

    def kv_cache_layers(self) -> int:
        """How many layers' KV cache this rank holds (0 while asleep at level 1)."""
        return len(self.model_runner.kv_caches)

    def fail(self, message: str) -> None:
        raise RuntimeError(message)

    def sleep_for(self, seconds: float) -> str:
        import time

        time.sleep(float(seconds))  # (an HTTP client passes strings)
        return "slept"

    def encoder_cache_counts(self) -> dict[str, int]:
        """Images found in this rank's encoder cache, and those encoded."""
        cache = self.model_runner.encoder_cache
        return {"hits": cache.hits, "misses": cache.misses}


class ClashingExtension:
    """Defines a method the worker has: refused."""

    def execute_model(self) -> None:
        pass


not_a_class = 42
