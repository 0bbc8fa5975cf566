"""The int8_per_token_head KV cache: the torch reference's rule (vllm_lite/attention/kv_quant.py),
the csrc cache write (the same bytes) and decode op (the torch backend's attention over the same
cache, to fp32 rounding), and the cpu_native backend against the torch backend on mixed batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_inputs import BACKEND_SPECS, PagedBatch, make_paged_batch, reference_forward

from vllm_lite import _custom_ops as cpu_native
from vllm_lite.attention.kv_quant import dequantize_rows, quantize_rows
from vllm_lite.attention.selector import get_attn_backend

native = pytest.mark.skipif(not cpu_native.is_available(), reason="csrc extension not built")
# fp32 sums in another order than SDPA's over the same dequantized values
ATOL = 2e-5


def scale_of(rows: torch.Tensor) -> torch.Tensor:
    return rows[..., -4:].contiguous().view(torch.float32)[..., 0]


def test_rule_scale_rounding_and_bounds():
    x = torch.tensor([[0.9, -2.0, 0.0, 0.3], [0.0, 0.0, 0.0, 0.0], [-1.0, 0.4, 0.2, -0.006]])
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (3, 8)
    scale = scale_of(rows)
    assert torch.equal(scale, torch.stack([x[0].abs().max() / 127, torch.tensor(1e-6), x[2].abs().max() / 127]))
    codes = rows[..., :4]
    assert codes[0].tolist() == [57, -127, 0, 19]  # 0.9 * 63.5 = 57.15, 0.3 * 63.5 = 19.05
    assert codes[1].tolist() == [0, 0, 0, 0]  # an all-zero row keeps the floor scale
    assert codes[2].tolist() == [-127, 51, 25, -1]  # 50.8, 25.4, -0.762
    error = (dequantize_rows(rows, torch.float32) - x).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-6)).all()


def test_negative_halves_round_away_from_zero():
    # scale 1 (abs-max 127): the codes are the values rounded half away from zero
    x = torch.tensor([[127.0, -2.5, 2.5, -0.5, 0.5, 1.49, -1.51, -127.0]])
    assert quantize_rows(x)[0, :8].tolist() == [127, -3, 3, -1, 1, 1, -2, -127]


def test_dequantize_takes_strided_rows_and_any_dtype():
    x = torch.randn(5, 3, 2, 32)
    rows = quantize_rows(x)
    strided = rows.transpose(0, 1)
    for dtype in (torch.float32, torch.bfloat16):
        out = dequantize_rows(strided, dtype)
        assert out.dtype == dtype and out.shape == (3, 5, 2, 32)
        assert torch.equal(out, dequantize_rows(rows, dtype).transpose(0, 1))


def int8_batch(batch: PagedBatch) -> PagedBatch:
    """The batch with its cache quantized (valid scales everywhere, context included)."""
    return dataclasses.replace(batch, kv_cache=quantize_rows(batch.kv_cache))


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_csrc_write_equals_the_reference_bytes(dtype):
    batch = int8_batch(make_paged_batch([(0, 9), (5, 1), (0, 40)], 4, 2, 64, block_size=8, dtype=dtype, seed=3))
    _, ref_cache = reference_forward(batch)
    cache = batch.kv_cache.clone()
    cpu_native.reshape_and_cache_int8(batch.key, batch.value, cache, batch.common.slot_mapping)
    assert torch.equal(cache, ref_cache)


@native
def test_csrc_write_skips_padding_and_rejects_out_of_range_slots():
    batch = int8_batch(make_paged_batch([(0, 3)], 2, 2, 16, block_size=4))
    cache = batch.kv_cache.clone()
    slots = torch.tensor([-1, 5, -1], dtype=torch.int64)
    cpu_native.reshape_and_cache_int8(batch.key, batch.value, cache, slots)
    changed = (cache != batch.kv_cache).any(dim=4).any(dim=3).any(dim=1)  # [num_blocks, block_size]
    assert changed.nonzero().tolist() == [[1, 1]]
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_native.reshape_and_cache_int8(batch.key, batch.value, cache,
                                          torch.tensor([0, cache.shape[0] * 4, 1], dtype=torch.int64))


def native_decode(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, cache after the write) of the csrc ops on a decode-only batch."""
    common = batch.common
    cache = batch.kv_cache.clone()
    cpu_native.reshape_and_cache_int8(batch.key, batch.value, cache, common.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))
    cpu_native.paged_attention_decode_int8(out, batch.query, cache, common.block_table, common.seq_lens, batch.scale)
    return out, cache


@native
# head_dim 32/64/128 take the tiled kernel where the CPU has AVX-512 with VNNI (32: half a 64-byte
# chunk per row; groups of 1, 3, 4 and 7 heads: one to three V passes per tile; partial tiles with
# block size 4, two tiles per block with 32); 24 and 80 the general one.
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim",
                         [(9, 3, 64), (2, 2, 32), (8, 2, 128), (7, 1, 64), (7, 1, 24), (4, 2, 80)])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_csrc_decode_matches_the_torch_backend(num_q_heads, num_kv_heads, head_dim, block_size):
    specs = [(30, 1), (5, 1), (47, 1), (0, 1), (200, 1), (15, 1)]
    batch = int8_batch(make_paged_batch(specs, num_q_heads, num_kv_heads, head_dim, block_size, seed=block_size))
    ref_out, ref_cache = reference_forward(batch)
    out, cache = native_decode(batch)
    assert torch.equal(cache, ref_cache)
    assert (out - ref_out).abs().max().item() <= ATOL


