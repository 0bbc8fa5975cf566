// Native CPU ops for the attention hot path on machines without a GPU:
//
//   reshape_and_cache(key, value, kv_cache, slot_mapping)
//       write new keys/values into the paged cache; slot -1 (padding) is skipped.
//   paged_attention_decode(out, query, kv_cache, block_table, seq_lens, scale, sliding_window=0,
//                          use_bf16_dot=True)
//       one query token per sequence (decode) over the sequence's cached blocks (the last
//       `sliding_window` of them when > 0, float32 only); float32, or bfloat16 (fp32 scores,
//       softmax and accumulation: on CPUs with AVX512-BF16 the scores come from vdpbf16ps on
//       the bf16 K rows, or from AMX tile products where the CPU has AMX-BF16 (head_dim 64/128,
//       block_size a multiple of 16); elsewhere, or with use_bf16_dot=False, rows are widened to
//       fp32 as read).
//   argmax_rows(logits) -> int64 [rows]
//       greedy sampling: the first index of each row's maximum (torch.argmax's rule), rows in
//       parallel; torch's argmax over a [rows, vocab] batch runs at ~8 GB/s here.
//
// KV cache per layer: [num_blocks, 2, block_size, num_kv_heads, head_dim] (0 = K, 1 = V).
// Registered as torch.ops.vllm_lite_C.*; `import vllm_lite._C` loads them. OpenMP splits the
// (sequence, kv head) pairs across torch's intra-op threads; the inner loops use GCC vector
// extensions, compiled once per ISA level (AVX-512, AVX2+FMA, baseline) at the width its registers
// hold and picked at run time (VLLM_LITE_PER_ISA, cpu_multiversion.h); the vdpbf16ps kernels are compiled for AVX512-BF16 by a target attribute and
// called only where __builtin_cpu_supports says the CPU has it. The build stays portable without
// -march=native.

#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_attention.h"
#include "cpu_multiversion.h"
#include "cpu_vec.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define VLLM_LITE_BF16_DOT 1
#else
#define VLLM_LITE_BF16_DOT 0
#endif

namespace {

using namespace vllm_lite_cpu;  // NOLINT: the helpers of cpu_vec.h and cpu_attention.h

// One sequence, KV heads [kv_begin, kv_end) and their query heads: the scores for the whole
// context (`logits`, [heads, seq_len]), softmax, then the weighted sum of values. Both passes
// walk each block's token rows in memory order (all the item's heads of a row together; with a
// decode batch this is memory-bound). `out`/`query` point at the first query head. L: vector
// width (compiled per ISA level by VLLM_LITE_PER_ISA, here rather than in the caller: OpenMP
// outlines the parallel region into a function the target attributes would not reach).
template <int L>
VLLM_LITE_INLINE void decode_one_any(float* out, const float* query, int64_t q_stride_h, const float* cache,
                                     const int32_t* blocks, int64_t seq_len, int64_t num_masked, int64_t kv_begin,
                                     int64_t kv_end, int64_t group, int64_t head_dim, const CacheLayout& c,
                                     float scale, std::vector<float>& scratch) {
  typedef VecF<L> V;
  const int64_t num_heads = (kv_end - kv_begin) * group;
  if (seq_len <= 0) {  // a padded row: nothing to attend to
    std::fill(out, out + num_heads * head_dim, 0.f);
    return;
  }
  scratch.resize(num_heads * (seq_len + head_dim + 1));
  float* logits = scratch.data();
  float* q = logits + num_heads * seq_len;
  float* inv_sum = q + num_heads * head_dim;
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t d = 0; d < head_dim; ++d) q[h * head_dim + d] = query[h * q_stride_h + d] * scale;

  const int64_t num_blocks = (seq_len + c.block_size - 1) / c.block_size;
  const int64_t row_offset = kv_begin * c.stride_head;  // the item's heads within a token row
  for (int64_t which = 0; which < 2; ++which) {  // 0: scores over K, 1: weighted sum over V
    if (which == 1) {
      for (int64_t h = 0; h < num_heads; ++h) {
        mask_leading(logits + h * seq_len, num_masked);
        inv_sum[h] = 1.f / softmax_numerators<V>(logits + h * seq_len, seq_len);
      }
      std::fill(out, out + num_heads * head_dim, 0.f);
    }
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* rows = cache + blocks[b] * c.stride_block + which * c.stride_kv + row_offset;
      const int64_t start = b * c.block_size, n = std::min(c.block_size, seq_len - start);
      for (int64_t i = 0; i < n; ++i) {
        const float* row = rows + i * c.stride_offset;
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* kv = row + (h / group) * c.stride_head;
          float* logit = logits + h * seq_len + start + i;
          if (which == 0)
            *logit = dot<V>(q + h * head_dim, kv, head_dim);
          else
            axpy<V>(out + h * head_dim, *logit, kv, head_dim);
        }
      }
    }
  }
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t d = 0; d < head_dim; ++d) out[h * head_dim + d] *= inv_sum[h];
}

VLLM_LITE_PER_ISA(decode_one, decode_one_any<L>,
                  (float* out, const float* query, int64_t q_stride_h, const float* cache, const int32_t* blocks,
                   int64_t seq_len, int64_t num_masked, int64_t kv_begin, int64_t kv_end, int64_t group,
                   int64_t head_dim, const CacheLayout& c, float scale, std::vector<float>& scratch),
                  (out, query, q_stride_h, cache, blocks, seq_len, num_masked, kv_begin, kv_end, group, head_dim, c,
                   scale, scratch))

// ---- head_dim = C * L (C vectors of L lanes): tiles of L tokens, no per-token horizontal sum ----

// Scores of one query head against up to L token rows of one KV head. kFull: all L rows
// exist (the loops then unroll completely and the accumulators stay in registers).
template <int C, bool kFull, typename V = vfloat>
VLLM_LITE_INLINE void score_tile(float* logits, const V* q, const float* rows, int64_t row_stride, int64_t n) {
  constexpr int L = lanes_of<V>;
  V acc[L];
#pragma GCC unroll 16
  for (int64_t j = 0; j < L; ++j) {
    V sum = {};
    if (kFull || j < n) {
      const float* k = rows + j * row_stride;
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) sum += q[c] * load<V>(k + c * L);
    }
    acc[j] = sum;
  }
  const V sums = transpose_sums(acc);
  if (kFull || n == L) {
    store(logits, sums);
  } else {
    for (int64_t j = 0; j < n; ++j) logits[j] = sums[j];
  }
}

