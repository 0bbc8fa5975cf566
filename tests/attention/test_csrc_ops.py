"""The csrc native CPU ops against the torch reference backend (fp32, max abs error <= 1e-5).

Skipped when the extension is not built, unless it should have been: with a C++ compiler
present and VLLM_LITE_BUILD_CSRC not "0", a missing extension fails (build it with
`make setup`, or `python setup.py build_ext --inplace`)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sysconfig

import numpy as np
import pytest
import torch
from paged_inputs import BACKEND_SPECS, PagedBatch, make_paged_batch, reference_forward

from vllm_lite import _custom_ops as cpu_native
from vllm_lite.attention.kv_quant import dequantize_rows, quantize_rows
from vllm_lite.attention.selector import get_attn_backend
from vllm_lite.attention.torch_backend import TorchAttentionBackend

ATOL = 1e-5


def _compiler_present() -> bool:
    compiler = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    return shutil.which(compiler.split()[0]) is not None


def test_extension_built_where_it_can_be():
    if os.environ.get("VLLM_LITE_BUILD_CSRC", "1") == "0" or not _compiler_present():
        pytest.skip("csrc build is switched off or there is no C++ compiler")
    assert cpu_native.is_available(), "a C++ compiler is present but vllm_lite._C is not built"


native = pytest.mark.skipif(not cpu_native.is_available(), reason="vllm_lite._C is not built")


def _native_backend():
    backend = get_attn_backend("cpu_native", torch.device("cpu"), torch.float32)
    assert backend.name == "cpu_native"
    return backend


@native
def test_reshape_and_cache_skips_padding_any_dtype():
    for dtype in (torch.float32, torch.bfloat16):
        batch = make_paged_batch([(5, 3), (0, 9)], 4, 2, 16, block_size=4, seed=2, num_padded=2, dtype=dtype)
        slots = batch.common.slot_mapping
        real = slots >= 0
        expected = batch.kv_cache.clone()
        expected[slots[real] // 4, 0, slots[real] % 4] = batch.key[real]
        expected[slots[real] // 4, 1, slots[real] % 4] = batch.value[real]
        cache = batch.kv_cache.clone()
        cpu_native.reshape_and_cache(batch.key, batch.value, cache, slots)
        assert torch.equal(cache, expected)


@native
def test_reshape_and_cache_rejects_out_of_range_slot():
    batch = make_paged_batch([(0, 2)], 2, 2, 16, block_size=4)
    bad = torch.tensor([0, batch.kv_cache.shape[0] * 4], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_native.reshape_and_cache(batch.key, batch.value, batch.kv_cache, bad)


@native
# head_dim 32/64/128 take the tiled kernel (partial tiles with block sizes 1 and 4, two tiles per
# block with 32); 24 takes the general one.
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim",
                         [(2, 2, 64), (4, 1, 32), (7, 1, 24), (9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_paged_attention_decode(num_q_heads, num_kv_heads, head_dim, block_size):
    # Ragged contexts, partially filled last blocks, a one-token prompt, a long context.
    specs = [(30, 1), (5, 1), (47, 1), (0, 1), (200, 1), (15, 1)]
    batch = make_paged_batch(specs, num_q_heads, num_kv_heads, head_dim, block_size, seed=block_size)
    ref_out, ref_cache = reference_forward(batch)
    cache = batch.kv_cache.clone()
    common = batch.common
    cpu_native.reshape_and_cache(batch.key, batch.value, cache, common.slot_mapping)
    out = torch.empty_like(batch.query)
    cpu_native.paged_attention_decode(out, batch.query, cache, common.block_table, common.seq_lens, batch.scale)
    assert torch.equal(cache, ref_cache)
    assert (out - ref_out).abs().max().item() <= ATOL


def native_decode(batch: PagedBatch, threads: int) -> torch.Tensor:
    """The csrc decode op over `batch` (its keys and values written into a copy of its cache
    first) on `threads` threads; rows it leaves unwritten stay NaN."""
    cache = batch.kv_cache.clone()
    common = batch.common
    cpu_native.reshape_and_cache(batch.key, batch.value, cache, common.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_native.paged_attention_decode(out, batch.query, cache, common.block_table, common.seq_lens, batch.scale)
    finally:
        torch.set_num_threads(previous)
    return out


@native
# Enough sequences that each work item is a whole sequence (every KV head of it, the tiles taken
# across the KV heads of a token row), at 1 and 2 threads; groups of 1, 2 and 3 query heads
# (the V pass takes heads in pairs: odd groups leave one alone).
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 4, 32), (4, 2, 32), (9, 3, 64), (16, 4, 128)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_attention_decode_whole_sequence_items(num_q_heads, num_kv_heads, head_dim, block_size, threads):
    specs = [(length, 1) for length in (30, 5, 47, 0, 200, 15, 16, 17, 63, 1, 33, 100)]
    batch = make_paged_batch(specs, num_q_heads, num_kv_heads, head_dim, block_size, seed=head_dim + block_size)
    ref_out, _ = reference_forward(batch)
    assert (native_decode(batch, threads) - ref_out).abs().max().item() <= ATOL


@native
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 2, 32), (9, 3, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_attention_decode_items_in_runs(num_q_heads, num_kv_heads, head_dim, threads):
    """A batch large enough that threads take its sequences several at a time (asking for the
    next one's blocks while computing one): every sequence computed, empty ones zero."""
    rng = np.random.default_rng(head_dim + threads)
    lengths = rng.integers(1, 300, size=70)
    lengths[[0, 9, 33, 69]] = 0  # (runs start, end and hold empty rows)
    batch = make_paged_batch([(int(length), 1) for length in lengths], num_q_heads, num_kv_heads, head_dim,
                             block_size=16, seed=head_dim)
    ref_out, _ = reference_forward(batch)
    assert (native_decode(batch, threads) - ref_out).abs().max().item() <= ATOL


def _as_float32(batch: PagedBatch) -> PagedBatch:
    """The same values in float32 (bf16 -> fp32 is exact): the reference for a bf16 batch."""
    return dataclasses.replace(batch, query=batch.query.float(), key=batch.key.float(),
                               value=batch.value.float(), kv_cache=batch.kv_cache.float())


@native
# head_dim 32/64/128 take the vdpbf16ps kernel where the CPU has AVX512-BF16 (use_bf16_dot=False
# forces the portable one); where it has AMX-BF16, head_dim 64/128 with block sizes 16 and 32 take
# the AMX score pass (partial last tiles included); groups of 4 and 7 heads take two and three V
# passes per tile.
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim",
                         [(9, 3, 64), (4, 1, 32), (8, 2, 128), (7, 1, 24), (7, 1, 64), (12, 3, 128)])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("use_bf16_dot", [True, False], ids=["bf16_dot", "portable"])
