"""A logprob token's text where a UTF-8 character spans byte tokens (vLLM 0.32's rule): a token
that only starts or continues a character is "", the one that completes it carries the whole
character, so the texts of consecutive positions join into the decoded text (prompt and sampled
tokens alike, the sampled ones reading the prompt's last tokens as their context)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from vllm_lite.engine.logprobs import LogprobsState

TEXT = "a😀 日本語 z é中"


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def _state(tokenizer, prompt: list[int], num_logprobs: int | None, num_prompt_logprobs: int | None) -> LogprobsState:
    return LogprobsState(num_logprobs, num_prompt_logprobs, len(prompt), lambda t: tokenizer.decode([t]),
                         tokenizer.decode, prompt)


def test_byte_tokens_split_the_characters(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert sum(tokenizer.decode([t]).endswith("\ufffd") for t in ids) >= 4  # (else this tests nothing)


def test_prompt_tokens_join_into_the_text(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    state = _state(tokenizer, ids, None, 1)
    rows = len(ids) - 1
    other = np.full(rows, 5, dtype=np.int32)  # a top-1 alternative at every position: " " or such, complete
    state.add_prompt_rows(0, np.stack([np.array(ids[1:], dtype=np.int32), other], axis=1),
                          np.zeros((rows, 2), dtype=np.float32), np.ones((rows, 2), dtype=np.int32))
    entries = state.prompt_logprobs()
    texts = [entry[token].decoded_token for entry, token in zip(entries[1:], ids[1:])]
    assert tokenizer.decode(ids[:1]) + "".join(texts) == TEXT
    assert "" in texts and "😀" in texts and "語" in texts


@pytest.mark.parametrize("split", [2, 3, 5])
def test_sampled_tokens_read_the_prompt_before_them(tokenizer, split: int) -> None:
    """The prompt ends inside a character (split of the token ids): the first sampled tokens
    complete it."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt, output = ids[:split], ids[split:]
    state = _state(tokenizer, prompt, 0, None)
    for token in output:
        state.add_sample_row(np.array([token], dtype=np.int32), np.zeros(1, dtype=np.float32),
                             np.ones(1, dtype=np.int32))
    texts = [entry[token].decoded_token for entry, token in zip(state.logprobs, output)]
    complete_prompt = tokenizer.decode(prompt).rstrip("\ufffd")
    assert complete_prompt + "".join(texts) == TEXT


def test_without_text_nothing_is_decoded(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    state = LogprobsState(0, None, 1, lambda t: None, None, ids[:1])
    state.add_sample_row(np.array(ids[1:2], dtype=np.int32), np.zeros(1, dtype=np.float32), np.ones(1, dtype=np.int32))
    assert state.logprobs[0][ids[1]].decoded_token is None