// One sequence, KV heads [kv_begin, kv_end) and their query heads, head_dim D = C * L. The scores
// go tile by tile through the cache, each tile's K rows for every KV head of the item before
// the next tile: one contiguous stretch, where a head at a time strode over whole token rows (a
// page apart at 8 KV heads of 128: the stream prefetchers never started). Each head's logits are
// padded to whole vectors with -inf, so the softmax runs on vectors only (exp(-inf) adds 0);
// the V pass takes the query heads of a KV head two at a time: each V row is loaded once for
// both, and the sums run 2 * C independent chains.
template <int D, int L>
VLLM_LITE_INLINE void decode_one_tiled(float* out, const float* query, int64_t q_stride_h, const float* cache,
                                       const int32_t* blocks, int64_t seq_len, int64_t num_masked, int64_t kv_begin,
                                       int64_t kv_end, int64_t group, const CacheLayout& c, float scale,
                                       std::vector<float>& scratch, NextItemPrefetch& ahead) {
  typedef VecF<L> V;
  constexpr int C = D / L;
  const int64_t num_kv = kv_end - kv_begin, num_heads = num_kv * group;
  const int64_t padded = (seq_len + L - 1) / L * L;  // each head's logits, in whole vectors
  scratch.resize(num_heads * (padded + D));
  float* logits = scratch.data();
  float* queries = logits + num_heads * padded;  // scaled, [num_heads, D]
  for (int64_t h = 0; h < num_heads; ++h)
    for (int k = 0; k < C; ++k) store(queries + h * D + k * L, load<V>(query + h * q_stride_h + k * L) * scale);
  const int64_t num_blocks = (seq_len + c.block_size - 1) / c.block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* k_rows = cache + blocks[b] * c.stride_block + kv_begin * c.stride_head;
    const int64_t start = b * c.block_size, n = std::min(c.block_size, seq_len - start);
    for (int64_t t = 0; t < n; t += L) {
      const int64_t m = std::min<int64_t>(L, n - t);
      const float* tile = k_rows + t * c.stride_offset;
      ahead.step(kNextItemLinesPerTile);
      for (int64_t h = 0; h < num_heads; ++h) {
        V q[C];
        for (int k = 0; k < C; ++k) q[k] = load<V>(queries + h * D + k * L);
        const float* rows = tile + (h / group) * c.stride_head;
        float* tile_logits = logits + h * padded + start + t;
        if (m == L)
          score_tile<C, true>(tile_logits, q, rows, c.stride_offset, L);
        else
          score_tile<C, false>(tile_logits, q, rows, c.stride_offset, m);
      }
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    float* head_logits = logits + h * padded;
    std::fill(head_logits + seq_len, head_logits + padded, -std::numeric_limits<float>::infinity());
    mask_leading(head_logits, num_masked);
    queries[h * D] = 1.f / softmax_numerators<V>(head_logits, padded);  // (the query is spent: its slot keeps 1/sum)
  }
  for (int64_t kv = 0; kv < num_kv; ++kv) {
    for (int64_t g = 0; g < group; g += 2) {
      const int64_t h0 = kv * group + g;
      const bool pair = g + 1 < group;
      const float *p0 = logits + h0 * padded, *p1 = pair ? p0 + padded : p0;
      V acc0[C] = {}, acc1[C] = {};
      for (int64_t b = 0; b < num_blocks; ++b) {
        const float* rows = cache + blocks[b] * c.stride_block + c.stride_kv + (kv_begin + kv) * c.stride_head;
        const int64_t start = b * c.block_size, n = std::min(c.block_size, seq_len - start);
        for (int64_t i = 0; i < n; ++i) {
          const float* v = rows + i * c.stride_offset;
          ahead.step(kNextItemLinesPerRow);
          const float w0 = p0[start + i], w1 = p1[start + i];
#pragma GCC unroll 16
          for (int k = 0; k < C; ++k) {
            const V row = load<V>(v + k * L);
            acc0[k] += w0 * row;
            acc1[k] += w1 * row;
          }
        }
      }
      for (int k = 0; k < C; ++k) store(out + h0 * D + k * L, acc0[k] * queries[h0 * D]);
      if (pair)
        for (int k = 0; k < C; ++k) store(out + (h0 + 1) * D + k * L, acc1[k] * queries[(h0 + 1) * D]);
    }
  }
}

#define VLLM_LITE_DECODE_TILED(D)                                                                                    \
  VLLM_LITE_PER_ISA(decode_one_tiled_##D, (decode_one_tiled<D, L>),                                                 \
                    (float* out, const float* query, int64_t q_stride_h, const float* cache, const int32_t* blocks, \
                     int64_t seq_len, int64_t num_masked, int64_t kv_begin, int64_t kv_end, int64_t group,          \
                     const CacheLayout& c, float scale, std::vector<float>& scratch, NextItemPrefetch& ahead),      \
                    (out, query, q_stride_h, cache, blocks, seq_len, num_masked, kv_begin, kv_end, group, c, scale, \
                     scratch, ahead))
VLLM_LITE_DECODE_TILED(32)
VLLM_LITE_DECODE_TILED(64)
VLLM_LITE_DECODE_TILED(128)
#undef VLLM_LITE_DECODE_TILED

// The tiled kernel for head_dim 32, 64 and 128 (query rows contiguous; it steps `ahead`), else
// the general one. With a sliding window only the blocks from the one holding the window's first
// key are read (earlier ones may already belong to other sequences); keys before the window in
// that block are masked out of the softmax. window <= 0: every key.
void decode_item(float* out, const float* query, int64_t q_stride_h, const float* cache,
                 const int32_t* blocks, int64_t seq_len, int64_t window, int64_t kv_begin,
                 int64_t kv_end, int64_t group, int64_t head_dim, const CacheLayout& c, float scale,
                 std::vector<float>& scratch, NextItemPrefetch& ahead) {
  int64_t num_masked = 0;
  if (window > 0 && seq_len > window) {
    const int64_t first_block = (seq_len - window) / c.block_size;
    blocks += first_block;
    seq_len -= first_block * c.block_size;
    num_masked = seq_len - window;
  }
  if (seq_len > 0) {
    switch (head_dim) {
      case 32:
        return decode_one_tiled_32(out, query, q_stride_h, cache, blocks, seq_len, num_masked, kv_begin, kv_end,
                                   group, c, scale, scratch, ahead);
      case 64:
        return decode_one_tiled_64(out, query, q_stride_h, cache, blocks, seq_len, num_masked, kv_begin, kv_end,
                                   group, c, scale, scratch, ahead);
      case 128:
        return decode_one_tiled_128(out, query, q_stride_h, cache, blocks, seq_len, num_masked, kv_begin, kv_end,
                                    group, c, scale, scratch, ahead);
      default:
        break;
    }
  }
  decode_one(out, query, q_stride_h, cache, blocks, seq_len, num_masked, kv_begin, kv_end, group,
             head_dim, c, scale, scratch);
}

// Work items: whole sequences when there are enough to keep every thread busy (each token row
// is then read once, contiguously), else (sequence, kv head) pairs, taken in runs
// (`items_per_run`); within a run each item asks for the next one's first blocks
// (`NextItemPrefetch`; not with a sliding window, whose first block read is not the first held).
void decode_attention_f32(float* out, const float* query, const float* cache,
                          const int32_t* block_table, const int32_t* seq_lens, int64_t num_seqs,
                          int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t q_stride_t, int64_t q_stride_h, int64_t bt_stride,
                          CacheLayout layout, float scale, int64_t window, int num_threads) {
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t heads_per_item = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  const int64_t num_items = num_seqs * items_per_seq;
  const int64_t item_bytes = item_block_bytes(layout, heads_per_item, sizeof(float));
  const int64_t run = items_per_run(num_items, num_threads);
  auto prefetch_for = [&](int64_t item) {
    const int64_t s = item / items_per_seq;
    if (window > 0 || seq_lens[s] <= 0) return NextItemPrefetch();
    const float* k_rows = cache + block_table[s * bt_stride] * layout.stride_block +
                          (item % items_per_seq) * heads_per_item * layout.stride_head;
    return NextItemPrefetch(k_rows, k_rows + layout.stride_kv, item_bytes);
  };
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t first = 0; first < num_items; first += run) {
      const int64_t last = std::min(num_items, first + run);
      for (int64_t item = first; item < last; ++item) {
        const int64_t s = item / items_per_seq;
        const int64_t kv_begin = (item % items_per_seq) * heads_per_item;
        NextItemPrefetch ahead = item + 1 < last ? prefetch_for(item + 1) : NextItemPrefetch();
        decode_item(out + (s * num_q_heads + kv_begin * group) * head_dim,
                    query + s * q_stride_t + kv_begin * group * q_stride_h, q_stride_h, cache,
                    block_table + s * bt_stride, seq_lens[s], window, kv_begin, kv_begin + heads_per_item,
                    group, head_dim, layout, scale, scratch, ahead);
      }
    }
  }
}

// ---- bf16 KV cache (bf16 query and output): rows widened to fp32 as they are read, fp32 scores,
// softmax and accumulation; the output rounded to bf16 once (round to nearest even). ----

// n (<= L) token rows of one KV head (T: bf16, or an fp8 cache's bytes) widened into `tile`
// (fp32 rows of C * L values).
template <int C, typename V, typename T>
VLLM_LITE_INLINE void widen_tile(float* tile, const T* rows, int64_t row_stride, int64_t n) {
  constexpr int L = lanes_of<V>;
  for (int64_t j = 0; j < n; ++j)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) store(tile + (j * C + c) * L, load_any<V>(rows + j * row_stride + c * L));
}