def test_paged_attention_decode_bf16(num_q_heads, num_kv_heads, head_dim, block_size, use_bf16_dot):
    """bf16 cache, query and output: scores, softmax and sums in fp32, so the result is the fp32
    attention over the same bf16 values, rounded once to bf16 (relative error <= 2^-8)."""
    specs = [(30, 1), (5, 1), (47, 1), (0, 1), (200, 1), (15, 1)]
    batch = make_paged_batch(specs, num_q_heads, num_kv_heads, head_dim, block_size, seed=block_size,
                             dtype=torch.bfloat16)
    ref_out, _ = reference_forward(_as_float32(batch))
    cache = batch.kv_cache.clone()
    common = batch.common
    cpu_native.reshape_and_cache(batch.key, batch.value, cache, common.slot_mapping)
    out = torch.empty_like(batch.query)
    torch.ops.vllm_lite_C.paged_attention_decode(out, batch.query, cache, common.block_table, common.seq_lens,
                                                 batch.scale, 0, use_bf16_dot)
    assert out.dtype == torch.bfloat16
    error = (out.float() - ref_out).abs()
    assert (error <= ref_out.abs() * 2 ** -8 + 1e-6).all(), error.max().item()


@native
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 1, 32), (8, 2, 128), (7, 1, 24)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_decode_fp8(fp8, num_q_heads, num_kv_heads, head_dim, block_size, query_dtype):
    """vLLM's fp8 KV cache (scale 1.0) with float32 or bf16 query and output: each byte widened
    exactly to the float it encodes (subnormals and saturated values included), then the bf16
    kernels' fp32 arithmetic (with a bf16 query on an AMX CPU, head_dim 64 / 128 and blocks of 16:
    the AMX passes over rows widened to bf16): the fp32 attention over the same float8 values."""
    from vllm_lite.attention.torch_backend import to_cache_rows

    specs = [(30, 1), (5, 1), (47, 1), (0, 1), (200, 1), (15, 1)]
    batch = make_paged_batch(specs, num_q_heads, num_kv_heads, head_dim, block_size, seed=block_size,
                             dtype=torch.bfloat16)
    scaled = dataclasses.replace(batch, kv_cache=batch.kv_cache * 300, key=batch.key * 300)  # (some saturate)
    cache = to_cache_rows(scaled.kv_cache, torch.empty(0, dtype=fp8))
    key, value = to_cache_rows(scaled.key, cache), to_cache_rows(scaled.value, cache)
    query = batch.query.to(query_dtype)  # (bf16 values either way)
    reference = dataclasses.replace(scaled, query=query.float(), key=key.float(), value=value.float(),
                                    kv_cache=cache.float())
    ref_out, _ = reference_forward(reference)
    common = batch.common
    cpu_native.reshape_and_cache(key, value, cache, common.slot_mapping)
    out = torch.empty_like(query)
    torch.ops.vllm_lite_C.paged_attention_decode(out, query, cache, common.block_table, common.seq_lens,
                                                 batch.scale, 0, True)
    assert out.dtype == query_dtype
    error = (out.float() - ref_out).abs()
    # fp32 summation order over values of up to |V| (hundreds here) whose weighted sum may cancel;
    # a bf16 output rounded once.
    rounding = 2 ** -16 if query_dtype == torch.float32 else 2 ** -8
    bound = ref_out.abs() * rounding + cache.float().abs().max() * 2 ** -13
    assert (error <= bound).all(), (error / bound).max().item()
    if fp8 == torch.float8_e4m3fn:  # (x300 passes e4m3's 448: saturated values were read as stored)
        assert torch.finfo(fp8).max in key.float().abs()


