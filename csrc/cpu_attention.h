// Shared by the csrc CPU attention kernels (cpu_ops.cpp: float32 and bf16 caches; kv_int8_ops.cpp:
// the int8_per_token_head cache): the paged cache's strides, fp32 dot/axpy, the softmax's
// numerators and the transposing reduction of 16 per-token accumulators.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_vec.h"

namespace vllm_lite_cpu {

// The first `n` scores drop out of the softmax (keys before a sliding window within its
// first block).
inline void mask_leading(float* logits, int64_t n) {
  std::fill(logits, logits + n, -std::numeric_limits<float>::infinity());
}

struct CacheLayout {
  int64_t block_size, stride_block, stride_kv, stride_offset, stride_head;
};

// A [num_blocks, 2, block_size, num_kv_heads, row] cache's layout.
inline CacheLayout cache_layout(const at::Tensor& kv_cache) {
  return {kv_cache.size(2), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)};
}

// The decode ops' block table and sequence lengths: int32, one row / entry per sequence, and no
// sequence longer than its row of blocks. Returns seq_lens' data.
inline const int32_t* check_decode_tables(const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t num_seqs,
                                          int64_t block_size) {
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1 &&
                  block_table.size(0) == num_seqs,
              "block_table must be int32 [num_seqs, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.size(0) == num_seqs,
              "seq_lens must be contiguous int32 [num_seqs]");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(lens[s] <= block_table.size(1) * block_size, "seq_lens[", s, "]=", lens[s],
                " needs more blocks than block_table has");
  return lens;
}

// The cache write's slot mapping: contiguous int64, no longer than `key`, every slot (-1 aside)
// inside the cache. Returns its data.
inline const int64_t* check_slots(const at::Tensor& slot_mapping, const at::Tensor& key, const at::Tensor& kv_cache) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  const int64_t num_tokens = slot_mapping.size(0);
  TORCH_CHECK(key.size(0) >= num_tokens, "slot_mapping is longer than key");
  const int64_t num_slots = kv_cache.size(0) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot_mapping[", t, "]=", slots[t], " is out of range");
  return slots;
}

// One decode item's fp32 work space: the scores of its heads over the context ([heads, seq_len]),
// their V sums ([heads, head_dim]) and 1 / softmax denominators ([heads]).
struct ItemScratch {
  float* logits;
  float* acc;
  float* inv_sum;
};

inline ItemScratch item_scratch(std::vector<float>& scratch, int64_t num_heads, int64_t seq_len, int64_t head_dim) {
  scratch.resize(num_heads * (seq_len + head_dim + 1));
  float* logits = scratch.data();
  return {logits, logits + num_heads * seq_len, logits + num_heads * (seq_len + head_dim)};
}

// The cache write's walk: fn(t, h, k_row, v_row) for each new token t (slot -1, padding, skipped)
// and KV head h, with the element offsets of its K and V rows in the cache; tokens split over
// `threads`.
template <typename Fn>
void for_each_cache_row(const int64_t* slots, int64_t num_tokens, int64_t num_heads, const CacheLayout& c,
                        int threads, const Fn& fn) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t base = (slot / c.block_size) * c.stride_block + (slot % c.block_size) * c.stride_offset;
    for (int64_t h = 0; h < num_heads; ++h) fn(t, h, base + h * c.stride_head, base + c.stride_kv + h * c.stride_head);
  }
}

// A decode item walks its blocks in their random order across the cache, where the hardware's
// stream prefetchers start each block cold: the kernels ask for the block this many ahead
// (measured: 64 sequences of ~360 tokens, cache 30x larger than L3, bf16 op 20% faster).
constexpr int64_t kPrefetchBlocks = 2;

// The bytes an item reads of one block's K or V: from its first KV head's row at the block's first
// token to the end of its last KV head's row at the last token.
inline int64_t item_block_bytes(const CacheLayout& c, int64_t num_kv, int64_t element_size) {
  return ((c.block_size - 1) * c.stride_offset + num_kv * c.stride_head) * element_size;
}

// Asks for [p, p + bytes) in L2 ahead of use.
VLLM_LITE_INLINE void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
}