// One sequence, KV heads [kv_begin, kv_end) and their query heads, head_dim D = C * L. Each tile
// of L K (then V) rows is widened to fp32 once and used by every query head of its KV group
// (grouped-query attention: 3 heads share a KV head in the demo model), then the fp32 tile code
// runs on it: the same products in the same order as widening per head, so the same result.
// T: the cache's element (bf16; an fp8 cache's bytes take the same path, widened their way); Q:
// the query's and the output's (bf16, or float32 over an fp8 cache).
template <int D, int L, typename T = uint16_t, typename Q = uint16_t>
VLLM_LITE_INLINE void decode_one_bf16_tiled(Q* out, const Q* query, int64_t q_stride_h,
                                            const T* cache, const int32_t* blocks,
                                            int64_t seq_len, int64_t kv_begin, int64_t kv_end,
                                            int64_t group, const CacheLayout& c, float scale,
                                            std::vector<float>& scratch) {
  typedef VecF<L> V;
  constexpr int C = D / L;
  const int64_t num_heads = (kv_end - kv_begin) * group;
  scratch.resize(num_heads * (seq_len + 2 * D + 1));
  float* logits = scratch.data();
  float* q_scaled = logits + num_heads * seq_len;
  float* acc = q_scaled + num_heads * D;
  float* inv_sum = acc + num_heads * D;
  float tile[L * D];
  for (int64_t h = 0; h < num_heads; ++h)
    for (int k = 0; k < C; ++k) store(q_scaled + h * D + k * L, load_any<V>(query + h * q_stride_h + k * L) * scale);
  const int64_t num_blocks = (seq_len + c.block_size - 1) / c.block_size;
  for (int64_t kv = 0; kv < kv_end - kv_begin; ++kv) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const T* rows = cache + blocks[b] * c.stride_block + (kv_begin + kv) * c.stride_head;
      const int64_t start = b * c.block_size, n = std::min(c.block_size, seq_len - start);
      for (int64_t t = 0; t < n; t += L) {
        const int64_t m = std::min<int64_t>(L, n - t);
        widen_tile<C, V>(tile, rows + t * c.stride_offset, c.stride_offset, m);
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
          V q[C];
          for (int k = 0; k < C; ++k) q[k] = load<V>(q_scaled + h * D + k * L);
          if (m == L)
            score_tile<C, true>(logits + h * seq_len + start + t, q, tile, D, L);
          else
            score_tile<C, false>(logits + h * seq_len + start + t, q, tile, D, m);
        }
      }
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) inv_sum[h] = 1.f / softmax_numerators<V>(logits + h * seq_len, seq_len);
  std::fill(acc, acc + num_heads * D, 0.f);
  for (int64_t kv = 0; kv < kv_end - kv_begin; ++kv) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const T* rows = cache + blocks[b] * c.stride_block + c.stride_kv + (kv_begin + kv) * c.stride_head;
      const int64_t start = b * c.block_size, n = std::min(c.block_size, seq_len - start);
      for (int64_t t = 0; t < n; t += L) {
        const int64_t m = std::min<int64_t>(L, n - t);
        widen_tile<C, V>(tile, rows + t * c.stride_offset, c.stride_offset, m);
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
          const float* p = logits + h * seq_len + start + t;
          V sum[C];
          for (int k = 0; k < C; ++k) sum[k] = load<V>(acc + h * D + k * L);
          for (int64_t i = 0; i < m; ++i)
#pragma GCC unroll 16
            for (int k = 0; k < C; ++k) sum[k] += p[i] * load<V>(tile + (i * C + k) * L);
          for (int k = 0; k < C; ++k) store(acc + h * D + k * L, sum[k]);
        }
      }
    }
  }
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t d = 0; d < D; ++d) store_one(out + h * D + d, acc[h * D + d] * inv_sum[h]);
}

// Any head_dim: one token at a time, scalar tails.
template <int L, typename T = uint16_t, typename Q = uint16_t>
VLLM_LITE_INLINE void decode_one_bf16_any_head_dim(Q* out, const Q* query, int64_t q_stride_h,
                                                   const T* cache, const int32_t* blocks, int64_t seq_len,
                                                   int64_t kv_begin, int64_t kv_end, int64_t group, int64_t head_dim,
                                                   const CacheLayout& c, float scale, std::vector<float>& scratch) {
  const int64_t num_heads = (kv_end - kv_begin) * group;
  scratch.resize(num_heads * (seq_len + 2 * head_dim));
  float* logits = scratch.data();
  float* q = logits + num_heads * seq_len;
  float* acc = q + num_heads * head_dim;
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t d = 0; d < head_dim; ++d)
      q[h * head_dim + d] = to_float(query[h * q_stride_h + d]) * scale;
  std::fill(acc, acc + num_heads * head_dim, 0.f);
  const int64_t num_blocks = (seq_len + c.block_size - 1) / c.block_size;
  for (int64_t which = 0; which < 2; ++which) {  // 0: scores over K, 1: weighted sum over V
    if (which == 1)
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv_sum = 1.f / softmax_numerators<VecF<L>>(logits + h * seq_len, seq_len);
        for (int64_t t = 0; t < seq_len; ++t) logits[h * seq_len + t] *= inv_sum;
      }
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t start = b * c.block_size, n = std::min(c.block_size, seq_len - start);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < num_heads; ++h) {
          const T* row = cache + blocks[b] * c.stride_block + which * c.stride_kv +
                         i * c.stride_offset + (kv_begin + h / group) * c.stride_head;
          float* logit = logits + h * seq_len + start + i;
          if (which == 0) {
            float sum = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) sum += q[h * head_dim + d] * to_float(row[d]);
            *logit = sum;
          } else {
            for (int64_t d = 0; d < head_dim; ++d) acc[h * head_dim + d] += *logit * to_float(row[d]);
          }
        }
    }
  }
  for (int64_t i = 0; i < num_heads * head_dim; ++i) store_one(out + i, acc[i]);
}

VLLM_LITE_PER_ISA(decode_one_bf16_any, decode_one_bf16_any_head_dim<L>,
                  (uint16_t* out, const uint16_t* query, int64_t q_stride_h, const uint16_t* cache,
                   const int32_t* blocks, int64_t seq_len, int64_t kv_begin, int64_t kv_end, int64_t group,
                   int64_t head_dim, const CacheLayout& c, float scale, std::vector<float>& scratch),
                  (out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, head_dim, c, scale,
                   scratch))

// One bf16 decode kernel for head_dim C * 16, compiled with TARGET as NAME##_C, calling the
// instantiation KERNEL (in parentheses when it has a comma): the vdpbf16ps and AMX ones below.
// The portable ones above are compiled per ISA level (VLLM_LITE_PER_ISA).
#define VLLM_LITE_BF16_DECODE_KERNEL(TARGET, NAME, KERNEL, C)                                    \
  TARGET                                                                                         \
  void NAME##_##C(uint16_t* out, const uint16_t* query, int64_t q_stride_h,                      \
                  const uint16_t* cache, const int32_t* blocks, int64_t seq_len,                 \
                  int64_t kv_begin, int64_t kv_end, int64_t group,                               \
                  const CacheLayout& c, float scale, std::vector<float>& scratch) {              \
    KERNEL(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale,    \
           scratch);                                                                             \
  }
#define VLLM_LITE_BF16_DECODE_PORTABLE(D)                                                              \
  VLLM_LITE_PER_ISA(decode_one_bf16_##D, (decode_one_bf16_tiled<D, L>),                                 \
                    (uint16_t* out, const uint16_t* query, int64_t q_stride_h, const uint16_t* cache,   \
                     const int32_t* blocks, int64_t seq_len, int64_t kv_begin, int64_t kv_end,          \
                     int64_t group, const CacheLayout& c, float scale, std::vector<float>& scratch),    \
                    (out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale, \
                     scratch))
VLLM_LITE_BF16_DECODE_PORTABLE(32)
VLLM_LITE_BF16_DECODE_PORTABLE(64)
VLLM_LITE_BF16_DECODE_PORTABLE(128)
#undef VLLM_LITE_BF16_DECODE_PORTABLE

// The same kernels over an fp8 cache (T: fp8_e4m3 or fp8_e5m2), float32 query and output.
#define VLLM_LITE_FP8_DECODE_PORTABLE(T, D)                                                              \
  VLLM_LITE_PER_ISA(decode_one_##T##_##D, (decode_one_bf16_tiled<D, L, T, float>),                      \
                    (float* out, const float* query, int64_t q_stride_h, const T* cache,                \
                     const int32_t* blocks, int64_t seq_len, int64_t kv_begin, int64_t kv_end,          \
                     int64_t group, const CacheLayout& c, float scale, std::vector<float>& scratch),    \
                    (out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale, \
                     scratch))