@native
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("head_dim, block_size, query_dtype",
                         [(128, 4, torch.float32), (24, 4, torch.float32), (64, 16, torch.bfloat16)],
                         ids=["tiled", "token-at-a-time", "bf16-query"])  # (the last: AMX passes where there)
def test_fp8_bytes_widen_exactly(fp8, head_dim, block_size, query_dtype):
    """Every float8 byte read as torch reads it: decoding over one key returns its V row as it
    is, subnormals, signs, inf and NaN included (writes saturate, but a NaN the model computed is
    stored as NaN and must read as one). Every float8 value is a bf16 value: a bf16 output too."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8)
    rows = -(-len(codes) // head_dim)
    values = torch.zeros(rows * head_dim, dtype=fp8)
    values[: len(codes)] = codes
    values = values.view(rows, 1, head_dim)  # one sequence a row, one KV head
    cache = torch.zeros(rows + 1, 2, block_size, 1, head_dim, dtype=fp8)
    cache[1:, 1, 0] = values
    block_table = torch.arange(1, rows + 1, dtype=torch.int32)[:, None]
    query = torch.randn(rows, 1, head_dim).to(query_dtype)
    out = torch.empty(rows, 1, head_dim, dtype=query_dtype)
    torch.ops.vllm_lite_C.paged_attention_decode(out, query, cache, block_table,
                                                 torch.ones(rows, dtype=torch.int32), 0.1, 0, True)
    out = out.float()
    expected = values.float()
    finite = torch.isfinite(expected)
    assert torch.equal(out[finite], expected[finite]), (out[finite] - expected[finite]).abs().max()
    assert torch.equal(torch.isnan(out), torch.isnan(expected)) and torch.equal(torch.isinf(out), torch.isinf(expected))
    assert torch.equal(out[torch.isinf(out)], expected[torch.isinf(expected)])  # (their signs too)
    assert torch.isnan(expected).any() and (fp8 == torch.float8_e4m3fn or torch.isinf(expected).any())


PREFILL_SPECS = {
    "prompts": [(0, 40), (0, 3), (0, 77)],
    "prefix_hits_and_chunks": [(32, 9), (5, 60), (100, 17), (0, 16)],
    "mixed_with_decodes": [(0, 21), (30, 1), (64, 33), (7, 1), (0, 1)],
}


@pytest.mark.skipif(not cpu_native.amx_bf16_usable(), reason="needs AMX-BF16 and the csrc build")
@pytest.mark.parametrize("specs", list(PREFILL_SPECS.values()), ids=list(PREFILL_SPECS))
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (16, 1, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_native_prefill_bf16_matches_fp32_attention(specs, num_q_heads, num_kv_heads, head_dim, block_size,
                                                    monkeypatch):
    """The backend's bf16 prefill rows go to `paged_attention_prefill` in one call (decode rows to
    the decode op) and equal the fp32 attention over the same bf16 values within bf16 rounding of
    the output and of the probabilities (as flash attention rounds them for the V product)."""
    batch = make_paged_batch(specs, num_q_heads, num_kv_heads, head_dim, block_size, seed=head_dim + block_size,
                             dtype=torch.bfloat16)
    ref_out, _ = reference_forward(_as_float32(batch))
    calls = []
    prefill_op = cpu_native.paged_attention_prefill
    monkeypatch.setattr(cpu_native, "paged_attention_prefill", lambda *args: calls.append(args) or prefill_op(*args))
    backend = get_attn_backend("cpu_native", torch.device("cpu"), torch.bfloat16)
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.query, batch.key, batch.value, cache, backend.build(batch.common), batch.scale)
    assert len(calls) == 1 and out.dtype == torch.bfloat16
    value_scale = batch.value.float().abs().max()
    error = (out.float() - ref_out).abs()
    assert (error <= ref_out.abs() * 2 ** -8 + value_scale * 2 ** -8).all(), error.max().item()


@pytest.mark.skipif(not cpu_native.amx_bf16_usable(), reason="needs AMX-BF16 and the csrc build")
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128)])
def test_native_prefill_over_int8_cache_matches_dequantized_attention(num_q_heads, num_kv_heads, head_dim, monkeypatch):
    """Over an int8_per_token_head cache the op reads the rows dequantized to bf16 (the torch path's
    rule): it equals fp32 attention over those values within bf16 rounding."""
    batch = make_paged_batch(PREFILL_SPECS["prefix_hits_and_chunks"], num_q_heads, num_kv_heads, head_dim, 16,
                             seed=3, dtype=torch.bfloat16)
    cache = quantize_rows(batch.kv_cache)  # the cached context (and the noise around it) as int8 rows
    calls = []
    prefill_op = cpu_native.paged_attention_prefill
    monkeypatch.setattr(cpu_native, "paged_attention_prefill", lambda *args: calls.append(args) or prefill_op(*args))
    backend = get_attn_backend("cpu_native", torch.device("cpu"), torch.bfloat16)
    out = backend.forward(batch.query, batch.key, batch.value, cache, backend.build(batch.common), batch.scale)
    assert len(calls) == 1

    def as_read(rows: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(quantize_rows(rows), torch.bfloat16).float()

    seen = dataclasses.replace(_as_float32(batch), kv_cache=as_read(batch.kv_cache), key=as_read(batch.key),
                               value=as_read(batch.value))
    ref_out, _ = reference_forward(seen)
    error = (out.float() - ref_out).abs()
    assert (error <= ref_out.abs() * 2 ** -8 + seen.value.abs().max() * 2 ** -8).all(), error.max().item()


@pytest.mark.skipif(not cpu_native.amx_bf16_usable(), reason="needs AMX-BF16 and the csrc build")
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 2), (1, 1)])
def test_native_prefill_takes_a_query_whose_heads_lie_apart(num_q_heads, num_kv_heads):
    """The Transformers fallback hands the backend transformers' query transposed ([tokens, heads,
    dim] over [heads, tokens, dim] memory): the prefill op reads each token's heads as one row, so
    such a query is copied together first and attends as the contiguous one does (it killed the
    engine core in every bf16 prefill of a head_dim 64 / 128 fallback model on AMX CPUs)."""
    batch = make_paged_batch(PREFILL_SPECS["mixed_with_decodes"], num_q_heads, num_kv_heads, 64, 16, seed=5,
                             dtype=torch.bfloat16)
    backend = get_attn_backend("cpu_native", torch.device("cpu"), torch.bfloat16)
    tokens, heads, dim = batch.query.shape
    apart = torch.empty_strided(batch.query.shape, (dim, tokens * dim, 1), dtype=batch.query.dtype)
    apart.copy_(batch.query)
    assert apart.stride(1) != apart.shape[2] and torch.equal(apart, batch.query)
    outs = [backend.forward(query, batch.key, batch.value, batch.kv_cache.clone(), backend.build(batch.common),
                            batch.scale) for query in (batch.query, apart)]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(not cpu_native.amx_bf16_usable(), reason="needs AMX-BF16 and the csrc build")
def test_native_prefill_refuses_what_it_cannot_take():
    batch = make_paged_batch([(0, 20)], 4, 2, 32, 16, dtype=torch.bfloat16)
    tables = [torch.zeros(1, 2, dtype=torch.int32)] + [torch.tensor([v], dtype=torch.int32) for v in (0, 20, 20)]
    out = torch.empty_like(batch.query)
    with pytest.raises(RuntimeError, match="head_dim 64 or 128"):
        cpu_native.paged_attention_prefill(out, batch.query, batch.kv_cache, *tables, batch.scale)
    batch = make_paged_batch([(0, 20)], 4, 2, 64, 16, dtype=torch.bfloat16)
    tables[3] = torch.tensor([40], dtype=torch.int32)  # more keys than the block table holds
    with pytest.raises(RuntimeError, match="needs more blocks"):
        cpu_native.paged_attention_prefill(torch.empty_like(batch.query), batch.query, batch.kv_cache, *tables,
                                           batch.scale)


@native
def test_padded_rows_are_zero():
    batch = make_paged_batch([(12, 1)], 4, 2, 32, block_size=4, num_padded=2)
    cache = batch.kv_cache.clone()
    common = batch.common
    cpu_native.reshape_and_cache(batch.key, batch.value, cache, common.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))
    cpu_native.paged_attention_decode(out, batch.query, cache, common.block_table, common.seq_lens, batch.scale)
    ref_out, _ = reference_forward(batch)
    assert (out[:1] - ref_out).abs().max().item() <= ATOL
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))


@native
@pytest.mark.parametrize("specs", list(BACKEND_SPECS.values()), ids=list(BACKEND_SPECS))
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 1), (7, 1)])
def test_cpu_native_backend_matches_torch_backend(specs, num_q_heads, num_kv_heads):
    batch = make_paged_batch(specs, num_q_heads, num_kv_heads, 32, block_size=8, seed=5)
    ref_out, ref_cache = reference_forward(batch)
    backend = _native_backend()
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.query, batch.key, batch.value, cache, backend.build(batch.common), batch.scale)
    assert torch.equal(cache, ref_cache)
    assert (out - ref_out).abs().max().item() <= ATOL


@native
def test_short_prefill_rows_take_the_decode_op_and_long_ones_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill rows of at most PER_TOKEN_PREFILL_MAX_KEYS keys (context included) are attended
    token by token in the decode-op call, with no SDPA call of their own; longer rows each take
    one; the output equals the torch reference's either way."""
    from vllm_lite.attention import cpu_native_backend

    specs = [(0, 300), (6, 1), (250, 7), (0, 40), (200, 57), (0, 256)]  # keys 300, 7, 257, 40, 257, 256
    batch = make_paged_batch(specs, 4, 2, 32, block_size=8, seed=9)
    ref_out, _ = reference_forward(batch)
    sdpa_lengths: list[int] = []
    decode_rows: list[int] = []
    sdpa, decode = cpu_native_backend.prefill_attention, cpu_native.paged_attention_decode
    monkeypatch.setattr(cpu_native_backend, "prefill_attention",
                        lambda query, *args, **kw: (sdpa_lengths.append(query.shape[0]), sdpa(query, *args, **kw))[1])
    monkeypatch.setattr(cpu_native, "paged_attention_decode",
                        lambda out, query, *args: (decode_rows.append(query.shape[0]), decode(out, query, *args))[1])
    backend = _native_backend()
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.query, batch.key, batch.value, cache, backend.build(batch.common), batch.scale)
    assert (out - ref_out).abs().max().item() <= ATOL
    assert sorted(sdpa_lengths) == [7, 57, 300]  # the rows over 256 keys
    assert decode_rows == [1, 40 + 256]  # the decode row, then every token of the short prefill rows


