"""vLLM's bad_words: a word's last token is banned where the output (never the prompt) ends with
the rest of the word; words are tokenized as at the start of a text and after a space. On the
sampler, and end to end against a greedy decode of transformers' logits with the same rule (the
server's field: tests/entrypoints/test_vllm_extensions.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_reference import hf_logits
from llm_factory import make_llm
from sampling_fixtures import make_batch, make_metadata
from vllm_lite import SamplingParams
from vllm_lite.sample.sampler import Sampler

NEW_TOKENS = 8


def test_sampler_bans_the_last_token_where_the_output_ends_with_the_rest() -> None:
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(0)) * 4
    best = logits.argmax(dim=1).tolist()
    second = logits.topk(2, dim=1).indices[:, 1].tolist()
    requests = [
        ([1, 2], [5, 6], [[6, best[0]], [7, best[0]]]),  # the output ends with 6: banned
        ([1, 6], [], [[6, best[1]]]),  # 6 ends the prompt only: not banned (vLLM's rule)
        ([1], [3], [[best[2]]]),  # a one-token word: always banned
        ([1], [6], []),  # no bad words: untouched
    ]
    batch = make_batch([(prompt, output, SamplingParams(temperature=0.0, bad_words_token_ids=words or None))
                        for prompt, output, words in requests])
    sampled = Sampler()(logits.clone(), make_metadata(batch, vocab_size=40)).sampled_token_ids.tolist()
    assert sampled == [second[0], best[1], second[2], best[3]]


@pytest.mark.parametrize(("fields", "message"), [
    ({"bad_words": [""]}, "bad_words must be a list of non-empty strings"),
    ({"bad_words": "word"}, "bad_words must be a list of non-empty strings"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids must be a list of non-empty lists of token ids"),
    ({"bad_words_token_ids": [[1, -1]]}, "bad_words_token_ids must be a list of non-empty lists of token ids"),
    ({"bad_words_token_ids": [[1]] * 129}, "at most 128 token sequences"),
    ({"bad_words_token_ids": [[1] * 600] * 2}, "at most 1024 token ids in all"),
])
def test_bad_values_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_words_are_tokenized_alone_and_after_a_space() -> None:
    vocab = {"cat": [7], " cat": [8], "big dog": [3, 4], " big dog": [5, 4], "a b": [1, 2], " a b": [1, 2, 9]}
    params = SamplingParams(bad_words=["cat", "  big dog", "a b", "cat"])
    assert params.bad_words == ["cat", "  big dog", "a b"]  # repeats dropped, as vLLM
    tokenized = params.with_bad_words_tokenized(vocab.__getitem__).bad_words_token_ids
    # " a b" is kept out: its first token is the same (vLLM's rule; also a different length)
    assert tokenized == [[7], [8], [3, 4], [5, 4], [1, 2]]
    with pytest.raises(ValueError, match="give one of them, not both"):
        SamplingParams(bad_words=["cat"], bad_words_token_ids=[[1]]).with_bad_words_tokenized(vocab.__getitem__)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        params.with_bad_words_tokenized(None)
    with pytest.raises(ValueError, match="must tokenize to at least one token"):
        SamplingParams(bad_words=[" "]).with_bad_words_tokenized(lambda text: [])


def _reference(model: Path, prompt: list[int], words: list[list[int]], fired: list[int]) -> list[int]:
    """Greedy on transformers' logits with vLLM's rule; counts the bans of multi-token words."""
    output: list[int] = []
    for _ in range(NEW_TOKENS):
        logits = hf_logits(model, prompt + output)[-1].clone()
        for word in words:
            prefix = word[:-1]
            if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
                logits[word[-1]] = float("-inf")
                fired[0] += len(prefix) > 0
        output.append(int(logits.argmax()))
    return output


def test_engine_matches_a_transformers_decode_with_the_rule(tiny_llama: Path,
                                                            prompts_token_ids: list[list[int]]) -> None:
    prompts = prompts_token_ids[:4]
    plain = [_reference(tiny_llama, p, [], [0]) for p in prompts]
    # Per request: its own output's tokens 2 -> 3 (fires at step 3), and for the first a word
    # whose prefix is the prompt's last token (not matched: the prompt is not the output).
    words = [[[out[2], out[3]]] for out in plain]
    words[0].append([prompts[0][-1], plain[0][0]])
    fired = [0]
    expected = [_reference(tiny_llama, p, w, fired) for p, w in zip(prompts, words)]
    assert fired[0] >= len(prompts) and expected != plain
    for engine_args in ({}, {"multiprocess": True, "async_scheduling": True}):
        llm = make_llm(tiny_llama, **engine_args)
        try:
            params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, bad_words_token_ids=w)
                      for w in words]
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outputs] == expected, engine_args
        finally:
            llm.shutdown()


def test_engine_tokenizes_text_words(tiny_llama: Path, prompts_token_ids: list[list[int]]) -> None:
    prompt = prompts_token_ids[2]
    llm = make_llm(tiny_llama)
    try:
        tokenizer = llm.get_tokenizer()
        plain = _reference(tiny_llama, prompt, [], [0])

        def tokenized(word: str) -> list[list[int]]:
            return SamplingParams(bad_words=[word]).with_bad_words_tokenized(
                lambda text: tokenizer.encode(text, add_special_tokens=False)).bad_words_token_ids

        # a word the output spells with the tokens the word's own tokenization gives
        word = next(w for i in range(NEW_TOKENS - 1) if plain[i:i + 2] in tokenized(w := tokenizer.decode(plain[i:i + 2])))
        expected = _reference(tiny_llama, prompt, tokenized(word), [0])
        assert expected != plain
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, bad_words=[word])
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        assert list(output.token_ids) == expected
        with pytest.raises(ValueError, match="bad_words_token_ids has token ids outside the vocabulary"):
            llm.generate("x", SamplingParams(bad_words_token_ids=[[1 << 20]]), use_tqdm=False)
    finally:
        llm.shutdown()