#define VLLM_LITE_FP8_DECODE_ANY(T)                                                                       \
  VLLM_LITE_PER_ISA(decode_one_##T##_any, (decode_one_bf16_any_head_dim<L, T, float>),                   \
                    (float* out, const float* query, int64_t q_stride_h, const T* cache,                 \
                     const int32_t* blocks, int64_t seq_len, int64_t kv_begin, int64_t kv_end,           \
                     int64_t group, int64_t head_dim, const CacheLayout& c, float scale,                 \
                     std::vector<float>& scratch),                                                       \
                    (out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, head_dim,  \
                     c, scale, scratch))
VLLM_LITE_FP8_DECODE_PORTABLE(fp8_e4m3, 32)
VLLM_LITE_FP8_DECODE_PORTABLE(fp8_e4m3, 64)
VLLM_LITE_FP8_DECODE_PORTABLE(fp8_e4m3, 128)
VLLM_LITE_FP8_DECODE_ANY(fp8_e4m3)
VLLM_LITE_FP8_DECODE_PORTABLE(fp8_e5m2, 32)
VLLM_LITE_FP8_DECODE_PORTABLE(fp8_e5m2, 64)
VLLM_LITE_FP8_DECODE_PORTABLE(fp8_e5m2, 128)
VLLM_LITE_FP8_DECODE_ANY(fp8_e5m2)
#undef VLLM_LITE_FP8_DECODE_PORTABLE
#undef VLLM_LITE_FP8_DECODE_ANY

// One fp8 decode item: the tiled kernel for head_dim 32 / 64 / 128, else one token at a time.
#define VLLM_LITE_FP8_DECODE_ITEM(T)                                                                          \
  void decode_item_##T(float* out, const float* query, int64_t q_stride_h, const T* cache,                   \
                       const int32_t* blocks, int64_t seq_len, int64_t kv_begin, int64_t kv_end, int64_t group, \
                       int64_t head_dim, const CacheLayout& c, float scale, std::vector<float>& scratch) {   \
    if (seq_len <= 0) {                                                                                    \
      std::fill(out, out + (kv_end - kv_begin) * group * head_dim, 0.f);                                   \
      return;                                                                                              \
    }                                                                                                      \
    switch (head_dim) {                                                                                    \
      case 32:                                                                                             \
        return decode_one_##T##_32(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, \
                                   c, scale, scratch);                                                     \
      case 64:                                                                                             \
        return decode_one_##T##_64(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, \
                                   c, scale, scratch);                                                     \
      case 128:                                                                                            \
        return decode_one_##T##_128(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end,     \
                                    group, c, scale, scratch);                                             \
      default:                                                                                             \
        return decode_one_##T##_any(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end,     \
                                    group, head_dim, c, scale, scratch);                                   \
    }                                                                                                      \
  }
VLLM_LITE_FP8_DECODE_ITEM(fp8_e4m3)
VLLM_LITE_FP8_DECODE_ITEM(fp8_e5m2)
#undef VLLM_LITE_FP8_DECODE_ITEM

// ---- bf16 with vdpbf16ps (AVX512-BF16), picked at run time on CPUs that have it ----
// QK: bf16 pairs of the query times bf16 pairs of a K row, summed into fp32 lanes by vdpbf16ps
// (products of two bf16 values are exact in fp32, so this is an fp32 dot product in another
// order; the instruction treats bf16 denormals as zero and flushes denormal fp32 partial sums,
// both far below anything a softmax can see). PV: each V row widened in registers, the even
// and odd dims of every 32 apart by a shift and a mask (no shuffle), and added into the
// accumulators of all the tile's query heads; dims are put back in order once per head.
#if VLLM_LITE_BF16_DOT

// amx-tile/amx-bf16 let the score pass use AMX tiles; they run only where cpu_has_amx(kBf16) says
// so (the compiler emits no AMX instruction of its own).
#define VLLM_LITE_BF16_DOT_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))
#define VLLM_LITE_BF16_DOT_INLINE VLLM_LITE_INLINE VLLM_LITE_BF16_DOT_TARGET

// Rounds of a transposing reduction: 16 vectors of partial sums, one per token row, become one
// vector of the 16 row sums. Each round pairs two vectors; a blend keeps one half of the lanes
// in place and one shuffle brings the other half over, so a round costs one shuffle per pair.
VLLM_LITE_BF16_DOT_INLINE __m512 fold_halves(__m512 a, __m512 b) {  // 256-bit halves
  return _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, a, b), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 3, 2)));
}

VLLM_LITE_BF16_DOT_INLINE __m512 fold_quarters(__m512 a, __m512 b) {  // 128-bit quarters
  const __m512i other = _mm512_setr_epi32(4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27);
  return _mm512_add_ps(_mm512_mask_blend_ps(0xF0F0, a, b), _mm512_permutex2var_ps(a, other, b));
}

VLLM_LITE_BF16_DOT_INLINE __m512 fold_pairs(__m512 a, __m512 b) {  // 64-bit pairs within quarters
  return _mm512_add_ps(_mm512_mask_blend_ps(0xCCCC, a, b), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 3, 2)));
}

VLLM_LITE_BF16_DOT_INLINE __m512 fold_neighbours(__m512 a, __m512 b) {  // adjacent lanes
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The rounds leave the sum of slot s in lane bit_reverse(s) (4 bits): slot s holds row
// kRowOfSlot[s] so that lane j ends with row j's sum.
constexpr int kRowOfSlot[kLanes] = {0, 8, 4, 12, 1, 9, 5, 13, 2, 10, 6, 14, 3, 11, 7, 15};

VLLM_LITE_BF16_DOT_INLINE __m512 transpose_sums_bf16(const __m512* slots) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int i = 0; i < 8; ++i) halves[i] = fold_halves(slots[2 * i], slots[2 * i + 1]);
  for (int i = 0; i < 4; ++i) quarters[i] = fold_quarters(halves[2 * i], halves[2 * i + 1]);
  for (int i = 0; i < 2; ++i) pairs[i] = fold_pairs(quarters[2 * i], quarters[2 * i + 1]);
  return fold_neighbours(pairs[0], pairs[1]);
}

