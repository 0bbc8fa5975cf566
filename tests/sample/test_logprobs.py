"""Acceptance 2: logprobs of a greedy run (and prompt_logprobs) equal log_softmax of
transformers' logits on the same model and tokens within 1e-4, with the right ranks; also under
chunked prefill and with the prefix cache warm."""

from __future__ import annotations

import pytest
import torch

from hf_reference import hf_logits
from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.sample.ops.logprobs import gather_logprobs

NUM_LOGPROBS = 5
MAX_TOKENS = 8
ATOL = 1e-4


def _reference(model_dir, token_ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(model_dir, token_ids), dim=-1)


def _assert_rank(rank: int, logprobs: torch.Tensor, token_id: int) -> None:
    """`rank` is the token's rank in the reference row, ties within ATOL either way (a CPU whose
    matmuls sum in another order may swap two logprobs that close)."""
    value = float(logprobs[token_id])
    best = int((logprobs > value + ATOL).sum()) + 1
    worst = int((logprobs > value - ATOL).sum()) + 1
    assert best <= rank <= worst, (rank, best, worst)


def _check_entry(entry: dict, token_id: int, ref: torch.Tensor, k: int) -> None:
    assert entry[token_id].logprob == pytest.approx(float(ref[token_id]), abs=ATOL)
    _assert_rank(entry[token_id].rank, ref, token_id)
    top_values, top_ids = ref.topk(k)
    for rank, (value, top_id) in enumerate(zip(top_values.tolist(), top_ids.tolist()), start=1):
        assert entry[top_id].logprob == pytest.approx(value, abs=ATOL)
        assert entry[top_id].rank == rank
    assert set(entry) == set(top_ids.tolist()) | {token_id}


def _check_output(model_dir, prompt: list[int], output) -> None:
    completion = output.outputs[0]
    ref = _reference(model_dir, prompt + completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids) == MAX_TOKENS
    for i, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + i]
        _check_entry(entry, token_id, row, NUM_LOGPROBS)
        assert entry[token_id].rank == 1  # greedy
    expected_cumulative = sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs))
    assert completion.cumulative_logprob == pytest.approx(expected_cumulative, abs=1e-6)
    assert len(output.prompt_logprobs) == len(prompt)
    assert output.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        _check_entry(output.prompt_logprobs[p], prompt[p], ref[p - 1], NUM_LOGPROBS)


def _params(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=NUM_LOGPROBS,
                          prompt_logprobs=NUM_LOGPROBS, **extra)


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_qwen3"])
def test_greedy_logprobs_match_hf(request, model_name: str, prompts_token_ids) -> None:
    model_dir = request.getfixturevalue(model_name)
    llm = make_llm(model_dir)
    prompts = [prompts_token_ids[i] for i in (0, 3, 5)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        _check_output(model_dir, prompt, output)


def test_prompt_logprobs_with_chunked_prefill_and_warm_prefix_cache(tiny_llama, prompts_token_ids) -> None:
    """Prompts of 50 and 90 tokens in 16-token chunks; the same prompts were cached by an
    earlier request, which a prompt_logprobs request must not reuse (it needs every position)."""
    llm = make_llm(tiny_llama, max_num_batched_tokens=16, block_size=8)
    prompts = [prompts_token_ids[5], prompts_token_ids[7]]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=2), use_tqdm=False)
    hits_before = llm.stats()["prefix_cache_hits"]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] == hits_before
    for prompt, output in zip(prompts, outputs):
        _check_output(tiny_llama, prompt, output)


def test_logprobs_zero_and_mixed_batch(tiny_llama, prompts_token_ids) -> None:
    """logprobs=0 gives only the sampled token; requests without logprobs get None; a random
    request's logprobs are still the raw (pre-temperature) distribution."""
    llm = make_llm(tiny_llama)
    prompt = prompts_token_ids[2]
    params = [SamplingParams(temperature=0.0, max_tokens=4, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=4),
              SamplingParams(temperature=0.5, top_k=3, seed=1, max_tokens=4, logprobs=2)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3, params, use_tqdm=False)
    zero, none, random = (o.outputs[0] for o in outs)
    assert [list(e) for e in zero.logprobs] == [[t] for t in zero.token_ids]
    assert none.logprobs is None and none.cumulative_logprob is None and outs[1].prompt_logprobs is None
    ref = _reference(tiny_llama, prompt + random.token_ids)
    for i, (token_id, entry) in enumerate(zip(random.token_ids, random.logprobs)):
        _check_entry(entry, token_id, ref[len(prompt) - 1 + i], 2)


def test_gather_logprobs_ranks() -> None:
    logprobs = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 1.0, 1.0, 0.0]]), dim=-1)
    out = gather_logprobs(logprobs, 2, torch.tensor([2, 0]))
    assert out.token_ids.tolist() == [[2, 1, 3], [0, 0, 1]]
    assert out.ranks.tolist() == [[3, 1, 2], [1, 1, 2]]
    torch.testing.assert_close(out.logprobs[:, 0], logprobs[[0, 1], [2, 0]])


def test_logprob_token_ids_in_a_mixed_batch_match_hf(tiny_llama, prompts_token_ids) -> None:
    """vLLM's logprob_token_ids: each output token carries the sampled token then exactly the
    given ids (ranks over the whole vocabulary), whatever the other rows of the batch ask: a
    top-k row of another width, a row without logprobs, a row with one given id."""
    llm = make_llm(tiny_llama)
    prompt = prompts_token_ids[2]
    given, single = [7, 300, 3, 511, 42], [9]
    params = [SamplingParams(temperature=0.0, max_tokens=4, logprob_token_ids=given),
              SamplingParams(temperature=0.0, max_tokens=4, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=4),
              SamplingParams(temperature=0.7, seed=3, max_tokens=4, logprob_token_ids=single, logprobs=1)]
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": prompt}] * 4, params, use_tqdm=False)]
    for completion, ids in ((outs[0], given), (outs[3], single)):
        ref = _reference(tiny_llama, prompt + completion.token_ids)
        for i, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = ref[len(prompt) - 1 + i]
            assert list(entry) == list(dict.fromkeys([token_id, *ids]))
            for tid in entry:
                assert entry[tid].logprob == pytest.approx(float(row[tid]), abs=ATOL)
                _assert_rank(entry[tid].rank, row, tid)
    ref = _reference(tiny_llama, prompt + outs[1].token_ids)
    for i, (token_id, entry) in enumerate(zip(outs[1].token_ids, outs[1].logprobs)):
        _check_entry(entry, token_id, ref[len(prompt) - 1 + i], 2)
    assert outs[2].logprobs is None


@pytest.mark.parametrize("kwargs, message", [
    ({"logprob_token_ids": []}, "1 to 128"),
    ({"logprob_token_ids": list(range(129))}, "1 to 128"),
    ({"logprob_token_ids": [1, 2], "logprobs": 3}, "logprobs=len"),
    ({"logprob_token_ids": [-1]}, ">= 0"),
])
def test_logprob_token_ids_checks(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        SamplingParams(**kwargs)
    assert "logprob_token_ids" in str(info.value)


def test_logprob_token_ids_outside_the_vocabulary(tiny_llama) -> None:
    llm = make_llm(tiny_llama)
    with pytest.raises(ValueError, match="logprob_token_ids has token ids outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(logprob_token_ids=[10**6]), use_tqdm=False)
