"""Builds an in-process LLM for tests (the engine core in this process, when the option exists)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from vllm_lite import LLM
from vllm_lite.config import EngineArgs


def make_llm(model: Path, **engine_args: Any) -> LLM:
    accepts_multiprocess = ("multiprocess" in EngineArgs.field_names()
                            or "multiprocess" in inspect.signature(LLM.__init__).parameters)
    if accepts_multiprocess:
        engine_args.setdefault("multiprocess", False)
    engine_args.setdefault("max_model_len", 256)
    return LLM(str(model), **engine_args)