VLLM_LITE_BF16_DOT_INLINE __m512bh load_bf16_pairs(const uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// Scores (times `scale`) of one query head against up to 16 bf16 rows of its KV head;
// head_dim = C * 16, so a row is C / 2 vectors of 32 bf16.
template <int C, bool kFull>
VLLM_LITE_BF16_DOT_INLINE void score_tile_bf16(float* logits, const uint16_t* query, const uint16_t* rows,
                                               int64_t row_stride, int64_t n, float scale) {
  __m512bh q[C / 2];
  for (int k = 0; k < C / 2; ++k) q[k] = load_bf16_pairs(query + 32 * k);
  __m512 slots[kLanes];
#pragma GCC unroll 16
  for (int s = 0; s < kLanes; ++s) {
    const int64_t j = kRowOfSlot[s];
    __m512 sum = _mm512_setzero_ps();
    if (kFull || j < n)
#pragma GCC unroll 4
      for (int k = 0; k < C / 2; ++k) sum = _mm512_dpbf16_ps(sum, q[k], load_bf16_pairs(rows + j * row_stride + 32 * k));
    slots[s] = sum;
  }
  const __m512 scores = _mm512_mul_ps(transpose_sums_bf16(slots), _mm512_set1_ps(scale));
  if (kFull)
    _mm512_storeu_ps(logits, scores);
  else
    _mm512_mask_storeu_ps(logits, static_cast<__mmask16>((1u << n) - 1), scores);
}

// acc[g] += sum_i p[g][i] * V row i for G heads and up to 16 rows, p[g] = weights + g * weight_stride.
// acc[g] holds C vectors: the even then the odd dims of each 32 (store_heads_out_bf16 reorders).
template <int C, int G>
VLLM_LITE_BF16_DOT_INLINE void weighted_sum_tile_bf16(float* acc, const float* weights, int64_t weight_stride,
                                                      const uint16_t* rows, int64_t row_stride, int64_t n) {
  __m512 sum[G][C];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < C; ++k) sum[g][k] = _mm512_loadu_ps(acc + (g * C + k) * kLanes);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t i = 0; i < n; ++i) {
    __m512 w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm512_set1_ps(weights[g * weight_stride + i]);
#pragma GCC unroll 4
    for (int k = 0; k < C / 2; ++k) {
      const __m512i pairs = _mm512_loadu_si512(rows + i * row_stride + 32 * k);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
      for (int g = 0; g < G; ++g) {
        sum[g][2 * k] = _mm512_fmadd_ps(even, w[g], sum[g][2 * k]);
        sum[g][2 * k + 1] = _mm512_fmadd_ps(odd, w[g], sum[g][2 * k + 1]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < C; ++k) _mm512_storeu_ps(acc + (g * C + k) * kLanes, sum[g][k]);
}

// At most 3 heads per V pass over a tile: 3 heads x 8 accumulators (head_dim 128) still fit the
// 32 registers.
constexpr int64_t kMaxHeadsPerPass = 3;

template <int C>
VLLM_LITE_BF16_DOT_INLINE void weighted_sum_heads_bf16(float* acc, const float* weights, int64_t weight_stride,
                                                       const uint16_t* rows, int64_t row_stride, int64_t n,
                                                       int64_t num_heads) {
  for (int64_t h = 0; h < num_heads; h += kMaxHeadsPerPass) {
    float* a = acc + h * C * kLanes;
    const float* p = weights + h * weight_stride;
    switch (std::min(kMaxHeadsPerPass, num_heads - h)) {
      case 1: weighted_sum_tile_bf16<C, 1>(a, p, weight_stride, rows, row_stride, n); break;
      case 2: weighted_sum_tile_bf16<C, 2>(a, p, weight_stride, rows, row_stride, n); break;
      default: weighted_sum_tile_bf16<C, 3>(a, p, weight_stride, rows, row_stride, n); break;
    }
  }
}

// One head's accumulators (even dims, odd dims of each 32) back in dim order, times inv_sum,
// rounded to bf16.
template <int C>
VLLM_LITE_BF16_DOT_INLINE void store_heads_out_bf16(uint16_t* out, const float* acc, float inv_sum) {
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
  const __m512 scale = _mm512_set1_ps(inv_sum);
  for (int k = 0; k < C / 2; ++k) {
    const __m512 even = _mm512_loadu_ps(acc + 2 * k * kLanes), odd = _mm512_loadu_ps(acc + (2 * k + 1) * kLanes);
    store_bf16(out + 32 * k, _mm512_mul_ps(_mm512_permutex2var_ps(even, low, odd), scale));
    store_bf16(out + 32 * k + kLanes, _mm512_mul_ps(_mm512_permutex2var_ps(even, high, odd), scale));
  }
}

// ---- the score pass on AMX tiles (CPUs with AMX-BF16; head_dim 64 or 128, block_size a multiple
// of 16, at most 16 query heads per KV head). Per 16-row tile of one KV head's K rows, for each
// 32-dim chunk: A = the K rows as they lie in the cache (16 rows x 64 bytes, the cache's row
// stride), B = the group's query heads transposed into bf16 pairs ([16 dim pairs][16 heads x 2]),
// C += A x B: the 16 x 16 fp32 scores of the tile's tokens (rows) by heads (columns), bf16
// products summed in fp32 as vdpbf16ps does. Rows past the sequence's end hold other data of
// the same block; their scores are dropped. ----

// Tile registers: 0 the scores, 1 a K chunk, 2.. the query chunks.

// The query heads [first, first + group) as AMX B tiles, one per 32 dims: heads past the group 0.
template <int C>
VLLM_LITE_BF16_DOT_INLINE void load_query_tiles(uint16_t (*pairs)[kLanes * 32], const uint16_t* query,
                                                int64_t q_stride_h, int64_t group) {
  std::memset(pairs, 0, sizeof(uint16_t) * (C / 2) * kLanes * 32);
  for (int64_t g = 0; g < group; ++g)
    for (int k = 0; k < C / 2; ++k)
      for (int64_t d = 0; d < 32; ++d) pairs[k][(d / 2) * 32 + g * 2 + d % 2] = query[g * q_stride_h + 32 * k + d];
  _tile_loadd(2, pairs[0], 64);
  _tile_loadd(3, pairs[1], 64);
  if constexpr (C == 8) {
    _tile_loadd(4, pairs[2], 64);
    _tile_loadd(5, pairs[3], 64);
  }
}

// Scores (times `scale`) of the loaded query heads against rows [0, n) of one KV head's tile;
// head g's go to logits + g * logit_stride.
template <int C>
VLLM_LITE_BF16_DOT_INLINE void score_tile_amx(float* logits, int64_t logit_stride, const uint16_t* rows,
                                              int64_t row_stride, int64_t n, int64_t group, float scale) {
  alignas(64) float scores[kLanes * kLanes];  // [token][head]
  const int64_t stride_bytes = row_stride * static_cast<int64_t>(sizeof(uint16_t));
  _tile_zero(0);
  _tile_loadd(1, rows, stride_bytes);
  _tile_dpbf16ps(0, 1, 2);
  _tile_loadd(1, rows + 32, stride_bytes);
  _tile_dpbf16ps(0, 1, 3);
  if constexpr (C == 8) {
    _tile_loadd(1, rows + 64, stride_bytes);
    _tile_dpbf16ps(0, 1, 4);
    _tile_loadd(1, rows + 96, stride_bytes);
    _tile_dpbf16ps(0, 1, 5);
  }
  _tile_stored(0, scores, 64);
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t g = 0; g < group; ++g)
    _mm512_mask_storeu_ps(logits + g * logit_stride, valid,
                          _mm512_mul_ps(_mm512_i32gather_ps(column, scores + g, 4), _mm512_set1_ps(scale)));
}

// 32 float8 bytes as the bf16 values they encode, exactly (every e4m3 / e5m2 value is a bf16
// value), in 16-bit lanes: a normal byte's fields moved into bf16's with the exponent rebiased
// (+120 for e4m3, +112 for e5m2), a subnormal one (exponent 0) looked up by its mantissa, NaN (and
// e5m2's inf) set apart; the sign kept.
template <typename T>
VLLM_LITE_BF16_DOT_INLINE __m512i fp8_to_bf16_32(const T* bytes) {
  constexpr bool kE4m3 = std::is_same_v<T, fp8_e4m3>;
  constexpr int kMantissaBits = kE4m3 ? 3 : 2;
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8);
  const __m512i magnitude = _mm512_and_si512(b, _mm512_set1_epi16(0x7F));
  const __m512i rebias = _mm512_set1_epi16(static_cast<int16_t>((kE4m3 ? 120 : 112) << 7));
  __m512i bits = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 7 - kMantissaBits), rebias);
  // subnormals: mantissa m is m * 2^-9 (e4m3) or m * 2^-16 (e5m2); the table is indexed by m
  alignas(64) static constexpr uint16_t kE4m3Subnormals[32] = {
      0, 118 << 7, 119 << 7, (119 << 7) | 0x40, 120 << 7, (120 << 7) | 0x20, (120 << 7) | 0x40, (120 << 7) | 0x60};
  alignas(64) static constexpr uint16_t kE5m2Subnormals[32] = {0, 111 << 7, 112 << 7, (112 << 7) | 0x40};
  const __m512i subnormal = _mm512_load_si512(kE4m3 ? kE4m3Subnormals : kE5m2Subnormals);
  const __mmask32 is_subnormal = _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(1 << kMantissaBits));
  bits = _mm512_mask_permutexvar_epi16(bits, is_subnormal, magnitude, subnormal);
  if constexpr (kE4m3) {  // 0x7F: NaN (e4m3fn has no inf)
    bits = _mm512_mask_mov_epi16(bits, _mm512_cmpeq_epi16_mask(magnitude, _mm512_set1_epi16(0x7F)),
                                 _mm512_set1_epi16(0x7FC0));
  } else {  // exponent 31: inf (mantissa 0), else NaN
    const __mmask32 special = _mm512_cmpge_epu16_mask(magnitude, _mm512_set1_epi16(0x7C));
    const __mmask32 nan = _mm512_cmpgt_epu16_mask(magnitude, _mm512_set1_epi16(0x7C));
    bits = _mm512_mask_mov_epi16(bits, special, _mm512_set1_epi16(0x7F80));
    bits = _mm512_mask_mov_epi16(bits, nan, _mm512_set1_epi16(0x7FC0));
  }
  return _mm512_or_si512(bits, sign);
}

