"""csrc's per-request loops of a steady step (`vllm_lite._bookkeeping`, csrc/bookkeeping.cpp: the
engine core's token store, the worker's decode step inputs, the client's output token store)
and its prefix-cache block keys, or None where csrc is not built (no C++ compiler,
VLLM_LITE_BUILD_CSRC=0): each caller keeps numpy (or hashlib) code of the same rules as its
fallback, and the tests hold the C code to it."""

from __future__ import annotations

from types import ModuleType

native_loops: ModuleType | None
try:
    from vllm_lite import _bookkeeping as native_loops
except ImportError:
    native_loops = None


def chosen_loops(native: bool | None) -> ModuleType | None:
    """The loops a caller's `native` flag asks for: None (the default) where they are built,
    True they must be (else RuntimeError), False never (the numpy fallback)."""
    if native and native_loops is None:
        raise RuntimeError("the csrc extension vllm_lite._bookkeeping is not built")
    return native_loops if native is not False else None