@native
def test_prefill_tables_hold_every_prefill_row() -> None:
    """What the AMX prefill op reads (built only when a layer takes it): each prefill row's blocks,
    first token in the step, new tokens and keys, int32; decode rows left out."""
    specs = [(0, 300), (6, 1), (250, 7), (0, 1), (3, 5)]
    batch = make_paged_batch(specs, 4, 2, 32, block_size=8, seed=4)
    tables = _native_backend().build(batch.common).prefill_tables()
    prefill = [0, 2, 4]
    starts = batch.common.query_start_loc_np[prefill]
    assert tables.block_table.dtype == tables.query_start.dtype == tables.query_lens.dtype == torch.int32
    assert torch.equal(tables.block_table, batch.common.block_table[prefill].to(torch.int32))
    assert tables.query_start.tolist() == starts.tolist()
    assert tables.query_lens.tolist() == [300, 7, 5]
    assert tables.seq_lens.tolist() == [300, 257, 8]


def test_selector_falls_back_to_torch():
    assert isinstance(get_attn_backend("torch", torch.device("cpu"), torch.float32), TorchAttentionBackend)
    # Native decode reads float32 and bfloat16 only.
    assert isinstance(get_attn_backend("cpu_native", torch.device("cpu"), torch.float16), TorchAttentionBackend)
    for dtype in (torch.float32, torch.bfloat16):
        auto = get_attn_backend("auto", torch.device("cpu"), dtype)
        assert auto.name == ("cpu_native" if cpu_native.is_available() else "torch")
    with pytest.raises(ValueError, match="attention_backend"):
        get_attn_backend("nope", torch.device("cpu"), torch.float32)


@native
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 15), (4, 16), (5, 33), (64, 8192), (300, 1000)])
def test_argmax_rows_matches_torch(rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(cpu_native.argmax_rows(logits), logits.argmax(dim=-1))


@native
def test_argmax_rows_first_maximum_wins_and_strided_rows():
    logits = torch.zeros(4, 100)
    logits[:, [97, 40, 7]] = 1.0  # ties in different lanes and in the scalar tail
    logits[1] = -float("inf")
    assert cpu_native.argmax_rows(logits).tolist() == [7, 0, 7, 7]
    wide = torch.randn(6, 70)
    view = wide[:, 3:53]  # rows with a stride larger than their length
    assert torch.equal(cpu_native.argmax_rows(view), view.argmax(dim=-1))