// A tile's n (<= 16) K or V rows as bf16 rows: a bf16 cache's as they lie (row stride
// `row_stride`), an fp8 cache's widened into `widened` (row stride C * 16, fp8_to_bf16_32).
// `stride` gets the rows' stride.
template <int C, typename T>
VLLM_LITE_BF16_DOT_INLINE const uint16_t* bf16_rows(const T* rows, int64_t row_stride, int64_t n, uint16_t* widened,
                                                    int64_t& stride) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    stride = row_stride;
    return rows;
  } else {
    static_assert(C % 2 == 0, "whole 32-value chunks");
    for (int64_t j = 0; j < n; ++j)
      for (int k = 0; k < C / 2; ++k)
        _mm512_storeu_si512(widened + j * C * kLanes + 32 * k, fp8_to_bf16_32(rows + j * row_stride + 32 * k));
    stride = C * kLanes;
    return widened;
  }
}

// decode_one_bf16_tiled's passes with the bf16 K rows fed to vdpbf16ps (or AMX tiles) as they are
// and the V rows widened in registers. Both passes take a block's rows for all the item's KV
// heads before the next block (one contiguous stretch of the cache). T: the cache's element, bf16
// or (the AMX passes only) an fp8 cache's bytes, each tile of rows widened to bf16 first.
template <int C, bool kAmx, typename T = uint16_t>
VLLM_LITE_BF16_DOT_INLINE void decode_one_bf16_dot(uint16_t* out, const uint16_t* query, int64_t q_stride_h,
                                                   const T* cache, const int32_t* blocks, int64_t seq_len,
                                                   int64_t kv_begin, int64_t kv_end, int64_t group,
                                                   const CacheLayout& c, float scale, std::vector<float>& scratch) {
  static_assert(kAmx || std::is_same_v<T, uint16_t>, "an fp8 cache takes the AMX passes only");
  constexpr int64_t head_dim = C * kLanes;
  const int64_t num_kv = kv_end - kv_begin, num_heads = num_kv * group;
  const ItemScratch space = item_scratch(scratch, num_heads, seq_len, head_dim);
  float *logits = space.logits, *acc = space.acc, *inv_sum = space.inv_sum;
  alignas(64) uint16_t widened[std::is_same_v<T, uint16_t> ? 1 : kLanes * head_dim] = {};  // (fp8 rows only)
  int64_t stride = 0;
  const int64_t num_blocks = (seq_len + c.block_size - 1) / c.block_size;
  auto block_rows = [&](int64_t b, int64_t which) {
    return cache + blocks[b] * c.stride_block + which * c.stride_kv + kv_begin * c.stride_head;
  };
  const int64_t block_bytes = item_block_bytes(c, num_kv, sizeof(T));
  auto prefetch_block = [&](int64_t b, int64_t which) {
    if (b < num_blocks) prefetch_l2(block_rows(b, which), block_bytes);
  };
  for (int64_t b = 0; b < kPrefetchBlocks; ++b) prefetch_block(b, 0);
  if constexpr (kAmx) {
    alignas(64) uint16_t query_pairs[C / 2][kLanes * 32];
    for (int64_t kv = 0; kv < num_kv; ++kv) {
      load_query_tiles<C>(query_pairs, query + kv * group * q_stride_h, q_stride_h, group);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t start = b * c.block_size, n = std::min(c.block_size, seq_len - start);
        if (kv == 0) prefetch_block(b + kPrefetchBlocks, 0);
        const T* rows = block_rows(b, 0) + kv * c.stride_head;
        for (int64_t t = 0; t < n; t += kLanes) {
          const int64_t m = std::min(kLanes, n - t);
          const uint16_t* k_rows = bf16_rows<C>(rows + t * c.stride_offset, c.stride_offset, m, widened, stride);
          score_tile_amx<C>(logits + kv * group * seq_len + start + t, seq_len, k_rows, stride, m, group, scale);
        }
      }
    }
  }
  if constexpr (!kAmx) for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * c.block_size, n = std::min(c.block_size, seq_len - start);
    prefetch_block(b + kPrefetchBlocks, 0);
    for (int64_t kv = 0; kv < num_kv; ++kv) {
      const uint16_t* rows = block_rows(b, 0) + kv * c.stride_head;
      for (int64_t t = 0; t < n; t += kLanes) {
        const int64_t m = std::min(kLanes, n - t);
        for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
          float* tile_logits = logits + h * seq_len + start + t;
          if (m == kLanes)
            score_tile_bf16<C, true>(tile_logits, query + h * q_stride_h, rows + t * c.stride_offset, c.stride_offset, m, scale);
          else
            score_tile_bf16<C, false>(tile_logits, query + h * q_stride_h, rows + t * c.stride_offset, c.stride_offset, m, scale);
        }
      }
    }
  }
  for (int64_t b = 0; b < kPrefetchBlocks; ++b) prefetch_block(b, 1);
  for (int64_t h = 0; h < num_heads; ++h) inv_sum[h] = 1.f / softmax_numerators(logits + h * seq_len, seq_len);
  std::fill(acc, acc + num_heads * head_dim, 0.f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t start = b * c.block_size, n = std::min(c.block_size, seq_len - start);
    prefetch_block(b + kPrefetchBlocks, 1);
    for (int64_t kv = 0; kv < num_kv; ++kv) {
      const T* rows = block_rows(b, 1) + kv * c.stride_head;
      for (int64_t t = 0; t < n; t += kLanes) {
        const int64_t m = std::min(kLanes, n - t);
        const uint16_t* v_rows = bf16_rows<C>(rows + t * c.stride_offset, c.stride_offset, m, widened, stride);
        weighted_sum_heads_bf16<C>(acc + kv * group * head_dim, logits + kv * group * seq_len + start + t, seq_len,
                                   v_rows, stride, m, group);
      }
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) store_heads_out_bf16<C>(out + h * head_dim, acc + h * head_dim, inv_sum[h]);
}

VLLM_LITE_BF16_DECODE_KERNEL(VLLM_LITE_BF16_DOT_TARGET, decode_one_bf16_dot, (decode_one_bf16_dot<2, false>), 2)
VLLM_LITE_BF16_DECODE_KERNEL(VLLM_LITE_BF16_DOT_TARGET, decode_one_bf16_dot, (decode_one_bf16_dot<4, false>), 4)
VLLM_LITE_BF16_DECODE_KERNEL(VLLM_LITE_BF16_DOT_TARGET, decode_one_bf16_dot, (decode_one_bf16_dot<8, false>), 8)
VLLM_LITE_BF16_DECODE_KERNEL(VLLM_LITE_BF16_DOT_TARGET, decode_one_bf16_amx, (decode_one_bf16_dot<4, true>), 4)
VLLM_LITE_BF16_DECODE_KERNEL(VLLM_LITE_BF16_DOT_TARGET, decode_one_bf16_amx, (decode_one_bf16_dot<8, true>), 8)
#undef VLLM_LITE_BF16_DECODE_KERNEL

// The AMX passes over an fp8 cache (T: fp8_e4m3 or fp8_e5m2), bf16 query and output, head_dim C * 16.
#define VLLM_LITE_FP8_AMX_KERNEL(T, C)                                                                        \
  VLLM_LITE_BF16_DOT_TARGET                                                                                   \
  void decode_one_##T##_amx_##C(uint16_t* out, const uint16_t* query, int64_t q_stride_h, const T* cache,     \
                                const int32_t* blocks, int64_t seq_len, int64_t kv_begin, int64_t kv_end,     \
                                int64_t group, const CacheLayout& c, float scale, std::vector<float>& scratch) { \
    decode_one_bf16_dot<C, true, T>(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, c,  \
                                    scale, scratch);                                                          \
  }
