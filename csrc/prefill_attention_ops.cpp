// Prefill attention over the paged bf16 KV cache on AMX tiles (CPUs with AMX-BF16):
//
//   paged_attention_prefill(out, query, kv_cache, block_table, query_start, query_lens, seq_lens, scale)
//       Sequence s's query_lens[s] new tokens are rows [query_start[s], query_start[s] + query_lens[s])
//       of query [T, Hq, D] and the last of its seq_lens[s] cached tokens (the cache write came
//       first); each attends causally to the cached keys up to its own position (prefix-cache hits
//       and earlier chunks included). Writes those rows of out [T, Hq, D]; other rows are left as
//       they are. bf16 query, cache and out; head_dim 64 or 128, block_size a multiple of 16;
//       no sliding window or soft cap (those layers take the torch path).
//
// Per (sequence, query head, tile of 16 query tokens), with grouped-query heads sharing their KV
// head's rows:
//   scores^T [keys x 16 queries] = K rows as they lie in the cache (A tiles) x the queries as bf16
//       pairs (B tiles), fp32 sums;
//   softmax per query = per vector lane, over the key rows (exact: all scores of the tile first);
//   out^T [D x 16 queries] = V^T (A tiles; transposed once per sequence and KV head) x the
//       probabilities as bf16 pairs (B tiles), then divided by each query's sum.
// Why: torch's CPU flash attention ran the demo model's prompts at ~100 GFLOP/s in bf16, ~30% of
// a prefill step (benchmarks/RESULTS.md, twelfth session).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_attention.h"

