"""step_ab.py variant: on, the step thread waits `STEP_AB_WAIT_MS` milliseconds (default 40, a
1,024-request step's forward pass and LM head here) after each forward pass, inside the timed
forward pass, so that "outside model" compares the same engine work after a short and after a
long model phase: what the elapsed time alone does to the bookkeeping (caches cooling down while
the thread is off the CPU). `STEP_AB_WAIT=spin` busy-waits instead of sleeping.

    STEP_AB_WAIT_MS=40 python benchmarks/step_ab.py --variant benchmarks/step_variants/model_wait.py --requests 64
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from vllm_lite.engine.core import EngineCore


def setup(core: EngineCore) -> Callable[[bool], None]:
    seconds = float(os.environ.get("STEP_AB_WAIT_MS", "40")) / 1e3
    spin = os.environ.get("STEP_AB_WAIT", "sleep") == "spin"
    model = core.executor.worker.model_runner.model
    forward = model.forward
    waiting = [False]

    def forward_then_wait(*args: Any, **kwargs: Any) -> Any:
        hidden = forward(*args, **kwargs)
        if waiting[0]:
            if spin:
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    pass
            else:
                time.sleep(seconds)
        return hidden

    model.forward = forward_then_wait

    def toggle(on: bool) -> None:
        waiting[0] = on

    return toggle