VLLM_LITE_FP8_AMX_KERNEL(fp8_e4m3, 4)
VLLM_LITE_FP8_AMX_KERNEL(fp8_e4m3, 8)
VLLM_LITE_FP8_AMX_KERNEL(fp8_e5m2, 4)
VLLM_LITE_FP8_AMX_KERNEL(fp8_e5m2, 8)
#undef VLLM_LITE_FP8_AMX_KERNEL

#endif  // VLLM_LITE_BF16_DOT

bool cpu_has_bf16_dot() {
#if VLLM_LITE_BF16_DOT
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx512bf16"));
  return has;
#else
  return false;
#endif
}

// bf16_dot: the vdpbf16ps kernels (the caller has checked the CPU) for head_dim 32/64/128.
void decode_item_bf16(uint16_t* out, const uint16_t* query, int64_t q_stride_h,
                      const uint16_t* cache, const int32_t* blocks, int64_t seq_len,
                      int64_t kv_begin, int64_t kv_end, int64_t group, int64_t head_dim,
                      const CacheLayout& c, float scale, bool bf16_dot, bool amx, std::vector<float>& scratch) {
  if (seq_len <= 0) {  // a padded row: nothing to attend to
    std::fill(out, out + (kv_end - kv_begin) * group * head_dim, uint16_t{0});
    return;
  }
#if VLLM_LITE_BF16_DOT
  if (amx && head_dim == 4 * kLanes)
    return decode_one_bf16_amx_4(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale,
                                 scratch);
  if (amx && head_dim == 8 * kLanes)
    return decode_one_bf16_amx_8(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale,
                                 scratch);
  if (bf16_dot) {
    switch (head_dim) {
      case 2 * kLanes:
        return decode_one_bf16_dot_2(out, query, q_stride_h, cache, blocks, seq_len, kv_begin,
                                     kv_end, group, c, scale, scratch);
      case 4 * kLanes:
        return decode_one_bf16_dot_4(out, query, q_stride_h, cache, blocks, seq_len, kv_begin,
                                     kv_end, group, c, scale, scratch);
      case 8 * kLanes:
        return decode_one_bf16_dot_8(out, query, q_stride_h, cache, blocks, seq_len, kv_begin,
                                     kv_end, group, c, scale, scratch);
      default:
        break;
    }
  }
#endif
  switch (head_dim) {
    case 32:
      return decode_one_bf16_32(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale,
                                scratch);
    case 64:
      return decode_one_bf16_64(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale,
                                scratch);
    case 128:
      return decode_one_bf16_128(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale,
                                 scratch);
    default:
      return decode_one_bf16_any(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end,
                                 group, head_dim, c, scale, scratch);
  }
}

// The work split of decode_attention_f32, over bf16 data. use_bf16_dot: the vdpbf16ps kernels
// where the CPU has the instruction (false: the portable ones, for tests).
void decode_attention_bf16(uint16_t* out, const uint16_t* query, const uint16_t* cache,
                           const int32_t* block_table, const int32_t* seq_lens, int64_t num_seqs,
                           int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t q_stride_t, int64_t q_stride_h, int64_t bt_stride,
                           CacheLayout layout, float scale, bool use_bf16_dot, int num_threads) {
  const bool bf16_dot = use_bf16_dot && cpu_has_bf16_dot();
  const int64_t group = num_q_heads / num_kv_heads;
  const bool amx = bf16_dot && amx_tiles_fit(head_dim, layout.block_size, group) && cpu_has_amx(AmxKind::kBf16);
  const int64_t heads_per_item = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scratch;
#if VLLM_LITE_BF16_DOT
    if (amx) load_tile_config(2 + head_dim / 32);  // per thread: the tile configuration is thread state
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * items_per_seq; ++item) {
      const int64_t s = item / items_per_seq;
      const int64_t kv_begin = (item % items_per_seq) * heads_per_item;
      decode_item_bf16(out + (s * num_q_heads + kv_begin * group) * head_dim,
                       query + s * q_stride_t + kv_begin * group * q_stride_h, q_stride_h, cache,
                       block_table + s * bt_stride, seq_lens[s], kv_begin,
                       kv_begin + heads_per_item, group, head_dim, layout, scale, bf16_dot, amx, scratch);
    }
#if VLLM_LITE_BF16_DOT
    if (amx) release_tiles();
#endif
  }
}

// decode_attention_bf16's work split over an fp8 cache: float32 query and output, or bf16 ones on
// the AMX passes (`amx`: each thread loads the tile configuration).
template <typename Q, typename T, typename Item>
void decode_attention_fp8(Q* out, const Q* query, const T* cache, const int32_t* block_table,
                          const int32_t* seq_lens, int64_t num_seqs, int64_t num_q_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t q_stride_t, int64_t q_stride_h, int64_t bt_stride,
                          CacheLayout layout, float scale, int num_threads, Item decode_item, bool amx = false) {
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t heads_per_item = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scratch;
#if VLLM_LITE_BF16_DOT
    if (amx) load_tile_config(2 + head_dim / 32);
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * items_per_seq; ++item) {
      const int64_t s = item / items_per_seq;
      const int64_t kv_begin = (item % items_per_seq) * heads_per_item;
      decode_item(out + (s * num_q_heads + kv_begin * group) * head_dim,
                  query + s * q_stride_t + kv_begin * group * q_stride_h, q_stride_h, cache,
                  block_table + s * bt_stride, seq_lens[s], kv_begin, kv_begin + heads_per_item, group, head_dim,
                  layout, scale, scratch);
    }
#if VLLM_LITE_BF16_DOT
    if (amx) release_tiles();
#endif
  }
}

// First index of the row's maximum. Lane j keeps the first maximum among elements j, j+L, ...
// (strict >); the answer is the smallest index among lanes holding the overall maximum.
template <int L>
VLLM_LITE_INLINE void argmax_of_row(const float* x, int64_t n, int64_t* result) {
  typedef VecF<L> V;
  typedef VecI32<L> I;
  int64_t d = 0;
  float best_value = -std::numeric_limits<float>::infinity();
  int64_t best_index = 0;
  if (n >= L) {
    V best = load<V>(x);
    I index;
    for (int j = 0; j < L; ++j) index[j] = j;
    I best_idx = index;
    for (d = L; d + L <= n; d += L) {
      index += L;
      const V v = load<V>(x + d);
      const I greater = v > best;
      best = greater ? v : best;
      best_idx = greater ? index : best_idx;
    }
    best_value = best[0];
    best_index = best_idx[0];
    for (int64_t j = 1; j < L; ++j) {
      if (best[j] > best_value || (best[j] == best_value && best_idx[j] < best_index)) {
        best_value = best[j];
        best_index = best_idx[j];
      }
    }
  }
  for (; d < n; ++d) {
    if (x[d] > best_value || (d == 0 && n < L)) {
      best_value = x[d];
      best_index = d;
    }
  }
  *result = best_index;
}

VLLM_LITE_PER_ISA(argmax_row, argmax_of_row<L>, (const float* x, int64_t n, int64_t* result), (x, n, result))

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat,
              "argmax_rows supports float32 CPU tensors only");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be [rows, vocab] (vocab > 0) with a contiguous last dimension");
  const int64_t rows = logits.size(0), cols = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  const int threads = rows * cols >= (1 << 16) ? at::get_num_threads() : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) argmax_row(x + r * stride, cols, result + r);
  return out;
}

void check_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.device().is_cpu(), "kv_cache must be a CPU tensor");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2,
              "kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(kv_cache.stride(4) == 1, "kv_cache needs a contiguous last dimension");
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping) {
  check_cache(kv_cache);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value must be [T, H, D]");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(),
              "key/value dtype must match kv_cache");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4),
              "key/value heads and head_dim must match kv_cache");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1,
              "key/value need a contiguous last dimension");
  const int64_t* slots = check_slots(slot_mapping, key, kv_cache);
  const int64_t num_tokens = slot_mapping.size(0), num_heads = key.size(1);
  const int64_t elem = kv_cache.element_size(), row_bytes = key.size(2) * elem;
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);
  const CacheLayout layout = cache_layout(kv_cache);
  const int threads = num_tokens * num_heads * row_bytes >= (1 << 20) ? at::get_num_threads() : 1;
  for_each_cache_row(slots, num_tokens, num_heads, layout, threads,
                     [&](int64_t t, int64_t h, int64_t k_row, int64_t v_row) {
                       std::memcpy(cache + k_row * elem, k + (t * ks0 + h * ks1) * elem, row_bytes);
                       std::memcpy(cache + v_row * elem, v + (t * vs0 + h * vs1) * elem, row_bytes);
                     });
}

