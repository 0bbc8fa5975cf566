"""The engine-core boundary (engine/request_checks.py): a request whose fields would break a
step (issue 12, findings 1 and 2: an int32 overflow in the worker's batch, an EOS id outside the
vocabulary under min_tokens) is refused alone, naming the field and the limit; the engine keeps
its state and the next greedy request gives the same tokens as before."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.engine.request_checks import MAX_EOS_TOKEN_IDS, MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_TOKEN_IDS
from vllm_lite.sampling_params import MAX_INT32

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path):
    engine = LLM(str(tiny_llama), multiprocess=False, max_model_len=256, num_kv_blocks=256)
    yield engine
    engine.shutdown()


def greedy_tokens(llm: LLM) -> list[int]:
    return llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def raw_request(llm: LLM, request_id: str, params: SamplingParams, /, **changes: object):
    """An engine-core request as any client could send it (the client's own checks skipped)."""
    request = llm.llm_engine.input_processor.process(request_id, PROMPT, GREEDY)
    return msgspec.structs.replace(request, sampling_params=params, **changes)


def run_to_end(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    while core.has_unfinished_requests():
        core.step()


def test_int32_counts_run_or_are_refused_never_fatal(llm: LLM) -> None:
    """Finding 1: top_k 2**31 (temperature > 0) and min_tokens 2**31 without max_tokens."""
    before = greedy_tokens(llm)
    with pytest.raises(ValueError, match=r"top_k must be <= 2147483647"):
        SamplingParams(temperature=1.0, top_k=MAX_INT32 + 1)
    with pytest.raises(msgspec.ValidationError, match="min_tokens"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"min_tokens": MAX_INT32 + 1, "max_tokens": None}),
                               type=SamplingParams)
    core = llm.llm_engine.engine_core
    core.add_request(raw_request(llm, "top-k-max", SamplingParams(temperature=1.0, top_k=MAX_INT32, max_tokens=4)))
    core.add_request(raw_request(llm, "min-tokens-max", SamplingParams(min_tokens=MAX_INT32, max_tokens=None)))
    run_to_end(llm)
    assert greedy_tokens(llm) == before
    with pytest.raises(ValueError, match=r"max_tokens must be in \[1, 2147483647\]"):
        core.add_request(raw_request(llm, "max-tokens", GREEDY, max_tokens=MAX_INT32 + 1))


@pytest.mark.parametrize("changes, field", [
    ({"eos_token_ids": (10**6,)}, "eos_token_ids"),
    ({"eos_token_ids": (-1,)}, "eos_token_ids"),
    ({"eos_token_ids": tuple(range(MAX_EOS_TOKEN_IDS + 1))}, "eos_token_ids may hold at most"),
    ({"sampling_params": SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))},
     "stop_token_ids may hold at most"),
    ({"sampling_params": SamplingParams(stop_token_ids=[10**6], min_tokens=2)}, "stop_token_ids"),
    ({"sampling_params": SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)})},
     "logit_bias may hold at most"),
    ({"sampling_params": SamplingParams(logit_bias={10**6: 1.0})}, "logit_bias"),
    ({"sampling_params": SamplingParams(stop=["x"] * 65)}, "stop may hold at most"),
    ({"sampling_params": SamplingParams(n=3)}, "n must be 1"),
    ({"request_id": "r" * 2000}, "request_id"),
    ({"cache_salt": "s" * 2000}, "cache_salt"),
])
def test_bad_request_is_refused_alone(llm: LLM, changes: dict, field: str) -> None:
    """Finding 2 (an EOS id outside the vocabulary with min_tokens > 0 killed the engine in the
    logits-bias op) and the size limits: refused at add_request, the engine serves on."""
    before = greedy_tokens(llm)
    params = changes.pop("sampling_params", SamplingParams(min_tokens=2, max_tokens=8))
    with pytest.raises(ValueError, match=field):
        llm.llm_engine.engine_core.add_request(raw_request(llm, "bad", params, **changes))
    assert not llm.llm_engine.engine_core.has_unfinished_requests()
    assert greedy_tokens(llm) == before
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
