"""step_ab.py variant: on, the worker builds a steady decode step's inputs with csrc's loops
(`ModelRunner._decode_step_inputs`: vllm_lite._bookkeeping's `decode_inputs` and
`copy_block_rows`); off, with the general numpy path of `_prepare_inputs`.

    python benchmarks/step_ab.py --variant benchmarks/step_variants/decode_inputs_c.py
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_lite.bookkeeping import native_loops
from vllm_lite.engine.core import EngineCore


def setup(core: EngineCore) -> Callable[[bool], None]:
    if native_loops is None:
        raise SystemExit("vllm_lite._bookkeeping is not built: nothing to compare")
    runner = core.executor.worker.model_runner

    def toggle(on: bool) -> None:
        runner.native_loops = native_loops if on else None

    return toggle
