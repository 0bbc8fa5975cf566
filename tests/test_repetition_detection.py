"""vLLM's `repetition_detection` (SamplingParams / the server's field): a request stops with
finish_reason "repetition" and stop_reason "repetition_detected" at the first output token that
ends `min_count` equal runs of a pattern length in [min_pattern_size, max_pattern_size], not
before `min_tokens`; the check is vLLM's (held to a transcription of its loop on random
sequences); a model that cycles through 7 tokens stops where the reference says, in and out of
process (over HTTP: tests/entrypoints/test_repetition_detection_server.py); values that cannot
hold are refused by name."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from hf_reference import build_cycling_model, hf_greedy
from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.sampling_params import RepetitionDetectionParams

PROMPT = [11, 12, 13, 14, 15]
MAX_TOKENS = 60


def vllms_check(tokens: list[int], max_size: int, min_size: int, min_count: int) -> bool:
    """vLLM's check_sequence_repetition, transcribed: the reference."""
    min_size = max(min_size, 1)
    for size in range(min_size, max_size + 1):
        if size * min_count > len(tokens):
            return False
        if all(tokens[-(size * m + n)] == tokens[-n] for n in range(1, size + 1) for m in range(1, min_count)):
            return True
    return False


def first_stop(tokens: list[int], params: dict, min_tokens: int = 0) -> int | None:
    """How many output tokens the reference keeps (None: it never stops)."""
    for length in range(max(min_tokens, 1), len(tokens) + 1):
        if vllms_check(tokens[:length], params["max_pattern_size"], params.get("min_pattern_size", 0),
                       params["min_count"]):
            return length
    return None


def test_the_check_is_vllms() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
        max_size = rng.randrange(1, 8)
        min_size, min_count = rng.randrange(0, max_size + 1), rng.randrange(2, 5)
        params = RepetitionDetectionParams(max_pattern_size=max_size, min_pattern_size=min_size, min_count=min_count)
        assert params.repeats(np.array(tokens, dtype=np.int32)) == vllms_check(tokens, max_size, min_size, min_count)


@pytest.fixture(scope="module")
def cycling(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Its greedy tokens cycle through 7 tokens (a bigram model)."""
    return build_cycling_model(tmp_path_factory.mktemp("cycling_repetition"), 0.0)


@pytest.mark.parametrize(("params", "min_tokens"), [
    ({"max_pattern_size": 7, "min_count": 2}, 0),
    ({"max_pattern_size": 10, "min_pattern_size": 7, "min_count": 3}, 0),
    ({"max_pattern_size": 7, "min_count": 2}, 30),
])
def test_a_cycling_model_stops_where_vllm_would(cycling: Path, params: dict, min_tokens: int) -> None:
    expected = hf_greedy(cycling, [PROMPT], MAX_TOKENS)[0]
    stop = first_stop(expected, params, min_tokens)
    assert stop is not None and stop < MAX_TOKENS
    llm = make_llm(cycling)
    try:
        output = llm.generate({"prompt_token_ids": PROMPT},
                              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                             min_tokens=min_tokens, repetition_detection=params),
                              use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert list(output.token_ids) == expected[:stop]
    assert (output.finish_reason, output.stop_reason) == ("repetition", "repetition_detected")


def test_off_and_short_patterns_do_not_stop_a_spawned_engine(cycling: Path) -> None:
    """max_pattern_size 0 is vLLM's "off"; patterns shorter than the cycle never repeat in it."""
    expected = hf_greedy(cycling, [PROMPT], MAX_TOKENS)[0]
    llm = make_llm(cycling, multiprocess=True)
    try:
        for params in ({"max_pattern_size": 0}, {"max_pattern_size": 6, "min_count": 2}):
            output = llm.generate({"prompt_token_ids": PROMPT},
                                  SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                 repetition_detection=params), use_tqdm=False)[0].outputs[0]
            assert list(output.token_ids) == expected and output.finish_reason == "length"
        stopped = llm.generate({"prompt_token_ids": PROMPT},
                               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                              repetition_detection={"max_pattern_size": 7, "min_count": 2}),
                               use_tqdm=False)[0].outputs[0]
        assert stopped.finish_reason == "repetition"
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("value", "message"), [
    ({"max_pattern_size": 3, "min_count": 1}, "min_count must be >= 2"),
    ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size <= max_pattern_size"),
    ({"max_pattern_size": -1}, r"max_pattern_size must be an int in \[0, 2147483647\]"),
    ({"max_pattern_size": 3, "min_count": 2, "window": 5}, "Unexpected keyword argument 'window'"),
    ("3", "must be a RepetitionDetectionParams, its dict or None"),
])
def test_values_that_cannot_hold_are_refused(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(repetition_detection=value)
