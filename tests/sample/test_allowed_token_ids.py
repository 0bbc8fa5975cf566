"""vLLM's allowed_token_ids: only those tokens may be sampled (the others' logits are -inf after
the raw logprobs are taken, before min_tokens / logit_bias / penalties, as in vLLM). On the
sampler and end to end against transformers' logits (the server's field:
tests/entrypoints/test_vllm_extensions.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_reference import hf_logits
from llm_factory import make_llm
from sampling_fixtures import make_batch, make_metadata
from vllm_lite import SamplingParams
from vllm_lite.sample.ops.grammar_mask import GrammarBitmask
from vllm_lite.sample.sampler import Sampler

ALLOWED = [3, 11, 17]


def test_sampler_keeps_to_the_allowed_ids_and_raw_logprobs_see_all() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 4
    params = [SamplingParams(temperature=0.0, allowed_token_ids=ALLOWED, logprobs=2),
              SamplingParams(temperature=1.0, seed=5, allowed_token_ids=[ALLOWED[0]]),
              SamplingParams(temperature=0.0)]  # a row without: untouched
    batch = make_batch([([1, 2], [], p) for p in params])
    output = Sampler()(logits.clone(), make_metadata(batch, vocab_size=40))
    sampled = output.sampled_token_ids.tolist()
    assert sampled[0] == ALLOWED[int(logits[0, ALLOWED].argmax())]
    assert sampled[1] == ALLOWED[0]
    assert sampled[2] == int(logits[2].argmax())
    top = output.logprobs.token_ids[0, 1:].tolist()  # raw logprobs: the whole vocabulary ranks
    assert top == logits[0].topk(2).indices.tolist()


@pytest.mark.parametrize(("value", "message"), [
    ([], "allowed_token_ids must be a non-empty list of token ids"),
    ([1, -2], "allowed_token_ids must be a non-empty list of token ids"),
    ("3", "allowed_token_ids must be a non-empty list of token ids"),
])
def test_bad_lists_are_refused(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(allowed_token_ids=value)


def test_engine_greedy_picks_the_best_allowed_token_as_transformers_ranks_it(tiny_llama: Path) -> None:
    prompt = [1, 5, 9, 14, 3]
    allowed = [7, 100, 250, 333]
    llm = make_llm(tiny_llama)
    try:
        completion = llm.generate([{"prompt_token_ids": prompt}],
                                  SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                 allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
        with pytest.raises(ValueError, match="allowed_token_ids has token ids outside the vocabulary"):
            llm.generate("x", SamplingParams(allowed_token_ids=[1 << 20]), use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = list(completion.token_ids)
    logits = hf_logits(tiny_llama, prompt + tokens)[len(prompt) - 1:-1]
    assert tokens == [allowed[int(row[allowed].argmax())] for row in logits]


def test_only_suppressed_stop_tokens_allowed_is_refused(tiny_llama: Path) -> None:
    """min_tokens suppresses EOS and stop_token_ids: allowed_token_ids made only of them would
    leave nothing to sample (the draw would return a token outside them); refused, the engine going on."""
    llm = make_llm(tiny_llama, multiprocess=True)
    try:
        eos = llm.get_tokenizer().eos_token_id
        with pytest.raises(ValueError, match="are all stop tokens, which min_tokens=2 suppresses"):
            llm.generate("x", SamplingParams(allowed_token_ids=[eos], min_tokens=2), use_tqdm=False)
        with pytest.raises(ValueError, match="are all stop tokens"):
            llm.generate("x", SamplingParams(allowed_token_ids=[9], stop_token_ids=[9], min_tokens=1), use_tqdm=False)
        ok = llm.generate("x", SamplingParams(allowed_token_ids=[eos], min_tokens=2, ignore_eos=True, max_tokens=3),
                          use_tqdm=False)[0].outputs[0]
        assert list(ok.token_ids) == [eos] * 3
    finally:
        llm.shutdown()


def test_rows_left_without_a_token_are_reported_not_drawn_from() -> None:
    """The sampler names the rows whose allowed_token_ids (here with a grammar's bitmask) left
    every logit -inf (`emptied_rows`); rows with something left, constrained or not, are not."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[3]),  # the grammar allows 5 only: nothing left
              SamplingParams(temperature=1.0, seed=2, allowed_token_ids=[3, 5]),  # 5 left
              SamplingParams(temperature=0.0)]
    batch = make_batch([([1, 2], [], p) for p in params])
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[:, 0] = 1 << 5  # token 5 only
    grammar = GrammarBitmask(torch.tensor([0, 1]), bitmask)
    output = Sampler()(logits.clone(), make_metadata(batch, vocab_size=40), grammar)
    assert output.emptied_rows.tolist() == [0]
    assert output.sampled_token_ids.tolist()[1:] == [5, int(logits[2].argmax())]
    unconstrained = Sampler()(logits.clone(), make_metadata(batch, vocab_size=40))
    assert unconstrained.emptied_rows is None