// One fp8 decode item on the AMX passes (head_dim 64 or 128), bf16 query and output.
template <typename T>
void decode_item_fp8_amx(uint16_t* out, const uint16_t* query, int64_t q_stride_h, const T* cache,
                         const int32_t* blocks, int64_t seq_len, int64_t kv_begin, int64_t kv_end, int64_t group,
                         int64_t head_dim, const CacheLayout& c, float scale, std::vector<float>& scratch) {
  if (seq_len <= 0) {  // a padded row: nothing to attend to
    std::fill(out, out + (kv_end - kv_begin) * group * head_dim, uint16_t{0});
    return;
  }
#if VLLM_LITE_BF16_DOT
  if constexpr (std::is_same_v<T, fp8_e4m3>) {
    if (head_dim == 64)
      return decode_one_fp8_e4m3_amx_4(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, c,
                                       scale, scratch);
    return decode_one_fp8_e4m3_amx_8(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, c,
                                     scale, scratch);
  } else {
    if (head_dim == 64)
      return decode_one_fp8_e5m2_amx_4(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, c,
                                       scale, scratch);
    return decode_one_fp8_e5m2_amx_8(out, query, q_stride_h, cache, blocks, seq_len, kv_begin, kv_end, group, c,
                                     scale, scratch);
  }
#endif
}

// An fp8 cache under a bf16 query and output: the bf16 cache's AMX passes where they fit (each
// tile of K and V rows widened to bf16 first, exactly), else the float32 kernels on the query
// widened (exactly) and the output rounded to bf16 once.
template <typename T, typename FloatItem>
void decode_attention_fp8_bf16(at::Tensor& out, const at::Tensor& query, const T* cache, const at::Tensor& block_table,
                               const int32_t* lens, int64_t num_kv_heads, CacheLayout layout, float scale,
                               bool use_bf16_dot, FloatItem float_item) {
  const int64_t num_seqs = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const bool amx = use_bf16_dot && cpu_has_bf16_dot() &&
                   amx_tiles_fit(head_dim, layout.block_size, num_q_heads / num_kv_heads) &&
                   cpu_has_amx(AmxKind::kBf16);
  if (amx)
    return decode_attention_fp8(static_cast<uint16_t*>(out.data_ptr()), static_cast<const uint16_t*>(query.data_ptr()),
                                cache, block_table.data_ptr<int32_t>(), lens, num_seqs, num_q_heads, num_kv_heads,
                                head_dim, query.stride(0), query.stride(1), block_table.stride(0), layout, scale,
                                at::get_num_threads(), decode_item_fp8_amx<T>, true);
  const at::Tensor widened = query.to(at::kFloat);
  at::Tensor result = at::empty(query.sizes(), query.options().dtype(at::kFloat));
  decode_attention_fp8(result.data_ptr<float>(), widened.data_ptr<float>(), cache, block_table.data_ptr<int32_t>(),
                       lens, num_seqs, num_q_heads, num_kv_heads, head_dim, widened.stride(0), widened.stride(1),
                       block_table.stride(0), layout, scale, at::get_num_threads(), float_item);
  out.copy_(result);
}

void paged_attention_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale, int64_t sliding_window, bool use_bf16_dot) {
  check_cache(kv_cache);
  const at::ScalarType dtype = kv_cache.scalar_type();
  const bool fp8 = dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2;
  TORCH_CHECK(fp8 ? (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16) &&
                        out.scalar_type() == query.scalar_type()
                  : (dtype == at::kFloat || dtype == at::kBFloat16) && query.scalar_type() == dtype &&
                        out.scalar_type() == dtype,
              "paged_attention_decode supports float32 or bfloat16 (query, out and kv_cache alike), or an fp8 "
              "(e4m3fn, e5m2) kv_cache with float32 or bfloat16 query and out (alike)");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1,
              "query must be [num_seqs, num_q_heads, head_dim] with a contiguous last dimension");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(),
              "out must be contiguous and shaped like query");
  const int64_t num_seqs = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(head_dim == kv_cache.size(4), "head_dim differs between query and kv_cache");
  TORCH_CHECK(num_q_heads % num_kv_heads == 0, "num_q_heads must be a multiple of num_kv_heads");
  const int32_t* lens = check_decode_tables(block_table, seq_lens, num_seqs, kv_cache.size(2));
  const CacheLayout layout = cache_layout(kv_cache);
  TORCH_CHECK(dtype == at::kFloat || sliding_window <= 0,
              "paged_attention_decode: a sliding window needs float32 (bf16 layers with a window "
              "take the torch path)");
  if (dtype == at::kFloat8_e4m3fn && query.scalar_type() == at::kBFloat16)
    return decode_attention_fp8_bf16(out, query, static_cast<const fp8_e4m3*>(kv_cache.data_ptr()), block_table, lens,
                                     num_kv_heads, layout, static_cast<float>(scale), use_bf16_dot,
                                     decode_item_fp8_e4m3);
  if (dtype == at::kFloat8_e5m2 && query.scalar_type() == at::kBFloat16)
    return decode_attention_fp8_bf16(out, query, static_cast<const fp8_e5m2*>(kv_cache.data_ptr()), block_table, lens,
                                     num_kv_heads, layout, static_cast<float>(scale), use_bf16_dot,
                                     decode_item_fp8_e5m2);
  if (dtype == at::kFloat8_e4m3fn)
    return decode_attention_fp8(out.data_ptr<float>(), query.data_ptr<float>(),
                                static_cast<const fp8_e4m3*>(kv_cache.data_ptr()),
                                block_table.data_ptr<int32_t>(), lens, num_seqs, num_q_heads, num_kv_heads, head_dim,
                                query.stride(0), query.stride(1), block_table.stride(0), layout,
                                static_cast<float>(scale), at::get_num_threads(), decode_item_fp8_e4m3);
  if (dtype == at::kFloat8_e5m2)
    return decode_attention_fp8(out.data_ptr<float>(), query.data_ptr<float>(),
                                static_cast<const fp8_e5m2*>(kv_cache.data_ptr()),
                                block_table.data_ptr<int32_t>(), lens, num_seqs, num_q_heads, num_kv_heads, head_dim,
                                query.stride(0), query.stride(1), block_table.stride(0), layout,
                                static_cast<float>(scale), at::get_num_threads(), decode_item_fp8_e5m2);
  if (dtype == at::kBFloat16)
    return decode_attention_bf16(
        static_cast<uint16_t*>(out.data_ptr()), static_cast<const uint16_t*>(query.data_ptr()),
        static_cast<const uint16_t*>(kv_cache.data_ptr()), block_table.data_ptr<int32_t>(), lens,
        num_seqs, num_q_heads, num_kv_heads, head_dim, query.stride(0), query.stride(1),
        block_table.stride(0), layout, static_cast<float>(scale), use_bf16_dot, at::get_num_threads());
  decode_attention_f32(out.data_ptr<float>(), query.data_ptr<float>(), kv_cache.data_ptr<float>(),
                       block_table.data_ptr<int32_t>(), lens, num_seqs, num_q_heads, num_kv_heads,
                       head_dim, query.stride(0), query.stride(1), block_table.stride(0), layout,
                       static_cast<float>(scale), sliding_window, at::get_num_threads());
}

}  // namespace

TORCH_LIBRARY(vllm_lite_C, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention_decode(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, "
      "Tensor seq_lens, float scale, int sliding_window=0, bool use_bf16_dot=True) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  // The ISA level the per-ISA kernels run at (cpu_multiversion.h); no tensor to dispatch on.
  m.def("cpu_capability() -> str", [] { return std::string(isa_name(isa_lanes())); });
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) {
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("paged_attention_decode", &paged_attention_decode);
  m.impl("argmax_rows", &argmax_rows);
}

// `import vllm_lite._C` runs the registrations above; the module itself is empty.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
