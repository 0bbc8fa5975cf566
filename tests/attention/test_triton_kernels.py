"""Triton kernels under TRITON_INTERPRET=1 (set by tests/conftest.py before triton is imported),
or compiled on a CUDA GPU where TRITON_INTERPRET=0 (`make gpu-check`), against the torch reference
backend: fp32, max abs error <= 1e-5.

The interpreter costs about a millisecond per program instance, so shapes stay tiny."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from paged_inputs import TRITON_DEVICE, make_paged_batch, reference_forward  # noqa: E402

from vllm_lite.attention.ops.triton_reshape_and_cache import reshape_and_cache  # noqa: E402
from vllm_lite.attention.ops.triton_unified_attention import (  # noqa: E402
    split_kv_attention,
    unified_attention,
)
from vllm_lite.attention.triton_backend import TritonAttentionBackend  # noqa: E402

ATOL = 1e-5
# (context_len, query_len): plain prefills (partial last blocks), prefix-cache hits followed by
# a chunk, decodes, a one-token prompt; ragged throughout.
MIXED = [(0, 5), (13, 1), (20, 7), (3, 1), (0, 1), (9, 2)]
DECODES = [(30, 1), (5, 1), (47, 1), (0, 1)]
GQA = [(2, 2), (4, 1), (7, 1)]  # (q heads, kv heads): ratios 1, 4, 7


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_reshape_and_cache_writes_slots_and_skips_padding():
    batch = make_paged_batch([(3, 4), (0, 6)], 4, 2, 16, block_size=4, seed=1, num_padded=2, device=TRITON_DEVICE)
    expected = batch.kv_cache.clone()
    slots = batch.common.slot_mapping
    real = slots >= 0
    bs = batch.common.block_size
    expected[slots[real] // bs, 0, slots[real] % bs] = batch.key[real]
    expected[slots[real] // bs, 1, slots[real] % bs] = batch.value[real]
    cache = batch.kv_cache.clone()
    reshape_and_cache(batch.key, batch.value, cache, slots)  # strided key/value views
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [4, 16])
def test_unified_attention_mixed_batch(num_q_heads, num_kv_heads, block_size):
    batch = make_paged_batch(MIXED, num_q_heads, num_kv_heads, 32, block_size, seed=block_size + num_q_heads,
                             device=TRITON_DEVICE)
    ref_out, ref_cache = reference_forward(batch)
    cache = batch.kv_cache.clone()
    common = batch.common
    reshape_and_cache(batch.key, batch.value, cache, common.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))
    unified_attention(out, batch.query, cache, common.block_table, common.seq_lens,
                      common.query_start_loc, batch.scale)
    assert torch.equal(cache, ref_cache)
    assert _max_err(out, ref_out) <= ATOL


def test_unified_attention_odd_head_dim_tiny_blocks_long_chunk():
    """head_dim 24 (padded to 32 inside), block_size 2 (a tile spans 16 blocks), and a
    prefill chunk longer than one query block after a prefix hit."""
    batch = make_paged_batch([(6, 21), (11, 1), (0, 3)], 8, 2, 24, block_size=2, seed=3, device=TRITON_DEVICE)
    ref_out, ref_cache = reference_forward(batch)
    cache = batch.kv_cache.clone()
    common = batch.common
    reshape_and_cache(batch.key, batch.value, cache, common.slot_mapping)
    out = torch.empty_like(batch.query)
    unified_attention(out, batch.query, cache, common.block_table, common.seq_lens,
                      common.query_start_loc, batch.scale, tile_size=16)
    assert _max_err(out, ref_out) <= ATOL


@pytest.mark.parametrize("num_q_heads,num_kv_heads", GQA)
def test_split_kv_decode(num_q_heads, num_kv_heads):
    batch = make_paged_batch(DECODES, num_q_heads, num_kv_heads, 32, block_size=8, seed=num_q_heads,
                             device=TRITON_DEVICE)
    ref_out, _ = reference_forward(batch)
    cache = batch.kv_cache.clone()
    common = batch.common
    reshape_and_cache(batch.key, batch.value, cache, common.slot_mapping)
    out = torch.empty_like(batch.query)
    # 4 segments of one 16-key tile: sequences shorter than that leave segments empty.
    split_kv_attention(out, batch.query, cache, common.block_table, common.seq_lens,
                       common.query_start_loc, batch.scale, num_segments=4)
    assert _max_err(out, ref_out) <= ATOL


@pytest.mark.parametrize("specs", [MIXED, DECODES], ids=["mixed", "decode_split_kv"])
def test_triton_backend_matches_torch_backend(specs):
    batch = make_paged_batch(specs, 4, 1, 16, block_size=8, seed=7, device=TRITON_DEVICE)
    ref_out, ref_cache = reference_forward(batch)
    backend = TritonAttentionBackend()
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.query, batch.key, batch.value, cache, backend.build(batch.common), batch.scale)
    assert torch.equal(cache, ref_cache)
    assert _max_err(out, ref_out) <= ATOL


def test_padded_decode_batch_like_cuda_graph_replay():
    """Padded rows (slot -1, seq_len 0) write nothing and come out as zeros, not NaN."""
    batch = make_paged_batch(DECODES[:3], 4, 2, 16, block_size=4, seed=9, num_padded=3, device=TRITON_DEVICE)
    ref_out, ref_cache = reference_forward(batch)
    backend = TritonAttentionBackend()
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.query, batch.key, batch.value, cache, backend.build(batch.common), batch.scale)
    n = ref_out.shape[0]
    assert torch.equal(cache, ref_cache)
    assert _max_err(out[:n], ref_out) <= ATOL
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


@pytest.mark.parametrize("specs", [MIXED, DECODES], ids=["mixed", "decode_split_kv"])
# (not ALiBi with sinks: no model has both, and the kernel's relative ALiBi form leaves out a
# per-row constant that only a softmax without a sink drops)
@pytest.mark.parametrize("terms", ["alibi", "sinks", "alibi+window", "sinks+window"])
def test_alibi_slopes_and_attention_sinks(specs, terms):
    """Bloom's / MPT's ALiBi slopes and gpt-oss's sinks as the torch reference applies them, in
    the unified kernel and the split-KV one (whose segments must count each sink once), beside
    CUDA-graph padding rows, which stay zeros."""
    from vllm_lite.model.models.bloom import alibi_slopes

    num_q_heads = 6
    batch = make_paged_batch(specs, num_q_heads, 2, 16, block_size=4, seed=11, num_padded=2, device=TRITON_DEVICE)
    gen = torch.Generator().manual_seed(5)
    slopes = alibi_slopes(num_q_heads).to(TRITON_DEVICE) if "alibi" in terms else None
    sinks = (2 * torch.randn(num_q_heads, generator=gen)).to(TRITON_DEVICE) if "sinks" in terms else None
    window = 5 if "window" in terms else None
    ref_out, ref_cache = reference_forward(batch, window, None, slopes, sinks)
    assert _max_err(ref_out, reference_forward(batch, window)[0]) > 1e-2  # the terms matter here
    backend = TritonAttentionBackend()
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.query, batch.key, batch.value, cache, backend.build(batch.common), batch.scale,
                          window, None, slopes, sinks)
    n = ref_out.shape[0]
    assert torch.equal(cache, ref_cache)
    assert _max_err(out[:n], ref_out) <= ATOL
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


def test_head_terms_of_another_shape_or_device_are_refused():
    batch = make_paged_batch(DECODES, 4, 2, 16, block_size=4, device=TRITON_DEVICE)
    common = batch.common
    out = torch.empty_like(batch.query)
    with pytest.raises(ValueError, match=r"sinks: one float per query head .* \[4\]"):
        unified_attention(out, batch.query, batch.kv_cache, common.block_table, common.seq_lens,
                          common.query_start_loc, batch.scale, sinks=torch.zeros(3, device=TRITON_DEVICE))