@native
def test_csrc_decode_work_split_by_sequence_and_padded_rows():
    # 12 sequences on 2 threads: whole sequences per item; padded rows (seq_len 0) come out zero
    specs = [(3 + 11 * i, 1) for i in range(12)]
    batch = int8_batch(make_paged_batch(specs, 6, 2, 64, block_size=16, num_padded=2, seed=7))
    ref_out, _ = reference_forward(batch)
    out, _ = native_decode(batch)
    assert (out[:12] - ref_out).abs().max().item() <= ATOL
    assert torch.equal(out[12:], torch.zeros_like(out[12:]))


def decode_in_layout(keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor, seq_lens: list[int],
                     block_size: int, seed: int) -> torch.Tensor:
    """The csrc decode over `keys`/`values` ([sum(seq_lens), Hkv, D], sequence after sequence)
    written into an int8 cache of `block_size` on randomly drawn blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    perm = (torch.randperm(sum(blocks_per_seq), generator=gen) + 1).tolist()
    cache = torch.zeros(1 + sum(blocks_per_seq), 2, block_size, keys.shape[1], keys.shape[2] + 4, dtype=torch.int8)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots = []
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_table[s, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        positions = torch.arange(n)
        slots.append(block_table[s, positions // block_size].long() * block_size + positions % block_size)
    cpu_native.reshape_and_cache_int8(keys, values, cache, torch.cat(slots))
    out = torch.empty_like(query)
    cpu_native.paged_attention_decode_int8(out, query, cache, block_table,
                                           torch.tensor(seq_lens, dtype=torch.int32), query.shape[-1] ** -0.5)
    return out


@native
# Block size 16 takes the AMX-INT8 score tiles where the CPU has them (head_dim 64/128), block size
# 4 the vpdpbusd ones: the integer sums are exact either way and every later step runs in the same
# order, so the outputs agree to the bit (on CPUs without AMX both take vpdpbusd). Lengths leave
# partial tiles; 12 sequences are whole-sequence items on 2 threads, 3 are (sequence, KV head) ones.
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (16, 1, 64)])
@pytest.mark.parametrize("num_seqs", [3, 12])
def test_csrc_decode_scores_agree_across_block_layouts(num_q_heads, num_kv_heads, head_dim, num_seqs):
    gen = torch.Generator().manual_seed(num_seqs + head_dim)
    seq_lens = [int(n) for n in torch.randint(1, 120, (num_seqs,), generator=gen)]
    keys = torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=gen) * 3
    values = torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=gen)
    query = torch.randn(num_seqs, num_q_heads, head_dim, generator=gen)
    by_4 = decode_in_layout(keys, values, query, seq_lens, block_size=4, seed=1)
    by_16 = decode_in_layout(keys, values, query, seq_lens, block_size=16, seed=2)
    assert torch.equal(by_4, by_16)


@native
@pytest.mark.parametrize("specs", list(BACKEND_SPECS.values()), ids=list(BACKEND_SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_native_backend_matches_torch_backend(specs, dtype):
    batch = int8_batch(make_paged_batch(specs, 6, 2, 32, block_size=8, seed=5, dtype=dtype))
    ref_out, ref_cache = reference_forward(batch)
    backend = get_attn_backend("cpu_native", torch.device("cpu"), dtype)
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.query, batch.key, batch.value, cache, backend.build(batch.common), batch.scale)
    assert torch.equal(cache, ref_cache)
    assert out.dtype == dtype
    tolerance = ATOL if dtype == torch.float32 else 2 ** -8 * ref_out.float().abs().max().item()
    assert (out.float() - ref_out.float()).abs().max().item() <= tolerance


def test_reference_attends_to_the_quantized_values():
    """The torch backend attends over the cache's dequantized K/V, not the step's unrounded ones,
    and a decode row's query is rounded to its own int8 quantization per head (the csrc op
    multiplies codes): equal to attention over a float cache holding the dequantized rows."""
    batch = int8_batch(make_paged_batch([(0, 6), (12, 1)], 4, 2, 32, block_size=4, seed=11))
    out, cache = reference_forward(batch)
    query = batch.query.clone()
    query[6:] = dequantize_rows(quantize_rows(query[6:]), torch.float32)  # the decode row
    dequantized = dataclasses.replace(batch, query=query, kv_cache=dequantize_rows(cache, torch.float32),
                                      key=dequantize_rows(quantize_rows(batch.key), torch.float32),
                                      value=dequantize_rows(quantize_rows(batch.value), torch.float32))
    float_out, _ = reference_forward(dequantized)
    assert (out - float_out).abs().max().item() <= 1e-5
    assert (out[6:] - reference_forward(dataclasses.replace(dequantized, query=batch.query))[0][6:]).abs().max() > 1e-4
