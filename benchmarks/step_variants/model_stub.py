"""step_ab.py variant: on, the forward pass and the greedy LM head compute nothing and return
what they returned for the last step computed (the batch does not change in step_ab's steady
window), so that "outside model" compares the same engine work with the caches as the model
leaves them (off) and as the engine's own work leaves them (on).

    python benchmarks/step_ab.py --variant benchmarks/step_variants/model_stub.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_lite.engine.core import EngineCore


def setup(core: EngineCore) -> Callable[[bool], None]:
    model = core.executor.worker.model_runner.model
    stubbed = [False]

    def keep_last(name: str) -> None:
        compute = getattr(model, name)
        last: list[Any] = []

        def computed_or_last(*args: Any, **kwargs: Any) -> Any:
            if stubbed[0] and last:
                value = last[0]
                return value.clone() if isinstance(value, torch.Tensor) and value.dtype == torch.int64 else value
            value = compute(*args, **kwargs)
            last[:] = [value]
            return value

        setattr(model, name, computed_or_last)

    keep_last("forward")
    keep_last("compute_greedy_tokens")

    def toggle(on: bool) -> None:
        stubbed[0] = on

    return toggle
