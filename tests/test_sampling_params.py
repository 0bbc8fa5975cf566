"""Acceptance 6: every invalid sampling parameter raises a ValueError that names the field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.wire import EngineCoreRequest
from vllm_lite.sampling_params import RequestOutputKind

INVALID = [
    ("n", {"n": 0}),
    ("n", {"n": 1.5}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("temperature", {"temperature": "1"}),
    ("temperature", {"temperature": 2.01}),
    ("skip_reading_prefix_cache", {"skip_reading_prefix_cache": "yes"}),
    ("skip_reading_prefix_cache", {"skip_reading_prefix_cache": False, "prompt_logprobs": 1}),  # (vLLM 0.32's bound, [0, 2]; 2.0 itself is taken)
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.0}),
    ("min_p", {"min_p": -0.01}),
    ("min_p", {"min_p": 1.5}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("frequency_penalty", {"frequency_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -2.5}),
    ("presence_penalty", {"presence_penalty": 2.01}),
    ("presence_penalty", {"presence_penalty": -3}),
    ("seed", {"seed": 2**64}),
    ("seed", {"seed": "7"}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -5}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 10, "max_tokens": 5}),
    ("logprobs", {"logprobs": -2}),
    ("max_tokens", {"max_tokens": np.bool_(True)}),
    ("temperature", {"temperature": np.float64("nan")}),
    ("prompt_logprobs", {"prompt_logprobs": -2}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": [3]}),
    ("stop", {"stop": ["x"], "detokenize": False}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": ["2"]}),
    ("logit_bias", {"logit_bias": {"x": 1.0}}),
    ("logit_bias", {"logit_bias": {5: math.nan}}),
    ("logit_bias", {"logit_bias": {-3: 1.0}}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("output_kind", {"output_kind": 7}),
]


@pytest.mark.parametrize(("field", "kwargs"), INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_parameter_names_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)


def test_defaults_and_normalization() -> None:
    params = SamplingParams(top_k=-1, stop="###", logit_bias={"7": 250.0, 8: -1.5})
    assert params.top_k == 0
    assert params.stop == ["###"]
    assert params.logit_bias == {7: 100.0, 8: -1.5}  # clamped to OpenAI's range
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert greedy.is_greedy and (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-3).temperature == pytest.approx(1e-2)
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2  # (vLLM: -1 = no seed)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams().clone_with(seed=-(2**63) - 1)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama, max_logprobs=25)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_above_engine_max(llm, field: str) -> None:
    llm.generate("hello", SamplingParams(max_tokens=1, **{field: 25}), use_tqdm=False)  # at the max: fine
    with pytest.raises(ValueError, match=rf"{field} must be <= 25 .*max_logprobs"):
        llm.generate("hello", SamplingParams(max_tokens=1, **{field: 26}), use_tqdm=False)


@pytest.mark.parametrize("field", ["logit_bias", "stop_token_ids"])
def test_token_ids_outside_vocabulary(llm, field: str) -> None:
    vocab = llm.llm_engine.vllm_config.model_config.hf.vocab_size
    value = {vocab: 1.0} if field == "logit_bias" else [vocab]
    with pytest.raises(ValueError, match=field):
        llm.generate("hello", SamplingParams(max_tokens=1, **{field: value}), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_max_logprobs_engine_arg_validated(tiny_llama) -> None:
    with pytest.raises(ValueError, match="max_logprobs"):
        make_llm(tiny_llama, max_logprobs=-2)


def test_max_logprobs_minus_one_is_the_vocabulary(tiny_llama) -> None:
    """vLLM's -1: no limit, so logprobs may cover the whole vocabulary."""
    llm = make_llm(tiny_llama, max_logprobs=-1)
    vocab = llm.llm_engine.vllm_config.model_config.hf.vocab_size
    assert llm.llm_engine.vllm_config.model_config.max_logprobs == vocab
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=1, logprobs=vocab),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs[0]) == vocab
    # vLLM's -1 = the whole vocabulary, also for prompt_logprobs
    whole = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=1, logprobs=-1, prompt_logprobs=-1),
                         use_tqdm=False)[0]
    assert len(whole.outputs[0].logprobs[0]) == vocab and len(whole.prompt_logprobs[1]) == vocab
    assert whole.outputs[0].logprobs == out.logprobs


def test_logprobs_minus_one_is_the_vocabulary_within_max_logprobs(llm) -> None:
    with pytest.raises(ValueError, match=r"logprobs must be <= 25 .*max_logprobs"):
        llm.generate("hello", SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)


def test_numpy_scalars_are_taken_as_python_numbers() -> None:
    """A sweep over np.linspace / np.arange: the values are checked and sent as int / float."""
    params = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), max_tokens=np.int64(7),
                            top_k=np.int32(5), seed=np.uint64(2**63), stop_token_ids=[np.int64(3)],
                            logprobs=np.int16(2))
    assert (params.temperature, params.top_p, params.max_tokens, params.top_k, params.seed) == (0.5, 0.9, 7, 5, 2**63)
    assert [type(v) for v in (params.temperature, params.max_tokens, params.seed, params.stop_token_ids[0],
                              params.logprobs)] == [float, int, int, int, int]
    assert params == SamplingParams(temperature=0.5, top_p=0.9, max_tokens=7, top_k=5, seed=2**63,
                                    stop_token_ids=[3], logprobs=2)


def test_engine_core_checks_requests_that_skip_the_input_processor(llm) -> None:
    """A client talking to the engine core directly cannot crash a step with a bad token id."""
    request = EngineCoreRequest("raw", np.array([5, 6], dtype=np.int32), SamplingParams(logit_bias={10**6: 1.0}),
                                (2,), 0.0, 4)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.llm_engine.engine_core.add_request(request)
