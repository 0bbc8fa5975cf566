"""The checks a request passes where it enters the engine core (`EngineCore.add_request`): the
one place prompt and engine-dependent limits are written. The client side (`InputProcessor`)
runs the same functions before sending, so a bad prompt fails at once in the caller's thread
rather than one round trip later; nothing behind the boundary re-validates."""

from __future__ import annotations

import numpy as np

from vllm_lite.config import ModelConfig
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.structured_output import grammar_spec
from vllm_lite.wire import EngineCoreRequest


def check_prompt(tokens: np.ndarray, model_config: ModelConfig) -> None:
    """A 1-D integer array of 1 to max_model_len ids inside the vocabulary."""
    max_len, vocab = model_config.max_model_len, model_config.hf.vocab_size
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(f"prompt_token_ids must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
    if len(tokens) == 0:
        raise ValueError("prompt is empty: at least one prompt token is needed")
    if len(tokens) > max_len:
        raise ValueError(f"prompt has {len(tokens)} tokens, more than max_model_len={max_len}")
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ValueError(f"prompt_token_ids must be in [0, {vocab}) (the vocabulary size)")


def check_request(request: EngineCoreRequest, model_config: ModelConfig) -> None:
    """Requests may come off the wire from any client: what would break a step is refused."""
    check_prompt(request.prompt_token_ids, model_config)
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
    request.sampling_params.check_engine_limits(model_config.hf.vocab_size, model_config.max_logprobs)
    check_structured_outputs(request.sampling_params)


def check_structured_outputs(params: SamplingParams) -> None:
    """A schema, regex or grammar that cannot compile is refused with the backend's reason
    (parsing only: compiling against the tokenizer happens later, off the busy loop)."""
    if params.structured_outputs is not None:
        from vllm_lite.structured_output.xgrammar_backend import XgrammarBackend

        XgrammarBackend.validate(grammar_spec(params.structured_outputs))
