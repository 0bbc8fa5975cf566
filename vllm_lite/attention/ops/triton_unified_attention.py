"""Unified paged attention for mixed prefill + decode batches (Triton).

One program owns BLOCK_M query rows of one sequence and one KV head: BLOCK_Q consecutive new
tokens x the NUM_QUERIES_PER_KV query heads that share the KV head (GQA), so each K/V tile is
loaded once for all of them. It walks the sequence's keys tile by tile through the block table
(a tile may span several cache blocks, so any power-of-two block size works) with an online
softmax in fp32 (running max m, running sum l, unnormalized accumulator), masking keys past the
sequence length and, causally, keys after each query's position `context_len + i`.

Query-block numbering (no host-side index): sequence i's blocks start at
`query_start_loc[i] // BLOCK_Q + i`, which is strictly increasing in i and leaves room for
`cdiv(query_len_i, BLOCK_Q)` blocks, so a program finds its sequence by binary search and
programs past a sequence's last block exit. Grid: `(num_tokens // BLOCK_Q + num_seqs, kv heads)`.

Split-KV variant (decode with few sequences, where the grid above has too few programs to fill
a GPU): a third grid axis cuts each sequence's tiles into NUM_SEGMENTS segments; each writes its
partial (acc, m, l) and a reduce kernel merges them:
`out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s` with `M = max_s m_s`.

ALiBi (Bloom, MPT): each score gains `slope[head] * (key_pos - query_pos)`, the torch
reference's `slope * key_pos` less a per-row constant, which the softmax drops (the relative form
keeps the biases small in fp32 at long contexts; with a sink the constant would count, but no
model has both). Attention sinks (gpt-oss): a head's sink logit
joins each row's softmax denominator and attends to no value: the online softmax starts from
m = sink, l = 1 (in the split-KV variant segment 0 alone starts so, to count the sink once).

Rows with no visible key (a padded CUDA-graph row has seq_len 0) come out as zeros, never NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, cache_ptr, block_table_row_ptr, kv_head,
                  tile_begin, tile_end, seq_len, query_pos, scale, window, softcap, alibi_slope,
                  stride_c_blk, stride_c_kv, stride_c_off, stride_c_h,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  TILE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_ALIBI: tl.constexpr):
    """Online softmax over key tiles [tile_begin, tile_end) of one sequence and one KV head;
    window > 0 hides keys more than window - 1 positions before each query; softcap > 0 maps
    scores to softcap * tanh(score / softcap); with USE_ALIBI each row's scores gain its slope
    times the key's distance from the query."""
    offs_t = tl.arange(0, TILE_SIZE)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    for tile in range(tile_begin, tile_end):
        key_pos = tile * TILE_SIZE + offs_t
        key_valid = key_pos < seq_len
        block = tl.load(block_table_row_ptr + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
        base = (block.to(tl.int64) * stride_c_blk + (key_pos % BLOCK_SIZE) * stride_c_off
                + kv_head * stride_c_h)
        k_t = tl.load(cache_ptr + base[None, :] + offs_d[:, None],
                      mask=key_valid[None, :] & d_valid[:, None], other=0.0)  # [D, TILE]
        v = tl.load(cache_ptr + stride_c_kv + base[:, None] + offs_d[None, :],
                    mask=key_valid[:, None] & d_valid[None, :], other=0.0)  # [TILE, D]
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale  # [M, TILE] fp32
        if softcap > 0:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # tanh
        if USE_ALIBI:
            s += alibi_slope[:, None] * (key_pos[None, :] - query_pos[:, None]).to(tl.float32)
        visible = key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if window > 0:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked row so far
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _query_block(q_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs, stride_q_t, stride_q_h,
                 NUM_QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr):
    """This program's sequence and query rows: (is_empty, q, token, head, row_valid,
    query_pos, seq_len, num_keys)."""
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block_idx - (q_start // BLOCK_Q + seq)
    is_empty = q_block_local * BLOCK_Q >= q_len
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_idx = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_idx < q_len)
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
                mask=row_valid[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    context_len = seq_len - q_len
    # The last query row of this block sees keys [0, context_len + last q_idx].
    num_keys = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    return is_empty, seq, q, token, head, row_valid, context_len + q_idx, seq_len, num_keys


@triton.jit
def _first_tile(first_query_pos, window, TILE_SIZE: tl.constexpr):
    """The first key tile any query of the block sees: 0, or with a sliding window the tile of
    the first query's oldest visible key (tiles before it may hold other sequences' data)."""
    first_key = tl.maximum(first_query_pos - window + 1, 0)
    return tl.where(window > 0, first_key // TILE_SIZE, 0)


@triton.jit
def _row_terms(alibi_ptr, sinks_ptr, head, row_valid, sink_rows,
               BLOCK_M: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SINKS: tl.constexpr):
    """Each row's ALiBi slope (0 without ALiBi) and its online softmax's start (m, l): (-inf, 0),
    or with sinks in `sink_rows` (sink, 1), the sink's own term of the denominator."""
    slope = tl.zeros([BLOCK_M], tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_valid, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head, mask=sink_rows, other=float("-inf"))
        m_i = tl.where(sink_rows, sink, m_i)
        l_i = tl.where(sink_rows, 1.0, l_i)
    return slope, m_i, l_i


@triton.jit
def _unified_attention_kernel(
    out_ptr, q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr, alibi_ptr, sinks_ptr,
    scale, num_seqs, window, softcap,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_bt,
    stride_c_blk, stride_c_kv, stride_c_off, stride_c_h,
    NUM_QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SINKS: tl.constexpr,
):
    is_empty, seq, q, token, head, row_valid, query_pos, seq_len, num_keys = _query_block(
        q_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs, stride_q_t, stride_q_h,
        NUM_QUERIES_PER_KV, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_Q)
    if is_empty:
        return
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    slope, m_i, l_i = _row_terms(alibi_ptr, sinks_ptr, head, row_valid, row_valid, BLOCK_M, USE_ALIBI, USE_SINKS)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, cache_ptr, block_table_ptr + seq.to(tl.int64) * stride_bt, tl.program_id(1),
        _first_tile(tl.min(tl.where(row_valid, query_pos, seq_len), axis=0), window, TILE_SIZE),
        tl.cdiv(num_keys, TILE_SIZE), seq_len, query_pos, scale, window, softcap, slope,
        stride_c_blk, stride_c_kv, stride_c_off, stride_c_h,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_SIZE, DOT_PRECISION, USE_ALIBI)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    tl.store(out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def _split_kv_attention_kernel(
    segm_out_ptr, segm_max_ptr, segm_sum_ptr, q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr,
    query_start_loc_ptr, alibi_ptr, sinks_ptr, scale, num_seqs, window, softcap,
    stride_q_t, stride_q_h, stride_bt,
    stride_c_blk, stride_c_kv, stride_c_off, stride_c_h,
    NUM_Q_HEADS: tl.constexpr, NUM_QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SINKS: tl.constexpr,
):
    is_empty, seq, q, token, head, row_valid, query_pos, seq_len, num_keys = _query_block(
        q_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs, stride_q_t, stride_q_h,
        NUM_QUERIES_PER_KV, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_Q)
    if is_empty:
        return
    segment = tl.program_id(2)
    first_tile = _first_tile(tl.min(tl.where(row_valid, query_pos, seq_len), axis=0), window, TILE_SIZE)
    num_tiles = tl.cdiv(num_keys, TILE_SIZE) - first_tile
    tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
    tile_begin = first_tile + segment * tiles_per_segment
    tile_end = tl.minimum(tile_begin + tiles_per_segment, first_tile + num_tiles)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    first_segment = tl.zeros([BLOCK_M], tl.int32) + segment == 0
    slope, m_i, l_i = _row_terms(alibi_ptr, sinks_ptr, head, row_valid, row_valid & first_segment, BLOCK_M,
                                 USE_ALIBI, USE_SINKS)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, cache_ptr, block_table_ptr + seq.to(tl.int64) * stride_bt, tl.program_id(1),
        tile_begin, tile_end, seq_len, query_pos, scale, window, softcap, slope,
        stride_c_blk, stride_c_kv, stride_c_off, stride_c_h,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, TILE_SIZE, DOT_PRECISION, USE_ALIBI)
    # Partials: [T, NUM_Q_HEADS, NUM_SEGMENTS] (+ HEAD_DIM_PAD for acc), every entry written.
    part = (token * NUM_Q_HEADS + head) * NUM_SEGMENTS + segment
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    tl.store(segm_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_valid[:, None])
    tl.store(segm_max_ptr + part, m_i, mask=row_valid)
    tl.store(segm_sum_ptr + part, l_i, mask=row_valid)


@triton.jit
def _reduce_segments_kernel(
    out_ptr, segm_out_ptr, segm_max_ptr, segm_sum_ptr, stride_o_t, stride_o_h,
    NUM_Q_HEADS: tl.constexpr, NUM_SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * NUM_Q_HEADS + head) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m = tl.load(segm_max_ptr + part)
    l = tl.load(segm_sum_ptr + part)
    m_all = tl.max(m, axis=0)
    weight = tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all))
    acc = tl.load(segm_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :])
    numerator = tl.sum(acc * weight[:, None], axis=0)
    denominator = tl.sum(l * weight, axis=0)
    out = numerator / tl.where(denominator == 0.0, 1.0, denominator)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _shape_params(query: torch.Tensor, kv_cache: torch.Tensor) -> dict:
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    queries_per_kv = num_q_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(queries_per_kv))  # tl.dot needs M >= 16
    return dict(
        NUM_QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_m // queries_per_kv,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )


def _check_inputs(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor) -> None:
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("query, kv_cache and block_table need a contiguous last dimension")


def _head_terms(query: torch.Tensor, alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None) -> dict:
    """The per-head ALiBi slopes and sink logits as the kernels take them: float32 [Hq] on the
    query's device (absent ones: the query itself, never read, with the flag off)."""
    terms = {}
    for name, values in (("alibi", alibi_slopes), ("sinks", sinks)):
        if values is not None and (values.shape != (query.shape[1],) or values.device != query.device):
            raise ValueError(f"{name}: one float per query head on the query's device, [{query.shape[1]}] on "
                             f"{query.device}; got {list(values.shape)} on {values.device}")
        terms[f"{name}_ptr"] = query if values is None else values.float().contiguous()
        terms[f"USE_{name.upper()}"] = values is not None
    return terms


def unified_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                      block_table: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, scale: float, tile_size: int = 32,
                      sliding_window: int | None = None, logits_soft_cap: float | None = None,
                      alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> None:
    """query/out `[T, Hq, D]`, kv_cache `[num_blocks, 2, block_size, Hkv, D]`, block_table int32
    `[num_seqs, max_blocks]`, seq_lens int32 `[num_seqs]` (context + new tokens),
    query_start_loc int32 `[num_seqs + 1]`. Writes `out` in place; no host synchronization.
    `sliding_window` W: each query sees its last W keys (itself included) only. `alibi_slopes`,
    `sinks`: float32 `[Hq]` on the query's device (AttentionBackend.forward's meaning)."""
    _check_inputs(query, kv_cache, block_table)
    params = _shape_params(query, kv_cache)
    num_seqs = seq_lens.shape[0]
    grid = (query.shape[0] // params["BLOCK_Q"] + num_seqs, kv_cache.shape[3])
    _unified_attention_kernel[grid](
        out, query, kv_cache, block_table, seq_lens, query_start_loc, scale=scale, num_seqs=num_seqs,
        window=sliding_window or 0, softcap=float(logits_soft_cap or 0.0),
        stride_q_t=query.stride(0), stride_q_h=query.stride(1), stride_o_t=out.stride(0), stride_o_h=out.stride(1),
        stride_bt=block_table.stride(0), stride_c_blk=kv_cache.stride(0), stride_c_kv=kv_cache.stride(1),
        stride_c_off=kv_cache.stride(2), stride_c_h=kv_cache.stride(3),
        TILE_SIZE=tile_size, **params, **_head_terms(query, alibi_slopes, sinks),
    )


def split_kv_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                       block_table: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, scale: float, num_segments: int = 16,
                       tile_size: int = 16, sliding_window: int | None = None,
                       logits_soft_cap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                       sinks: torch.Tensor | None = None) -> None:
    """Same contract as `unified_attention`; meant for decode batches with few sequences.
    `num_segments` must be a power of two."""
    _check_inputs(query, kv_cache, block_table)
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two, got {num_segments}")
    params = _shape_params(query, kv_cache)
    num_tokens, num_q_heads = query.shape[0], query.shape[1]
    num_seqs = seq_lens.shape[0]
    segm_out = torch.empty(num_tokens, num_q_heads, num_segments, params["HEAD_DIM_PAD"],
                           dtype=torch.float32, device=query.device)
    segm_max = torch.empty(num_tokens, num_q_heads, num_segments, dtype=torch.float32, device=query.device)
    segm_sum = torch.empty_like(segm_max)
    grid = (num_tokens // params["BLOCK_Q"] + num_seqs, kv_cache.shape[3], num_segments)
    _split_kv_attention_kernel[grid](
        segm_out, segm_max, segm_sum, query, kv_cache, block_table, seq_lens, query_start_loc,
        scale=scale, num_seqs=num_seqs, window=sliding_window or 0, softcap=float(logits_soft_cap or 0.0),
        stride_q_t=query.stride(0), stride_q_h=query.stride(1), stride_bt=block_table.stride(0),
        stride_c_blk=kv_cache.stride(0), stride_c_kv=kv_cache.stride(1), stride_c_off=kv_cache.stride(2),
        stride_c_h=kv_cache.stride(3), NUM_Q_HEADS=num_q_heads, TILE_SIZE=tile_size, NUM_SEGMENTS=num_segments,
        **params, **_head_terms(query, alibi_slopes, sinks),
    )
    _reduce_segments_kernel[(num_tokens, num_q_heads)](
        out, segm_out, segm_max, segm_sum, out.stride(0), out.stride(1),
        NUM_Q_HEADS=num_q_heads, NUM_SEGMENTS=num_segments, HEAD_DIM=params["HEAD_DIM"],
        HEAD_DIM_PAD=params["HEAD_DIM_PAD"],
    )
