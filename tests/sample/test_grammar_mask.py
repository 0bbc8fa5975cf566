"""The grammar bitmask op: only the constrained rows change, exactly their disallowed tokens
become -inf (checked against xgrammar's own op), the csrc op equals the torch fallback (padded
vocabularies, all-allowed words, strided logits), sampling stays inside the allowed set, and a
batch without constrained rows is not copied."""

from __future__ import annotations

import pytest
import torch
import xgrammar

from sampling_fixtures import make_batch, make_metadata
from vllm_lite.sample.copy_counter import LogitsCopyCounter
from vllm_lite import _custom_ops as cpu_native
from vllm_lite.sample.ops.grammar_mask import GrammarBitmask, apply_grammar_bitmask, apply_grammar_bitmask_torch
from vllm_lite.sample.sampler import Sampler
from vllm_lite.sampling_params import SamplingParams

VOCAB = 70  # not a multiple of 32: the last word is partly padding


def random_bitmask(num_rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    words = -(-vocab // 32)
    bits = torch.randint(0, 2, (num_rows, words * 32), generator=torch.Generator().manual_seed(seed))
    bits[:, 3] = 1  # at least one allowed token per row
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    packed = (bits.view(num_rows, words, 32).to(torch.int64) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def test_matches_xgrammar_and_touches_only_constrained_rows() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    bitmask = random_bitmask(2, seed=1)
    rows = torch.tensor([1, 4])
    ours = logits.clone()
    apply_grammar_bitmask(ours, GrammarBitmask(rows, bitmask))
    reference = logits.clone()
    full = torch.full((6, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgrammar.apply_token_bitmask_inplace(reference, full)
    assert torch.equal(ours, reference)
    untouched = torch.tensor([0, 2, 3, 5])
    assert torch.equal(ours[untouched], logits[untouched])
    assert torch.isinf(ours[rows]).any()


@pytest.mark.skipif(not cpu_native.is_available(), reason="csrc extension not built")
@pytest.mark.parametrize(("vocab", "logits_vocab"), [(70, 70), (70, 100), (49152, 49152), (1000, 1024)])
def test_csrc_op_equals_the_torch_fallback(vocab: int, logits_vocab: int) -> None:
    """logits_vocab > vocab: logits padded past the mask's words, never allowed."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, logits_vocab + 5, generator=generator)[:, :logits_vocab]  # strided rows
    bitmask = random_bitmask(4, seed=3, vocab=vocab)
    bitmask[1] = -1  # every token allowed: the row stays as it was
    bitmask[2, ::2] = 0  # whole words disallowed
    grammar = GrammarBitmask(torch.tensor([8, 0, 3, 5]), bitmask)
    native, reference = logits.clone(), logits.clone()
    cpu_native.apply_token_bitmask_inplace(native, bitmask, grammar.logits_rows)
    apply_grammar_bitmask_torch(reference, grammar)
    assert torch.equal(native, reference)
    assert torch.equal(native[0, : bitmask.shape[1] * 32], logits[0, : bitmask.shape[1] * 32])
    with pytest.raises(RuntimeError, match="outside the logits"):
        cpu_native.apply_token_bitmask_inplace(native, bitmask, torch.tensor([0, 1, 2, 9]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5)])
def test_sampled_tokens_are_allowed(dtype: torch.dtype, params: SamplingParams) -> None:
    batch = make_batch([([1], [], params) for _ in range(4)])
    metadata = make_metadata(batch)
    bitmask = random_bitmask(4, seed=2)
    for seed in range(20):
        logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(seed)).to(dtype)
        tokens = Sampler()(logits, metadata, GrammarBitmask(torch.arange(4), bitmask)).sampled_token_ids
        words, bits = tokens // 32, tokens % 32
        assert ((bitmask[torch.arange(4), words] >> bits.to(torch.int32)) & 1).all()


def test_unconstrained_batch_is_not_copied() -> None:
    logits = torch.randn(8, VOCAB)
    metadata = make_metadata(make_batch([([1], [], SamplingParams(temperature=0.0)) for _ in range(8)]))
    with LogitsCopyCounter(logits) as counter:
        sampled = Sampler()(logits, metadata, None).sampled_token_ids
    assert counter.num_copies == 0, counter.ops
    assert torch.equal(sampled, logits.argmax(-1))
