"""n > 1: one prompt, n samples sharing the prompt's KV blocks through the prefix cache,
folded into one RequestOutput (LLM.generate) or streamed per child (DELTA / CUMULATIVE)."""

from __future__ import annotations

import pytest

from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.sampling_params import RequestOutputKind

MAX_TOKENS = 10


@pytest.fixture
def llm(tiny_llama):
    return make_llm(tiny_llama, block_size=8)


def _single(llm, prompt, params: SamplingParams) -> list[int]:
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids


def test_greedy_n_equals_n_copies_and_shares_prompt_blocks(llm, prompts_token_ids) -> None:
    prompt = prompts_token_ids[5]  # 50 tokens: 6 full blocks of 8
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    hits_before = llm.stats()["prefix_cache_hits"]
    (out,) = llm.generate({"prompt_token_ids": prompt}, params.clone_with(n=4), use_tqdm=False)
    shared_hits = llm.stats()["prefix_cache_hits"] - hits_before
    assert shared_hits == 3 * 6 * 8  # children 1..3 reuse child 0's six full prompt blocks
    assert out.request_id and out.finished and [c.index for c in out.outputs] == [0, 1, 2, 3]
    llm.reset_prefix_cache()
    expected = _single(llm, prompt, params)
    assert all(c.token_ids == expected and c.finish_reason == "length" for c in out.outputs)


def test_seeded_children_equal_single_requests_with_seed_plus_index(llm, prompts_token_ids) -> None:
    prompt = prompts_token_ids[3]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=77, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params.clone_with(n=3), use_tqdm=False)
    expected = [_single(llm, prompt, params.clone_with(seed=77 + i)) for i in range(3)]
    assert [c.token_ids for c in out.outputs] == expected
    assert len({tuple(t) for t in expected}) == 3


def test_n_with_logprobs_and_prompt_logprobs(llm, prompts_token_ids) -> None:
    prompt = prompts_token_ids[2]
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=4, logprobs=2, prompt_logprobs=1)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    assert all(p is not None for p in out.prompt_logprobs[1:])
    for completion in out.outputs:
        assert len(completion.logprobs) == 4 and completion.cumulative_logprob is not None


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_streaming_children(llm, prompts_token_ids, kind) -> None:
    """Streaming passes each child's output through under the parent's id; each child finishes
    once; the parent's last output says finished."""
    engine = llm.llm_engine
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, output_kind=kind)
    engine.add_request("p", {"prompt_token_ids": prompts_token_ids[1]}, params)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished_children, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "p"
            for c in out.outputs:
                tokens[c.index] = tokens[c.index] + c.token_ids if kind == RequestOutputKind.DELTA else c.token_ids
                if c.finish_reason is not None:
                    finished_children.append(c.index)
            last = out
    assert sorted(finished_children) == [0, 1, 2] and last.finished
    expected = [_single(llm, prompts_token_ids[1], params.clone_with(n=1, seed=5 + i,
                                                                      output_kind=RequestOutputKind.FINAL_ONLY))
                for i in range(3)]
    assert [tokens[i] for i in range(3)] == expected


def test_abort_parent_aborts_all_children(llm, prompts_token_ids) -> None:
    engine = llm.llm_engine
    engine.add_request("p", {"prompt_token_ids": prompts_token_ids[0]},
                       SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request(["p"])
    assert not engine.has_unfinished_requests()
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
