"""Sliding-window and soft-capped attention in every backend against the torch reference, on
paged batches whose blocks before the window were freed: their block-table entries point at the
null block 0, which holds noise, so a kernel that reads outside the window shows."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from paged_inputs import TRITON_DEVICE, PagedBatch, make_paged_batch, reference_forward
from vllm_lite import _custom_ops as cpu_native

ATOL = 1e-5
WINDOW = 5
# (context_len, query_len): prefills longer than the window, chunks after a long context,
# decodes far past the window, a short decode inside it.
MIXED = [(0, 13), (21, 1), (20, 7), (3, 1), (40, 2), (9, 1)]
DECODES = [(30, 1), (5, 1), (47, 1), (2, 1)]


def _free_blocks_outside_window(batch: PagedBatch, window: int) -> torch.Tensor:
    """The block table as the KV-cache manager leaves it: blocks wholly before the first query's
    window replaced by block 0."""
    common = batch.common
    table = common.block_table.clone()
    query_lens = np.diff(common.query_start_loc_np)
    for row, (seq_len, query_len) in enumerate(zip(common.seq_lens_np, query_lens)):
        first_needed = max(int(seq_len - query_len) - window + 1, 0)
        table[row, : first_needed // common.block_size] = 0
    return table


def _with_table(batch: PagedBatch, table: torch.Tensor) -> PagedBatch:
    common = batch.common
    common = type(common)(**{**{f: getattr(common, f) for f in common.__dataclass_fields__},
                             "block_table": table})
    return PagedBatch(batch.query, batch.key, batch.value, batch.kv_cache, common, batch.scale)


SOFT_CAP = 2.0


def _check(batch: PagedBatch, run, soft_cap: float | None = None) -> None:
    ref_out, ref_cache = reference_forward(batch, WINDOW, soft_cap)
    full_out, _ = reference_forward(batch, None, soft_cap)
    assert (ref_out - full_out).abs().max().item() > 1e-2  # the window matters in this batch
    if soft_cap is not None:  # and so does the cap
        assert (ref_out - reference_forward(batch, WINDOW)[0]).abs().max().item() > 1e-2
    freed = _with_table(batch, _free_blocks_outside_window(batch, WINDOW))
    cache = batch.kv_cache.clone()
    out = run(freed, cache)
    assert torch.equal(cache, ref_cache)
    assert (out - ref_out).abs().max().item() <= ATOL


def test_soft_cap_reference_matches_direct_math() -> None:
    from vllm_lite.attention.torch_backend import attend

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=gen) for _ in range(3))
    scores = 3.0 * torch.tanh((q @ k.transpose(-1, -2)) * 0.5 / 3.0)
    scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    expected = torch.softmax(scores, -1) @ v
    assert torch.allclose(attend(q, k, v, None, 0.5, 3.0), expected, atol=1e-6)


@pytest.mark.parametrize("soft_cap", [None, SOFT_CAP])
@pytest.mark.parametrize("block_size", [4, 16])
def test_torch_backend_ignores_freed_blocks(block_size: int, soft_cap) -> None:
    from vllm_lite.attention.torch_backend import TorchAttentionBackend

    backend = TorchAttentionBackend()
    batch = make_paged_batch(MIXED, 4, 2, 32, block_size, seed=block_size)
    _check(batch, lambda b, cache: backend.forward(b.query, b.key, b.value, cache,
                                                   backend.build(b.common), b.scale, WINDOW, soft_cap),
           soft_cap)


native = pytest.mark.skipif(not cpu_native.is_available(), reason="vllm_lite._C is not built")


@native
@pytest.mark.parametrize("head_dim", [24, 32])  # the general and the tiled kernel
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("specs", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("soft_cap", [None, SOFT_CAP])
def test_cpu_native_backend_window(head_dim: int, block_size: int, specs, soft_cap) -> None:
    from vllm_lite.attention.cpu_native_backend import CpuNativeAttentionBackend

    backend = CpuNativeAttentionBackend()
    batch = make_paged_batch(specs, 4, 2, head_dim, block_size, seed=3)
    _check(batch, lambda b, cache: backend.forward(b.query, b.key, b.value, cache,
                                                   backend.build(b.common), b.scale, WINDOW, soft_cap),
           soft_cap)


triton_ok = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


@pytest.mark.skipif(not triton_ok, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("specs", [MIXED, DECODES], ids=["unified", "split_kv"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("soft_cap", [None, SOFT_CAP])
def test_triton_backend_window(specs, block_size: int, soft_cap) -> None:
    pytest.importorskip("triton")
    from vllm_lite.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend()  # decode-only batches take the split-KV kernel
    batch = make_paged_batch(specs, 4, 2, 32, block_size, seed=7, device=TRITON_DEVICE)
    _check(batch, lambda b, cache: backend.forward(b.query, b.key, b.value, cache,
                                                   backend.build(b.common), b.scale, WINDOW, soft_cap),
           soft_cap)
