"""step_ab.py variant: on, prefix-cache keys come from csrc's SHA-256 (`KVCacheManager._native`:
vllm_lite._bookkeeping's `block_keys`, the CPU's SHA instructions); off, from hashlib. Keys are
made in the steps that cross a block boundary: compare the means. Also prints
`KVCacheManager.allocate_running`'s own time per side (where a decode step's keys are made).

    python benchmarks/step_ab.py --variant benchmarks/step_variants/block_keys_c.py
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_lite.bookkeeping import native_loops
from vllm_lite.engine.core import EngineCore


def setup(core: EngineCore) -> Callable[[bool], None]:
    if native_loops is None or not native_loops.sha256_extensions():
        raise SystemExit("vllm_lite._bookkeeping is not built or the CPU has no SHA extensions: nothing to compare")
    manager = core.scheduler.kv_cache_manager
    side = [False]
    seconds: dict[bool, list[float]] = {False: [], True: []}
    allocate_running = manager.allocate_running

    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return allocate_running(*args)
        finally:
            seconds[side[0]].append(time.perf_counter() - start)

    manager.allocate_running = timed
    shutdown = core.shutdown

    def report_then_shutdown() -> None:
        print(f"allocate_running (us, {len(seconds[False])} / {len(seconds[True])} calls): mean "
              f"{1e6 * np.mean(seconds[False]):.0f} off, {1e6 * np.mean(seconds[True]):.0f} on; median "
              f"{1e6 * np.median(seconds[False]):.0f} off, {1e6 * np.median(seconds[True]):.0f} on")
        shutdown()

    core.shutdown = report_then_shutdown

    def toggle(on: bool) -> None:
        side[0] = on
        manager._native = native_loops if on else None

    return toggle