namespace {

using namespace vllm_lite_cpu;  // NOLINT: the helpers of cpu_amx.h and cpu_attention.h

constexpr int64_t kTile = 16;      // tile rows; query tokens per item; keys per score tile
constexpr int64_t kPairK = 32;     // keys (or dims) per bf16 tile row
constexpr int64_t kTileElements = kTile * kPairK;

struct Sequences {
  const int32_t* block_table;
  int64_t block_table_stride;
  const int32_t* query_start;
  const int32_t* query_lens;
  const int32_t* seq_lens;
  int64_t count;
};

struct Geometry {
  int64_t num_q_heads, num_kv_heads, head_dim, q_stride_token, out_stride_token, group;
  CacheLayout cache;
};

inline int64_t padded_keys(int64_t seq_len) { return (seq_len + kPairK - 1) / kPairK * kPairK; }

// One K or V row of the cache as bf16: as stored, or an int8_per_token_head row's codes times its
// fp32 scale (the 4 bytes after them), rounded once (attention/kv_quant.py's dequantize_rows).
inline void row_as_bf16(uint16_t* dst, const uint16_t* row, int64_t n) { std::memcpy(dst, row, n * sizeof(uint16_t)); }
inline void row_as_bf16(uint16_t* dst, const int8_t* row, int64_t n) {
  float scale;
  std::memcpy(&scale, row + n, sizeof scale);
  for (int64_t d = 0; d < n; ++d) dst[d] = float_to_bf16(static_cast<float>(row[d]) * scale);
}

// Per sequence and KV head, once: V^T, [head_dim][padded_keys] bf16, keys past the sequence zero
// (their probabilities are zero, and zero times a stale value must stay zero); and for an int8
// cache the K rows as bf16, [padded_keys][head_dim] (`keys`; nullptr for a bf16 cache, whose
// rows the tiles read in place).
template <typename T>
void stage_rows(uint16_t* vt, uint16_t* keys, const T* cache, const Sequences& seqs, int64_t s, int64_t kv_head,
                const Geometry& g) {
  const int64_t seq_len = seqs.seq_lens[s], stride = padded_keys(seq_len);
  const int32_t* blocks = seqs.block_table + s * seqs.block_table_stride;
  const CacheLayout& c = g.cache;
  std::vector<uint16_t> row(g.head_dim);
  for (int64_t k = 0; k < seq_len; ++k) {
    const T* base = cache + blocks[k / c.block_size] * c.stride_block + (k % c.block_size) * c.stride_offset +
                    kv_head * c.stride_head;
    row_as_bf16(row.data(), base + c.stride_kv, g.head_dim);
    for (int64_t d = 0; d < g.head_dim; ++d) vt[d * stride + k] = row[d];
    if (keys != nullptr) row_as_bf16(keys + k * g.head_dim, base, g.head_dim);
  }
  for (int64_t d = 0; d < g.head_dim; ++d) std::fill(vt + d * stride + seq_len, vt + (d + 1) * stride, 0);
  if (keys != nullptr) std::fill(keys + seq_len * g.head_dim, keys + stride * g.head_dim, 0);
}

// One thread's work space, sized for the longest sequence.
struct Scratch {
  std::vector<float> scores;      // [padded keys][16 queries]
  std::vector<uint16_t> probs;    // [padded keys / 2][16 queries][2]
  std::vector<uint16_t> queries;  // [head_dim / 32][16 dim pairs][16 queries][2]
  std::vector<float> out_t;       // [head_dim][16 queries]
};

// The 16-query tile's scores against keys [0, num_keys) (K rows at `cache` laid out as `c`), times `scale`, masked causally (key k is
// seen by the query at position p when k <= p) into s.scores, as exp(score - max); returns each
// query's 1 / sum. Lanes past the tile's queries repeat its first position (finite, dropped later).
VLLM_LITE_AMX_BF16_TARGET vfloat score_and_softmax(Scratch& s, const uint16_t* query, const uint16_t* cache,
                                              const int32_t* blocks, const CacheLayout& c, int64_t num_queries,
                                              int64_t first_pos, int64_t num_keys, const Geometry& g, int64_t kv_head,
                                              float scale) {
  const int64_t chunks = g.head_dim / kPairK;
  // Query q's dims (2r, 2r + 1) are one 32-bit pair, bound for pair row r, column q.
  const __m512i pair_rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(kTile));
  if (num_queries < kTile) std::memset(s.queries.data(), 0, s.queries.size() * sizeof(uint16_t));
  for (int64_t q = 0; q < num_queries; ++q)
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_i32scatter_epi32(s.queries.data() + c * kTileElements + q * 2, pair_rows,
                              _mm512_loadu_si512(query + q * g.q_stride_token + c * kPairK), 4);
  _tile_loadd(2, s.queries.data(), 64);
  _tile_loadd(3, s.queries.data() + kTileElements, 64);
  if (chunks == 4) {
    _tile_loadd(4, s.queries.data() + 2 * kTileElements, 64);
    _tile_loadd(5, s.queries.data() + 3 * kTileElements, 64);
  }
  const int64_t row_bytes = c.stride_offset * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t k0 = 0; k0 < num_keys; k0 += kTile) {
    const uint16_t* rows = cache + blocks[k0 / c.block_size] * c.stride_block + (k0 % c.block_size) * c.stride_offset +
                           kv_head * c.stride_head;
    _tile_zero(0);
    _tile_loadd(1, rows, row_bytes);
    _tile_dpbf16ps(0, 1, 2);
    _tile_loadd(1, rows + kPairK, row_bytes);
    _tile_dpbf16ps(0, 1, 3);
    if (chunks == 4) {
      _tile_loadd(1, rows + 2 * kPairK, row_bytes);
      _tile_dpbf16ps(0, 1, 4);
      _tile_loadd(1, rows + 3 * kPairK, row_bytes);
      _tile_dpbf16ps(0, 1, 5);
    }
    _tile_stored(0, s.scores.data() + k0 * kTile, 64);
  }
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i last_query = _mm512_set1_epi32(static_cast<int32_t>(num_queries - 1));
  const __m512i positions = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first_pos)),
                                             _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(lane, last_query), lane,
                                                                     _mm512_setzero_si512()));
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 max = minus_inf;
  float* scores = s.scores.data();
  for (int64_t k = 0; k < num_keys; ++k) {
    const __mmask16 visible = _mm512_cmpge_epi32_mask(positions, _mm512_set1_epi32(static_cast<int32_t>(k)));
    const __m512 v = _mm512_mask_blend_ps(visible, minus_inf, _mm512_mul_ps(_mm512_loadu_ps(scores + k * kTile), _mm512_set1_ps(scale)));
    _mm512_storeu_ps(scores + k * kTile, v);
    max = _mm512_max_ps(max, v);
  }
  vfloat vmax, sum = {};
  std::memcpy(&vmax, &max, sizeof vmax);
  for (int64_t k = 0; k < num_keys; ++k) {
    const vfloat e = exp_nonpositive(load(scores + k * kTile) - vmax);
    store(scores + k * kTile, e);
    sum += e;
  }
  std::fill(scores + num_keys * kTile, scores + padded_keys(num_keys) * kTile, 0.f);
  return 1.f / sum;
}

// The probabilities as B tiles: pairs of consecutive keys interleaved per query, bf16.
VLLM_LITE_AMX_BF16_TARGET void pair_probabilities(Scratch& s, int64_t num_keys) {
  static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_loadu_si512(kInterleave);
  for (int64_t k = 0; k < padded_keys(num_keys); k += 2) {
    const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s.scores.data() + (k + 1) * kTile),
                                              _mm512_loadu_ps(s.scores.data() + k * kTile));
    _mm512_storeu_si512(s.probs.data() + k * kTile, _mm512_permutexvar_epi16(interleave, (__m512i)both));
  }
}

