"""TokenPieces: with a byte-level decoder, most tokens take their text from a per-tokenizer table
instead of a DecodeStream step. Every piece must be exactly what the stream alone returns, token
by token, for any sequence: random ids (byte tokens that split characters, added and special
tokens among them), with and without skip_special_tokens, then flushed or finished by
decode_rest."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from vllm_lite.engine.detokenizer import FastIncrementalDetokenizer, TokenPieces, fast_backend

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def _sequences(tokenizer, count: int) -> list[list[int]]:
    rng = random.Random(0)
    vocab = fast_backend(tokenizer).get_vocab_size()
    added = sorted(fast_backend(tokenizer).get_added_tokens_decoder())
    texts = ["🙂🚀 你好世界", "héllo wörld naïve 🇯🇵", "plain words and 12.5 numbers"]
    sequences = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    for _ in range(count):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        for _ in range(rng.randrange(3)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(added))
        sequences.append(ids)
    return sequences


def test_the_tiny_tokenizer_takes_the_table(tokenizer) -> None:
    pieces = TokenPieces.for_tokenizer(tokenizer)
    assert pieces is not None  # byte-level: otherwise the test below would test nothing
    hello = tokenizer.encode(" hello", add_special_tokens=False)
    assert pieces.get(hello[0]) is not None
    assert pieces.get(sorted(fast_backend(tokenizer).get_added_tokens_decoder())[0]) is None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_pieces_equal_the_stream_token_by_token(tokenizer, skip_special_tokens: bool) -> None:
    backend, pieces = fast_backend(tokenizer), TokenPieces.for_tokenizer(tokenizer)
    for ids in _sequences(tokenizer, 300):
        plain = FastIncrementalDetokenizer(backend, PROMPT, skip_special_tokens)
        tabled = FastIncrementalDetokenizer(backend, PROMPT, skip_special_tokens, pieces)
        assert [tabled.add_token(t) for t in ids] == [plain.add_token(t) for t in ids], ids
        assert tabled.flush() == plain.flush(), ids


@pytest.mark.parametrize("split", [1, 3, 7])
def test_pieces_then_batches_and_the_rest_equal_the_stream(tokenizer, split: int) -> None:
    """Tokens added one by one (from the table or not), then in batches, then the rest decoded
    at the end: the same text as the stream alone."""
    backend, pieces = fast_backend(tokenizer), TokenPieces.for_tokenizer(tokenizer)
    for ids in _sequences(tokenizer, 100):
        head, middle, tail = ids[:split], ids[split:2 * split], ids[2 * split:]
        texts = []
        for table in (None, pieces):
            detokenizer = FastIncrementalDetokenizer(backend, PROMPT, True, table)
            text = "".join(detokenizer.add_token(t) for t in head) + detokenizer.add_tokens(middle)
            texts.append(text + detokenizer.decode_rest(tail))
        assert texts[0] == texts[1], ids
