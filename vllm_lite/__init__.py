"""vllm_lite: a lean LLM inference engine with vLLM's V1 architecture.

Public names are imported lazily, so `import vllm_lite.core` (torch-free) stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm_lite.version import __version__  # noqa: F401 - re-exported

_EXPORTS = {
    "LLM": "vllm_lite.entrypoints.llm",
    "AsyncLLM": "vllm_lite.engine.async_llm",
    "EngineDeadError": "vllm_lite.exceptions",
    "SamplingParams": "vllm_lite.sampling_params",
    "RequestOutputKind": "vllm_lite.sampling_params",
    "EngineArgs": "vllm_lite.config",
    "AsyncEngineArgs": "vllm_lite.config",
    "LLMEngine": "vllm_lite.engine.llm_engine",
    "AsyncLLMEngine": "vllm_lite.engine.async_llm",
    "PromptType": "vllm_lite.engine.input_processor",
    "TextPrompt": "vllm_lite.engine.input_processor",
    "TokensPrompt": "vllm_lite.engine.input_processor",
    "RequestOutput": "vllm_lite.outputs",
    "CompletionOutput": "vllm_lite.outputs",
    "WeightVersionSpan": "vllm_lite.outputs",
    "Logprob": "vllm_lite.outputs",
    "PoolingParams": "vllm_lite.pooling_params",
    "EmbeddingRequestOutput": "vllm_lite.outputs",
    "EmbeddingOutput": "vllm_lite.outputs",
    "ScoringRequestOutput": "vllm_lite.outputs",
    "ScoringOutput": "vllm_lite.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_lite' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
