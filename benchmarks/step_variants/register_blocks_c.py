"""step_ab.py variant: on, the requests whose blocks filled up enter the prefix cache through
csrc's loop (`KVCacheManager._register_running` with vllm_lite._bookkeeping's
`register_blocks`); off, through `_register_full_blocks` request by request. The steps that
register blocks are the ones that cross a block boundary: compare the means.

    python benchmarks/step_ab.py --variant benchmarks/step_variants/register_blocks_c.py
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_lite.bookkeeping import native_loops
from vllm_lite.engine.core import EngineCore


def setup(core: EngineCore) -> Callable[[bool], None]:
    if native_loops is None:
        raise SystemExit("vllm_lite._bookkeeping is not built: nothing to compare")
    manager = core.scheduler.kv_cache_manager

    def toggle(on: bool) -> None:
        manager._native = native_loops if on else None

    return toggle