// The next decode item's first K block, then its first V block, asked for in L2 a few lines at a
// time while the current item computes (`step`): a decode batch of short contexts reads one or
// two blocks a sequence, each a fresh stretch of the cache where the stream prefetchers start
// cold (and stop at every 4 KB page), so without it every item begins by waiting on memory
// (measured: the tiny model's 1,024 sequences of 100-176 tokens, fp32, 2 threads: the op 17-23%
// faster; its forward pass 9% at the median step of 1,024 requests growing to 450 tokens).
// A default-constructed one asks for nothing.
class NextItemPrefetch {
 public:
  NextItemPrefetch() = default;
  NextItemPrefetch(const void* k_rows, const void* v_rows, int64_t bytes)
      : k_(static_cast<const char*>(k_rows)), v_(static_cast<const char*>(v_rows)), bytes_(bytes) {}
  VLLM_LITE_INLINE void step(int lines) {
    for (int i = 0; i < lines && done_ < 2 * bytes_; ++i, done_ += 64)
      __builtin_prefetch(done_ < bytes_ ? k_ + done_ : v_ + (done_ - bytes_), 0, 2);
  }

 private:
  const char* k_ = nullptr;
  const char* v_ = nullptr;
  int64_t bytes_ = 0, done_ = 0;
};
// Lines asked for per tile of scores and per token row of the value pass (measured best of
// 2/1, 4/1, 8/3, 16/6 on the shape above).
constexpr int kNextItemLinesPerTile = 8, kNextItemLinesPerRow = 3;
// Items a thread takes at a time: the next item is known (and prefetched) within a run, and
// runs are handed out dynamically, as contexts differ in length: at most kItemsPerRun, and
// short enough that each thread gets kRunsPerThread of them (a small batch: runs of one item,
// every item its own, as balanced as before).
constexpr int64_t kItemsPerRun = 8, kRunsPerThread = 8;
inline int64_t items_per_run(int64_t num_items, int num_threads) {
  return std::max<int64_t>(1, std::min<int64_t>(kItemsPerRun, num_items / (kRunsPerThread * num_threads)));
}

template <typename V = vfloat>
VLLM_LITE_INLINE float dot(const float* a, const float* b, int64_t n) {
  constexpr int L = lanes_of<V>;
  V acc = {};
  int64_t d = 0;
  for (; d + L <= n; d += L) acc += load<V>(a + d) * load<V>(b + d);
  float sum = 0.f;
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum + hsum(acc);
}

template <typename V = vfloat>
VLLM_LITE_INLINE void axpy(float* y, float a, const float* x, int64_t n) {  // y += a * x
  constexpr int L = lanes_of<V>;
  int64_t d = 0;
  for (; d + L <= n; d += L) store(y + d, load<V>(y + d) + a * load<V>(x + d));
  for (; d < n; ++d) y[d] += a * x[d];
}

// In place: logits[0:n] -> exp(logits - max) (max >= every logit); returns their sum.
template <typename V = vfloat>
VLLM_LITE_INLINE float exp_below_max(float* logits, int64_t n, float max) {
  constexpr int L = lanes_of<V>;
  V vsum = {};
  int64_t t = 0;
  for (; t + L <= n; t += L) {
    const V e = exp_nonpositive(load<V>(logits + t) - max);
    store(logits + t, e);
    vsum += e;
  }
  float sum = hsum(vsum);
  for (; t < n; ++t) {
    logits[t] = std::exp(logits[t] - max);
    sum += logits[t];
  }
  return sum;
}

// In place: logits[0:n] -> exp(logits - max); returns their sum.
template <typename V = vfloat>
VLLM_LITE_INLINE float softmax_numerators(float* logits, int64_t n) {
  return exp_below_max<V>(logits, n, max_of<V>(logits, n));
}

// Pairwise-sum step of a transposing reduction: lane i of the result is x[2i] + x[2i+1] where
// x is the 2L lanes of (a, b). log2(L) rounds turn L accumulators into one vector of their sums.
// V: float or int32 lanes (exact integer sums).
template <typename V>
VLLM_LITE_INLINE V pair_sums(V a, V b) {
  constexpr int L = lanes_of<V>;
  typedef VecI32<L> I;
  I even;
  if constexpr (L == 16) {
    even = I{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  } else if constexpr (L == 8) {
    even = I{0, 2, 4, 6, 8, 10, 12, 14};
  } else {
    static_assert(L == 4, "4, 8 or 16 lanes");
    even = I{0, 2, 4, 6};
  }
  const I odd = even + 1;
  return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

// acc[j] holds token j's partial products (j < lanes); returns the vector of their sums, in order.
template <typename V>
VLLM_LITE_INLINE V transpose_sums(V* acc) {
#pragma GCC unroll 4
  for (int width = lanes_of<V>; width > 1; width /= 2)
#pragma GCC unroll 8
    for (int j = 0; j < width / 2; ++j) acc[j] = pair_sums(acc[2 * j], acc[2 * j + 1]);
  return acc[0];
}

}  // namespace vllm_lite_cpu