// out^T [64 dims starting at `dim`][16 queries] += V^T rows x probabilities, over all padded keys.
VLLM_LITE_AMX_BF16_TARGET void weighted_values(Scratch& s, const uint16_t* vt, int64_t vt_stride, int64_t num_keys, int64_t dim) {
  const int64_t stride_bytes = vt_stride * static_cast<int64_t>(sizeof(uint16_t));
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const uint16_t* rows = vt + dim * vt_stride;
  for (int64_t k = 0; k < padded_keys(num_keys); k += kPairK) {
    _tile_loadd(0, s.probs.data() + k * kTile, 64);
    _tile_loadd(1, rows + k, stride_bytes);
    _tile_dpbf16ps(4, 1, 0);
    _tile_loadd(1, rows + kTile * vt_stride + k, stride_bytes);
    _tile_dpbf16ps(5, 1, 0);
    _tile_loadd(1, rows + 2 * kTile * vt_stride + k, stride_bytes);
    _tile_dpbf16ps(6, 1, 0);
    _tile_loadd(1, rows + 3 * kTile * vt_stride + k, stride_bytes);
    _tile_dpbf16ps(7, 1, 0);
  }
  float* out_t = s.out_t.data() + dim * kTile;
  _tile_stored(4, out_t, 64);
  _tile_stored(5, out_t + kTile * kTile, 64);
  _tile_stored(6, out_t + 2 * kTile * kTile, 64);
  _tile_stored(7, out_t + 3 * kTile * kTile, 64);
}

struct Item {
  int64_t seq, q_head, first_query;
};

// The K rows the score tiles read: the bf16 cache in place, or one sequence's staged rows.
struct KeyRows {
  const uint16_t* data;
  const int32_t* blocks;
  CacheLayout layout;
};

