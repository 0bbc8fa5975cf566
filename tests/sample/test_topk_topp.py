"""top-k / top-p truncation: the native CPU op and the torch rule keep the same tokens and draw
the same token from the same uniform, on flat, peaked, tied and partly masked distributions;
and the kept set is what the definition says."""

from __future__ import annotations

import pytest
import torch

from vllm_lite import _custom_ops as cpu_native
from vllm_lite.sample.ops.topk_topp import sample_truncated, mask_top_k_top_p, sample

VOCAB = 3000
ROWS = 48


def _logits(kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed({"flat": 1, "peaked": 2, "tied": 3, "masked": 4}[kind])
    if kind == "flat":
        return torch.randn(ROWS, VOCAB, generator=gen) * 0.05
    if kind == "peaked":
        return torch.randn(ROWS, VOCAB, generator=gen) * 6
    if kind == "tied":  # few distinct values: thresholds land on ties
        return torch.randint(0, 4, (ROWS, VOCAB), generator=gen).float()
    logits = torch.randn(ROWS, VOCAB, generator=gen) * 2
    logits[:, ::3] = float("-inf")  # as min-p leaves them
    return logits


def _params() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    top_k = torch.tensor([0, 1, 5, 50, 0, 2999, 3000, 7] * (ROWS // 8), dtype=torch.long)
    top_p = torch.tensor([0.5, 1.0, 0.9, 1.0, 0.99, 0.3, 0.7, 1e-6] * (ROWS // 8))
    return top_k, top_p, torch.rand(ROWS, generator=gen)


def _kept_by_definition(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """Sort-based reference, one row: probability >= the k-th largest, then the smallest
    most-likely-first prefix holding p of the kept mass, ties at either cut kept."""
    probs = logits.softmax(-1)
    values = probs.sort(descending=True).values
    k_cut = values[k - 1] if 0 < k < len(values) else values[-1]
    kept = probs >= k_cut
    if p < 1.0:
        kept_values = values[values >= k_cut]
        mass = kept_values.double().cumsum(0)
        boundary = int(torch.searchsorted(mass, p * mass[-1]))
        kept &= probs >= kept_values[min(boundary, len(kept_values) - 1)]
    return kept & (probs > 0)


@pytest.mark.parametrize("kind", ["flat", "peaked", "tied", "masked"])
def test_torch_rule_keeps_the_defined_set(kind: str) -> None:
    logits = _logits(kind)
    top_k, top_p, _ = _params()
    masked = logits.clone()
    mask_top_k_top_p(masked, top_k, top_p)
    for row in range(ROWS):
        expected = _kept_by_definition(logits[row], int(top_k[row]), float(top_p[row]))
        assert torch.equal(masked[row] > float("-inf"), expected), f"row {row}"


@pytest.mark.skipif(not cpu_native.is_available(), reason="csrc extension not built")
@pytest.mark.parametrize("kind", ["flat", "peaked", "tied", "masked"])
def test_native_op_draws_what_the_torch_rule_draws(kind: str) -> None:
    logits = _logits(kind)
    top_k, top_p, uniforms = _params()
    native = cpu_native.top_k_top_p_sample(logits.clone(), top_k, top_p, uniforms)
    masked = logits.clone()
    mask_top_k_top_p(masked, top_k, top_p)
    assert torch.equal(native, sample_truncated(masked, uniforms))
    assert torch.equal(sample(logits.clone(), top_k, top_p, uniforms), native)  # the dispatch


@pytest.mark.skipif(not cpu_native.is_available(), reason="csrc extension not built")
@pytest.mark.parametrize("vocab", range(3000, 3016))
def test_ties_reaching_into_the_last_partial_vector_stay_ties(vocab: int) -> None:
    """Every remainder of the vocabulary modulo 16 lanes (and so 8 and 4): a tied value among
    the last tokens, those past the last whole vector, gets the probability it gets anywhere
    else, so a threshold on that tie keeps all of it as the torch rule does (a scalar exp there,
    an ulp off the vector one, left the last tokens out at 16 lanes)."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randint(0, 4, (ROWS, vocab), generator=gen).float()
    logits[:, -16:] = 2.0  # the boundary tie of top-p 0.7 (the 3s hold ~0.64 of the mass)
    top_k = torch.zeros(ROWS, dtype=torch.long)
    top_p = torch.full((ROWS,), 0.7)
    uniforms = torch.rand(ROWS, generator=gen)
    masked = logits.clone()
    mask_top_k_top_p(masked, top_k, top_p)
    assert bool((masked[:, -16:] == 2.0).all())  # (the torch rule keeps the whole tie)
    native = cpu_native.top_k_top_p_sample(logits.clone(), top_k, top_p, uniforms)
    assert torch.equal(native, sample_truncated(masked, uniforms))


@pytest.mark.skipif(not cpu_native.is_available(), reason="csrc extension not built")
@pytest.mark.parametrize("kind", ["flat", "peaked", "tied", "masked"])
def test_untruncated_rows_draw_what_the_torch_softmax_draws(kind: str) -> None:
    """Rows without top-k or top-p go to the native op too (whole blocks skipped by their sums,
    one block walked): the token torch's softmax + cumsum + search draws, rows of a vocabulary
    that is no whole number of blocks or vectors, and rows with top-k 0 / top-p 1.0 among
    truncated ones."""
    logits = _logits(kind)
    uniforms = _params()[2]
    reference = sample_truncated(logits.clone(), uniforms)
    assert torch.equal(sample(logits.clone(), None, None, uniforms), reference)
    top_k, top_p, _ = _params()
    top_k[::4], top_p[::4] = 0, 1.0
    mixed = cpu_native.top_k_top_p_sample(logits.clone(), top_k, top_p, uniforms)
    assert torch.equal(mixed[::4], reference[::4])


def test_a_draw_at_the_ends_of_the_distribution_takes_a_kept_token() -> None:
    """u = 0 takes the first token with any mass; u just below 1 the last one (never a masked
    token past it), with and without the native op."""
    logits = torch.full((2, 700), float("-inf"))
    logits[:, [3, 300, 650]] = torch.tensor([0.0, 1.0, 2.0])
    uniforms = torch.tensor([0.0, 1.0 - 2 ** -24])
    assert sample(logits.clone(), None, None, uniforms).tolist() == [3, 650]
    assert sample_truncated(logits.clone(), uniforms).tolist() == [3, 650]


@pytest.mark.parametrize("with_top_p", [True, False])
def test_every_row_masked_draws_what_the_truncated_rows_alone_draw(with_top_p: bool) -> None:
    """Off the CPU every row takes part in the masking, the untruncated ones too (their choices of
    work, the widest top-k and whether any row has a top-p, come from the host values): an
    untruncated row keeps every token, so the draws equal those of masking only the truncated rows
    (the CPU's torch path; float64 logits keep the native op out)."""
    logits = _logits("masked").double()
    top_k, top_p, uniforms = _params()
    top_k[::3] = 0  # untruncated rows (with top_p 1.0 below), mixed with truncated ones
    top_p = torch.where(top_k == 0, 1.0, top_p) if with_top_p else torch.ones(ROWS)
    truncated = (top_k > 0) | (top_p < 1.0)
    assert bool(truncated.any()) and not bool(truncated.all())
    every_row = logits.clone()
    mask_top_k_top_p(every_row, top_k, top_p, VOCAB, not with_top_p)
    assert torch.equal(every_row[~truncated], logits[~truncated])
    for row in range(ROWS):
        expected = _kept_by_definition(logits[row], int(top_k[row]), float(top_p[row]))
        assert torch.equal(every_row[row] > float("-inf"), expected), f"row {row}"
    drawn = sample(logits.clone(), top_k, top_p, uniforms, top_k.numpy(), top_p.numpy())
    assert torch.equal(drawn, sample_truncated(every_row, uniforms))


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = _logits("peaked")
    uniforms = torch.rand(ROWS, generator=torch.Generator().manual_seed(5))
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits.clone(), torch.ones(ROWS, dtype=torch.long), None, uniforms), greedy)
    assert torch.equal(sample(logits.clone(), None, torch.full((ROWS,), 1e-6), uniforms), greedy)


@pytest.mark.skipif(not cpu_native.is_available(), reason="csrc extension not built")
@pytest.mark.parametrize("scale", [0.01, 0.3, 3.0, 12.0])
def test_native_op_on_a_large_vocabulary(scale: float) -> None:
    """50,000 tokens: the thresholds' buckets hold hundreds to thousands of values (the native
    op's second histogram level narrows those); the draws still equal the torch rule's."""
    rows, vocab = 16, 50_000
    gen = torch.Generator().manual_seed(int(scale * 100))
    logits = torch.randn(rows, vocab, generator=gen) * scale
    logits[::4, ::7] = float("-inf")
    top_k = torch.tensor([0, 1, 40, 1000, 0, 25_000, 49_999, 300] * 2, dtype=torch.long)
    top_p = torch.tensor([0.95, 1.0, 0.5, 1.0, 0.3, 0.9, 0.99, 0.8] * 2)
    uniforms = torch.rand(rows, generator=gen)
    native = cpu_native.top_k_top_p_sample(logits.clone(), top_k, top_p, uniforms)
    masked = logits.clone()
    mask_top_k_top_p(masked, top_k, top_p)
    assert torch.equal(native, sample_truncated(masked, uniforms))
