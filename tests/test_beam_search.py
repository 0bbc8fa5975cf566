"""Beam search (vLLM's entrypoint-level algorithm, vllm_lite/beam_search.py): exact on a toy
model when the beam is wide enough, greedy at width 1, and on the real engine through
`LLM.beam_search`: deterministic, at least as likely as greedy, and its scores are the
engine's own logprobs of the sequences it returns."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from llm_factory import make_llm

from vllm_lite import LLM, SamplingParams
from vllm_lite.entrypoints.beam_search import BeamSearch, BeamSearchParams
from vllm_lite.outputs import Logprob

VOCAB = 4
EOS = 3


def toy_logprobs(tokens: list[int]) -> dict[int, Logprob]:
    """A fixed next-token distribution that depends on the last two tokens."""
    weights = [((tokens[-1] * 7 + tokens[-2] * 3 + t * 5) % 11) + 1 for t in range(VOCAB)]
    total = sum(weights)
    return {t: Logprob(math.log(w / total)) for t, w in enumerate(weights)}


def run_toy(prompt: list[int], params: BeamSearchParams) -> list:
    search = BeamSearch([prompt], params, EOS)
    while batch := search.pending():
        search.advance([toy_logprobs(tokens) for tokens in batch])
    return search.results()[0]


def test_wide_beam_finds_the_most_likely_sequence_and_width_one_is_greedy() -> None:
    prompt, steps = [1, 2], 3
    params = BeamSearchParams(beam_width=VOCAB ** (steps - 1), max_tokens=steps, ignore_eos=True)
    best = run_toy(prompt, params)[0]

    def cum(seq: tuple[int, ...]) -> float:
        tokens, total = list(prompt), 0.0
        for t in seq:
            total += toy_logprobs(tokens)[t].logprob
            tokens.append(t)
        return total

    exhaustive = max(itertools.product(range(VOCAB), repeat=steps), key=cum)
    assert best.tokens[len(prompt):] == list(exhaustive) and best.cum_logprob == pytest.approx(cum(exhaustive))
    greedy, tokens = [], list(prompt)
    for _ in range(steps):
        entry = toy_logprobs(tokens)
        tokens.append(max(entry, key=lambda t: entry[t].logprob))
        greedy.append(tokens[-1])
    narrow = run_toy(prompt, BeamSearchParams(beam_width=1, max_tokens=steps, ignore_eos=True))
    assert narrow[0].tokens[len(prompt):] == greedy


def test_eos_finishes_a_beam_and_length_penalty_is_vllms() -> None:
    results = run_toy([1, 2], BeamSearchParams(beam_width=4, max_tokens=4))
    assert len(results) == 4
    for beam in results:
        generated = beam.tokens[2:]
        assert EOS not in generated[:-1]
        assert beam.finish_reason == ("stop" if generated[-1] == EOS else "length")
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=1)


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path) -> Iterator[LLM]:
    llm = make_llm(tiny_qwen3, max_model_len=128)
    yield llm
    llm.shutdown()


PROMPTS = ["The river", "A mountain of", "Once upon a time"]


def test_llm_beam_search_on_the_engine(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    first = llm.beam_search(PROMPTS, params)
    assert [[s.tokens for s in o.sequences] for o in first] == \
        [[s.tokens for s in o.sequences] for o in llm.beam_search(PROMPTS, params)]
    narrow = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    differs = 0
    for prompt, wide, one, plain in zip(PROMPTS, first, narrow, greedy):
        prompt_len = len(tokenizer.encode(prompt))
        assert one.sequences[0].tokens[prompt_len:] == plain.outputs[0].token_ids  # width 1 is greedy
        best = wide.sequences[0]
        assert len(wide.sequences) == 3 and best.cum_logprob >= one.sequences[0].cum_logprob - 1e-4
        # vLLM's LLM.beam_search text: the whole sequence's, the prompt's included.
        assert best.text == tokenizer.decode(best.tokens, skip_special_tokens=True)
        assert best.text.startswith(tokenizer.decode(best.tokens[:prompt_len], skip_special_tokens=True))
        differs += best.tokens != one.sequences[0].tokens
        # The score is the engine's own likelihood of the sequence (rescored as a prompt).
        rescored = llm.generate({"prompt_token_ids": best.tokens}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)[0].prompt_logprobs
        total = sum(entry[t].logprob for t, entry in zip(best.tokens[prompt_len:], rescored[prompt_len:]))
        assert total == pytest.approx(best.cum_logprob, abs=1e-3)
    assert differs >= 1  # a wider beam finds something greedy does not, on these prompts
