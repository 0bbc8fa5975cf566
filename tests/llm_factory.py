"""Builds an in-process LLM for tests (the engine core in this process, when the option exists),
in float32 unless a test asks otherwise: on a CPU with native bf16, dtype="auto" means bf16."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_lite import LLM
from vllm_lite.config import EngineArgs


def make_llm(model: Path, **engine_args: Any) -> LLM:
    accepts_multiprocess = ("multiprocess" in EngineArgs.field_names()
                            or "multiprocess" in inspect.signature(LLM.__init__).parameters)
    if accepts_multiprocess:
        engine_args.setdefault("multiprocess", False)
    ranks = engine_args.get("tensor_parallel_size", 1) * engine_args.get("data_parallel_size", 1)
    if engine_args.get("device", "auto") != "cpu" and 0 < torch.cuda.device_count() < ranks:
        pytest.skip(f"{ranks} ranks on CUDA need {ranks} GPUs (this machine has {torch.cuda.device_count()})")
    engine_args.setdefault("max_model_len", 256)
    engine_args.setdefault("dtype", "float32")  # parity with transformers is an fp32 claim
    return LLM(str(model), **engine_args)