VLLM_LITE_AMX_BF16_TARGET void attend_item(Scratch& s, uint16_t* out, const uint16_t* query, const KeyRows& keys,
                                      const uint16_t* vt, const Sequences& seqs, const Item& item, const Geometry& g,
                                      float scale) {
  const int64_t q_len = seqs.query_lens[item.seq], seq_len = seqs.seq_lens[item.seq];
  const int64_t num_queries = std::min(kTile, q_len - item.first_query);
  const int64_t first_pos = seq_len - q_len + item.first_query;
  const int64_t num_keys = first_pos + num_queries;
  const int64_t kv_head = item.q_head / g.group;
  const int64_t token = seqs.query_start[item.seq] + item.first_query;
  const vfloat inv_sum = score_and_softmax(s, query + token * g.q_stride_token + item.q_head * g.head_dim, keys.data,
                                           keys.blocks, keys.layout, num_queries, first_pos, num_keys, g, kv_head, scale);
  pair_probabilities(s, num_keys);
  for (int64_t dim = 0; dim < g.head_dim; dim += 4 * kTile) weighted_values(s, vt, padded_keys(seq_len), num_keys, dim);
  // out^T's column q, divided by the query's sum: 16 dims per gather.
  const __m512i dim_rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(kTile));
  for (int64_t q = 0; q < num_queries; ++q) {
    uint16_t* row = out + (token + q) * g.out_stride_token + item.q_head * g.head_dim;
    const __m512 inv = _mm512_set1_ps(inv_sum[q]);
    for (int64_t d = 0; d < g.head_dim; d += kTile) {
      const __m512 v = _mm512_mul_ps(_mm512_i32gather_ps(dim_rows, s.out_t.data() + d * kTile + q, 4), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + d), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

void check_int32(const at::Tensor& t, int64_t size, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous() && t.dim() == 1 && t.size(0) == size,
              "paged_attention_prefill: ", name, " must be contiguous int32 [num_seqs]");
}

void paged_attention_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_table, const at::Tensor& query_start,
                             const at::Tensor& query_lens, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(cpu_has_amx(AmxKind::kBf16), "paged_attention_prefill needs a CPU with AMX-BF16");
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.stride(4) == 1,
              "kv_cache must be a CPU tensor [num_blocks, 2, block_size, num_kv_heads, head_dim]");
  const bool int8_cache = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK((kv_cache.scalar_type() == at::kBFloat16 || int8_cache) && query.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "paged_attention_prefill takes bfloat16 query and out, and a bfloat16 or int8_per_token_head kv_cache");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [num_tokens, num_q_heads, head_dim] with contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), "out must be contiguous and shaped like query");
  const int64_t head_dim = query.size(2), num_q_heads = query.size(1), num_kv_heads = kv_cache.size(3);
  const CacheLayout layout = cache_layout(kv_cache);
  TORCH_CHECK((head_dim == 64 || head_dim == 128) && kv_cache.size(4) == head_dim + (int8_cache ? 4 : 0) &&
                  layout.block_size % kTile == 0,
              "paged_attention_prefill takes head_dim 64 or 128 (the cache's too) and a block_size that is a multiple of 16");
  TORCH_CHECK(num_q_heads % num_kv_heads == 0, "num_q_heads must be a multiple of the cache's num_kv_heads");
  const int64_t num_seqs = seq_lens.size(0);
  check_decode_tables(block_table, seq_lens, num_seqs, layout.block_size);  // cpu_attention.h: the same tables
  check_int32(query_start, num_seqs, "query_start");
  check_int32(query_lens, num_seqs, "query_lens");
  const Sequences seqs{block_table.data_ptr<int32_t>(), block_table.stride(0), query_start.data_ptr<int32_t>(),
                       query_lens.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), num_seqs};
  int64_t max_keys = 0, vt_total = 0;
  std::vector<int64_t> vt_offset(num_seqs);
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = seqs.query_lens[s], seq_len = seqs.seq_lens[s], start = seqs.query_start[s];
    TORCH_CHECK(q_len >= 1 && q_len <= seq_len && start >= 0 && start + q_len <= query.size(0), "sequence ", s,
                ": query_start ", start, " / query_lens ", q_len, " / seq_lens ", seq_len, " do not fit the query");
    vt_offset[s] = vt_total;
    vt_total += num_kv_heads * head_dim * padded_keys(seq_len);
    max_keys = std::max(max_keys, padded_keys(seq_len));
    for (int64_t first = (q_len - 1) / kTile * kTile; first >= 0; first -= kTile)  // longest first
      for (int64_t h = 0; h < num_q_heads; ++h) items.push_back({s, h, first});
  }
  const Geometry g{num_q_heads, num_kv_heads, head_dim, query.stride(0), out.stride(0), num_q_heads / num_kv_heads, layout};
  std::vector<uint16_t> vt(vt_total), staged_keys(int8_cache ? vt_total : 0);
  // An int8 cache's K rows are staged as bf16, [padded keys][head_dim] per sequence and KV head.
  const CacheLayout staged_layout{std::numeric_limits<int32_t>::max(), 0, 0, head_dim, 0};
  const int32_t first_block = 0;
  const uint16_t* q = static_cast<const uint16_t*>(query.data_ptr());
  uint16_t* o = static_cast<uint16_t*>(out.data_ptr());
  const int64_t num_items = static_cast<int64_t>(items.size()), transposes = num_seqs * num_kv_heads;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    Scratch s{std::vector<float>(max_keys * kTile), std::vector<uint16_t>(max_keys * kTile),
              std::vector<uint16_t>(head_dim / kPairK * kTileElements), std::vector<float>(head_dim * kTile)};
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < transposes; ++i) {
      const int64_t seq = i / num_kv_heads, kv_head = i % num_kv_heads;
      const int64_t offset = vt_offset[seq] + kv_head * head_dim * padded_keys(seqs.seq_lens[seq]);
      if (int8_cache)
        stage_rows(vt.data() + offset, staged_keys.data() + offset, kv_cache.data_ptr<int8_t>(), seqs, seq, kv_head, g);
      else
        stage_rows(vt.data() + offset, nullptr, static_cast<const uint16_t*>(kv_cache.data_ptr()), seqs, seq, kv_head, g);
    }
    load_tile_config(8);  // per thread: the tile configuration is thread state
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const Item& item = items[i];
      const int64_t offset = vt_offset[item.seq] + item.q_head / g.group * head_dim * padded_keys(seqs.seq_lens[item.seq]);
      const KeyRows keys = int8_cache
          ? KeyRows{staged_keys.data() + offset, &first_block, staged_layout}
          : KeyRows{static_cast<const uint16_t*>(kv_cache.data_ptr()), seqs.block_table + item.seq * seqs.block_table_stride, layout};
      attend_item(s, o, q, keys, vt.data() + offset, seqs, item, g, static_cast<float>(scale));
    }
    release_tiles();
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_lite_C, m) {
  m.def(
      "paged_attention_prefill(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor query_start, "
      "Tensor query_lens, Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) { m.impl("paged_attention_prefill", &paged_attention_prefill); }
