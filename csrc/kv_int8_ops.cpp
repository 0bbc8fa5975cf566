// The int8_per_token_head KV cache (vLLM's name and rule) on CPU:
//
//   reshape_and_cache_int8(key, value, kv_cache, slot_mapping)
//       quantize each (token, KV head) row of the new keys/values (float32 or bfloat16) into the
//       int8 cache [num_blocks, 2, block_size, num_kv_heads, head_dim + 4]: head_dim codes, then
//       the row's fp32 scale in 4 bytes. scale = max(max|x| / 127, 1e-6), code = x * (1 / scale)
//       rounded half away from zero, clamped to [-128, 127]: the arithmetic of
//       vllm_lite/attention/kv_quant.py, so the bytes equal the torch reference's.
//   paged_attention_decode_int8(out, query, kv_cache, block_table, seq_lens, scale)
//       one float32 query token per sequence over its cached rows; each query head is rounded to
//       int8 by the rows' rule, scores are exact integer dot products of the codes (AMX-INT8
//       tiles where the CPU has them, else vpdpbusd) times both scales; V codes are widened to
//       fp32 in registers with the row scales of V folded into the softmax weights; fp32 softmax
//       and sums. Half the bytes of a bf16 cache per token.
//
// The work split is the bf16 kernel's: whole sequences per item when there are enough of them,
// else (sequence, KV head) pairs. The tiled kernels (head_dim 32/64/128) are AVX-512 code where the
// CPU has AVX-512 with VNNI, AVX2 code (int16 products by vpmaddwd) where it has AVX2; the write
// is vectorized the same two ways (intrinsics: GCC's generic vector conversions widen int8 one lane
// at a time). Elsewhere each row is widened into an fp32 buffer (dot / axpy) and the write is scalar.
// VLLM_LITE_CPU_CAPABILITY (cpu_multiversion.h) caps which of them run.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_attention.h"
#include "cpu_multiversion.h"
#include "cpu_vec.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define VLLM_LITE_I8_AVX512 1
#else
#define VLLM_LITE_I8_AVX512 0
#endif

namespace {

using namespace vllm_lite_cpu;  // NOLINT: the helpers of cpu_vec.h and cpu_attention.h

constexpr int64_t kScaleBytes = 4;
constexpr float kMinScale = 1e-6f;

VLLM_LITE_INLINE float row_scale(const int8_t* row, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, row + head_dim, sizeof scale);
  return scale;
}

// ---- quantization (the cache write) ----

// Rows are float or bf16 bits (uint16_t): cpu_vec.h's to_float / load_any read either.
// No fused multiply-add here: x * (1 / scale) is rounded before the +-0.5, as in torch.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void quantize_row(int8_t* dst, const T* src, int64_t head_dim) {
  float max_abs = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) max_abs = std::max(max_abs, std::fabs(to_float(src[d])));
  const float scale = std::max(max_abs / 127.f, kMinScale);
  const float inv = 1.f / scale;
  for (int64_t d = 0; d < head_dim; ++d) {
    const float scaled = to_float(src[d]) * inv;
    const float rounded = scaled >= 0.f ? scaled + 0.5f : scaled - 0.5f;
    dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, rounded)));  // truncates
  }
  std::memcpy(dst + head_dim, &scale, sizeof scale);
}

#if defined(__x86_64__) && defined(__GNUC__)
// quantize_row for head_dim a multiple of 8 on AVX2, 8 lanes at a time: the same operations in the
// same order (fp-contract is off in this region, so nothing fuses the product with the +-0.5).
template <typename T>
VLLM_LITE_TARGET_AVX2 void quantize_row_avx2(int8_t* dst, const T* src, int64_t head_dim) {
  typedef VecF<8> V;
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  __m256 max_abs = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8)
    max_abs = _mm256_max_ps(max_abs, _mm256_andnot_ps(sign_bit, (__m256)load_any<V>(src + d)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, max_abs);
  const float scale = std::max(*std::max_element(lanes, lanes + 8) / 127.f, kMinScale);
  const __m256 inv = _mm256_set1_ps(1.f / scale);
  const __m256 half = _mm256_set1_ps(0.5f), lowest = _mm256_set1_ps(-128.f), highest = _mm256_set1_ps(127.f);
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m256 scaled = _mm256_mul_ps((__m256)load_any<V>(src + d), inv);
    const __m256 negative = _mm256_cmp_ps(scaled, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 rounded = _mm256_blendv_ps(_mm256_add_ps(scaled, half), _mm256_sub_ps(scaled, half), negative);
    const __m256i codes = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(rounded, lowest), highest));
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + d), _mm_packs_epi16(words, words));
  }
  std::memcpy(dst + head_dim, &scale, sizeof scale);
}
#endif
#pragma GCC pop_options

#if VLLM_LITE_I8_AVX512
// quantize_row for head_dim a multiple of 16, 16 lanes at a time: the same operations in the same
// order (the product is rounded by its own instruction, which nothing fuses with the +-0.5).
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void quantize_row_avx512(int8_t* dst, const T* src,
                                                                                     int64_t head_dim) {
  __m512 max_abs = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += kLanes) max_abs = _mm512_max_ps(max_abs, _mm512_abs_ps((__m512)load_any(src + d)));
  const float scale = std::max(_mm512_reduce_max_ps(max_abs) / 127.f, kMinScale);
  const __m512 inv = _mm512_set1_ps(1.f / scale);
  const __m512 half = _mm512_set1_ps(0.5f), lowest = _mm512_set1_ps(-128.f), highest = _mm512_set1_ps(127.f);
  for (int64_t d = 0; d < head_dim; d += kLanes) {
    const __m512 scaled = _mm512_mul_round_ps((__m512)load_any(src + d), inv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 negative = _mm512_cmp_ps_mask(scaled, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 rounded = _mm512_mask_sub_ps(_mm512_add_ps(scaled, half), negative, scaled, half);
    const __m512 clamped = _mm512_min_ps(_mm512_max_ps(rounded, lowest), highest);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(clamped)));
  }
  std::memcpy(dst + head_dim, &scale, sizeof scale);
}
#endif

template <typename T>
void quantize_any_row(int8_t* dst, const T* src, int64_t head_dim, bool avx512) {
#if VLLM_LITE_I8_AVX512
  if (avx512 && head_dim % kLanes == 0) return quantize_row_avx512(dst, src, head_dim);
  if (!avx512 && isa_lanes() >= 8 && head_dim % 8 == 0) return quantize_row_avx2(dst, src, head_dim);
#endif
  quantize_row(dst, src, head_dim);
}

template <typename T>
void write_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const int64_t* slots,
                int64_t num_tokens) {
  const int64_t num_heads = key.size(1), head_dim = key.size(2);
  int8_t* cache = kv_cache.data_ptr<int8_t>();
  const T* k = static_cast<const T*>(key.data_ptr());
  const T* v = static_cast<const T*>(value.data_ptr());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);
  const CacheLayout layout = cache_layout(kv_cache);
  const bool avx512 = cpu_has_avx512_vnni();
  const int threads = num_tokens * num_heads * head_dim >= (1 << 16) ? at::get_num_threads() : 1;
  for_each_cache_row(slots, num_tokens, num_heads, layout, threads,
                     [&](int64_t t, int64_t h, int64_t k_row, int64_t v_row) {
                       quantize_any_row(cache + k_row, k + t * ks0 + h * ks1, head_dim, avx512);
                       quantize_any_row(cache + v_row, v + t * vs0 + h * vs1, head_dim, avx512);
                     });
}

void check_int8_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.scalar_type() == at::kChar,
              "kv_cache must be an int8 CPU tensor");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.size(4) > kScaleBytes,
              "kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim + 4]");
  TORCH_CHECK(kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4),
              "kv_cache needs contiguous (token, head) rows");
}

void reshape_and_cache_int8(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                            const at::Tensor& slot_mapping) {
  check_int8_cache(kv_cache);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value must be [T, H, D]");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() &&
                  (key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16),
              "key/value must both be float32 or bfloat16");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) + kScaleBytes == kv_cache.size(4),
              "key/value heads and head_dim must match kv_cache");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value need a contiguous last dimension");
  const int64_t* slots = check_slots(slot_mapping, key, kv_cache);
  const int64_t num_tokens = slot_mapping.size(0);
  if (key.scalar_type() == at::kFloat)
    write_rows<float>(key, value, kv_cache, slots, num_tokens);
  else
    write_rows<uint16_t>(key, value, kv_cache, slots, num_tokens);
}

// ---- the decode query: each head rounded to its int8 quantization by the cache rows' rule ----

// values = code * scale (what every path attends with), codes = code + 128 (the unsigned operand of
// vpdpbusd), scales per head; heads one after another. tiles: for the AMX score pass, each KV head's
// group of query heads as B tiles of tdpbssd (per 64 dims, [16 dim quads][16 heads x 4 codes]: the
// signed codes, heads past the group 0); null elsewhere.
constexpr int64_t kQueryTileBytes = 16 * 64;

struct QueryRows {
  const float* values;
  const uint8_t* codes;
  const float* scales;
  const int8_t* tiles;
  const int16_t* wide;  // the codes as int16 (the AVX2 score pass's operand); null elsewhere
};

struct QueryBuffers {
  std::vector<float> values, scales;
  std::vector<uint8_t> codes;
  std::vector<int8_t> row, tiles;
  std::vector<int16_t> wide;
};

void fill_query_tiles(QueryBuffers& buf, int64_t num_heads, int64_t group, int64_t head_dim) {
  const int64_t chunks = head_dim / 64;
  buf.tiles.assign(num_heads / group * chunks * kQueryTileBytes, 0);
  for (int64_t h = 0; h < num_heads; ++h) {
    int8_t* kv_tiles = buf.tiles.data() + h / group * chunks * kQueryTileBytes;
    for (int64_t d = 0; d < head_dim; ++d)
      kv_tiles[d / 64 * kQueryTileBytes + (d % 64 / 4) * 64 + h % group * 4 + d % 4] =
          static_cast<int8_t>(buf.codes[h * head_dim + d] - 128);
  }
}

QueryRows quantize_queries(QueryBuffers& buf, const float* query, int64_t q_stride_h, int64_t num_heads,
                           int64_t group, int64_t head_dim, bool amx, bool wide) {
  buf.values.resize(num_heads * head_dim);
  buf.codes.resize(num_heads * head_dim);
  buf.scales.resize(num_heads);
  buf.row.resize(head_dim + kScaleBytes);
  buf.wide.resize(wide ? num_heads * head_dim : 0);
  for (int64_t h = 0; h < num_heads; ++h) {
    quantize_any_row(buf.row.data(), query + h * q_stride_h, head_dim, cpu_has_avx512_vnni());
    const float scale = row_scale(buf.row.data(), head_dim);
    buf.scales[h] = scale;
    for (int64_t d = 0; d < head_dim; ++d) {
      buf.values[h * head_dim + d] = buf.row[d] * scale;
      buf.codes[h * head_dim + d] = static_cast<uint8_t>(buf.row[d] + 128);
      if (wide) buf.wide[h * head_dim + d] = buf.row[d];
    }
  }
  if (amx) fill_query_tiles(buf, num_heads, group, head_dim);
  return {buf.values.data(), buf.codes.data(), buf.scales.data(), amx ? buf.tiles.data() : nullptr,
          wide ? buf.wide.data() : nullptr};
}

// ---- decode attention over the int8 cache: AVX-512 tiles for head_dim 32, 64 and 128 ----

#if VLLM_LITE_I8_AVX512
// amx-tile/amx-int8 let the score pass use AMX tiles; they run only where cpu_has_amx(kInt8) says so.
#define VLLM_LITE_AVX512_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")))
#define VLLM_LITE_AVX512_INLINE VLLM_LITE_INLINE VLLM_LITE_AVX512_TARGET

// 16 int8 codes widened to fp32 lanes (vpmovsxbd + vcvtdq2ps).
VLLM_LITE_AVX512_INLINE vfloat load_i8(const int8_t* p) {
  return (vfloat)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}


// acc[g] += sum_i weights[g][i] * V codes of row i, for G heads and up to 16 rows (each row
// widened once for all G heads); weights[g] holds 16 entries, the rows' V scales folded in.
template <int C, int G>
VLLM_LITE_AVX512_INLINE void weighted_sum_tile_i8(float* acc, const float (*weights)[kLanes], const int8_t* rows,
                                                  int64_t row_stride, int64_t n) {
  vfloat sum[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) sum[g][c] = load(acc + (g * C + c) * kLanes);
  for (int64_t i = 0; i < n; ++i) {
    vfloat v[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) v[c] = load_i8(rows + i * row_stride + c * kLanes);
    for (int g = 0; g < G; ++g) {
      const float w = weights[g][i];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) sum[g][c] += w * v[c];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store(acc + (g * C + c) * kLanes, sum[g][c]);
}

// At most 3 heads per V pass over a tile: 3 heads x 8 accumulators (head_dim 128) + 8 widened
// rows still fit the 32 AVX-512 registers.
constexpr int64_t kMaxHeadsPerPass = 3;

// The scales of up to 16 rows (lanes past n are 0), gathered from the 4 bytes after each row's codes.
VLLM_LITE_AVX512_INLINE vfloat tile_scales(const int8_t* rows, int64_t row_stride, int64_t n, int64_t head_dim) {
  const __m512i offsets = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                              _mm512_set1_epi32(static_cast<int>(row_stride))),
                                           _mm512_set1_epi32(static_cast<int>(head_dim)));
  return (vfloat)_mm512_mask_i32gather_ps(_mm512_setzero_ps(), static_cast<__mmask16>((1u << n) - 1), offsets, rows, 1);
}

// The group's heads' V sums over up to 16 rows of their KV head: the softmax numerators
// (`weights`, head g's at weights + g * weight_stride) times the rows' V scales, then the sums.
template <int C>
VLLM_LITE_AVX512_INLINE void weighted_sum_heads_i8(float* acc, const float* weights, int64_t weight_stride,
                                                   const int8_t* rows, int64_t row_stride, int64_t n, int64_t num_heads) {
  const vfloat scales = tile_scales(rows, row_stride, n, C * kLanes);
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  alignas(64) float scaled[kMaxHeadsPerPass][kLanes];
  for (int64_t h = 0; h < num_heads; h += kMaxHeadsPerPass) {
    const int64_t heads = std::min(kMaxHeadsPerPass, num_heads - h);
    for (int64_t g = 0; g < heads; ++g)
      store(scaled[g], (vfloat)_mm512_maskz_loadu_ps(valid, weights + (h + g) * weight_stride) * scales);
    float* a = acc + h * C * kLanes;
    switch (heads) {
      case 1: weighted_sum_tile_i8<C, 1>(a, scaled, rows, row_stride, n); break;
      case 2: weighted_sum_tile_i8<C, 2>(a, scaled, rows, row_stride, n); break;
      default: weighted_sum_tile_i8<C, 3>(a, scaled, rows, row_stride, n); break;
    }
  }
}

// ---- scores with VNNI (vpdpbusd): the quantized query's codes (plus 128,
// as the unsigned operand) times the K codes, exact int32 sums; 128 * sum(K codes) comes off
// before the scales are applied. Equal to the fp32 path over the same (dequantized) query up to
// the fp32 rounding of the final products. ----


// Chunk v (64 bytes) of a row of C * 16 codes; a shorter last chunk (head_dim 32) reads zeros past the row.
template <int C>
VLLM_LITE_AVX512_INLINE __m512i load_codes(const void* row, int v) {
  constexpr int64_t bytes = C * kLanes;
  const char* p = static_cast<const char*>(row) + 64 * v;
  if (bytes - 64 * v >= 64) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi8((__mmask64{1} << (bytes - 64 * v)) - 1, p);
}

// The group's query heads (q_u8: codes + 128, head after head; q_scale per head) against up to 16
// K rows of their KV head; logits of head g at logits + g * logit_stride; `row_scales`: each row's
// scale times the softmax scale, 0 past n.
template <int C>
VLLM_LITE_AVX512_INLINE void score_tile_vnni(float* logits, int64_t logit_stride, const uint8_t* q_u8,
                                             const float* q_scale, int64_t group, const int8_t* rows,
                                             int64_t row_stride, int64_t n, vfloat row_scales) {
  constexpr int64_t head_dim = C * kLanes;
  constexpr int V = (C + 3) / 4;  // 64-byte chunks per row
  const __m512i ones = _mm512_set1_epi8(1);
  vi32 offset[kLanes];  // 128 * sum of each row's codes
  for (int64_t j = 0; j < kLanes; ++j) {
    __m512i sum = _mm512_setzero_si512();
    if (j < n)
      for (int v = 0; v < V; ++v) sum = _mm512_dpbusd_epi32(sum, ones, load_codes<C>(rows + j * row_stride, v));
    offset[j] = (vi32)_mm512_slli_epi32(sum, 7);
  }
  for (int64_t g = 0; g < group; ++g) {
    __m512i q[V];
    for (int v = 0; v < V; ++v) q[v] = load_codes<C>(q_u8 + g * head_dim, v);
    vi32 acc[kLanes];
#pragma GCC unroll 16
    for (int64_t j = 0; j < kLanes; ++j) {
      __m512i sum = _mm512_setzero_si512();
      if (j < n)
        for (int v = 0; v < V; ++v) sum = _mm512_dpbusd_epi32(sum, q[v], load_codes<C>(rows + j * row_stride, v));
      acc[j] = (vi32)sum - offset[j];
    }
    const vfloat scores = __builtin_convertvector(transpose_sums(acc), vfloat) * row_scales * q_scale[g];
    _mm512_mask_storeu_ps(logits + g * logit_stride, static_cast<__mmask16>((1u << n) - 1), (__m512)scores);
  }
}

// ---- scores on AMX tiles (CPUs with AMX-INT8; head_dim 64 or 128, block_size a multiple of 16, at
// most 16 query heads per KV head). Per 16-row tile of one KV head's K rows and 64 dims: A = the
// K codes as they lie in the cache (16 rows x 64 bytes, the cache's row stride), B = the group's
// query codes transposed into groups of 4 ([16 dim quads][16 heads x 4]); C += A x B (tdpbssd)
// gives the exact int32 dot products of the tile's tokens (rows) by heads (columns), the same
// integers as the VNNI path. Rows past the sequence's end hold other data of the same block;
// their scores are dropped. Tile registers: 0 the sums, 1 a K chunk, 2.. the query chunks. ----

template <int C>
VLLM_LITE_AVX512_INLINE void score_tile_amx_i8(float* logits, int64_t logit_stride, const int8_t* query_tiles,
                                               const float* q_scale, int64_t group, const int8_t* rows,
                                               int64_t row_stride, int64_t n, vfloat row_scales) {
  alignas(64) int32_t sums[kLanes * kLanes];  // [token][head]
  _tile_zero(0);
  _tile_loadd(1, rows, row_stride);
  _tile_loadd(2, query_tiles, 64);
  _tile_dpbssd(0, 1, 2);
  if constexpr (C == 8) {
    _tile_loadd(1, rows + 64, row_stride);
    _tile_loadd(2, query_tiles + kQueryTileBytes, 64);
    _tile_dpbssd(0, 1, 2);
  }
  _tile_stored(0, sums, 64);
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t g = 0; g < group; ++g) {
    const vfloat products = (vfloat)_mm512_cvtepi32_ps(_mm512_i32gather_epi32(column, sums + g, 4));
    _mm512_mask_storeu_ps(logits + g * logit_stride, valid, (__m512)(products * row_scales * q_scale[g]));
  }
}
// One sequence, KV heads [kv_begin, kv_end) and their query heads, head_dim = C * 16: the scores
// for the whole context, the softmax, then the weighted sum of V. Both passes take a block's rows
// for all the item's KV heads before the next block (one contiguous stretch of the cache).
template <int C>
VLLM_LITE_AVX512_INLINE void decode_one_i8_tiled(float* out, const QueryRows& query, const int8_t* cache,
                                                 const int32_t* blocks, int64_t seq_len, int64_t kv_begin,
                                                 int64_t kv_end, int64_t group, const CacheLayout& c, float scale,
                                                 std::vector<float>& scratch) {
  constexpr int64_t head_dim = C * kLanes;
  const int64_t num_kv = kv_end - kv_begin, num_heads = num_kv * group;
  const ItemScratch space = item_scratch(scratch, num_heads, seq_len, head_dim);
  float *logits = space.logits, *acc = space.acc, *inv_sum = space.inv_sum;
  const int64_t num_blocks = (seq_len + c.block_size - 1) / c.block_size;
  auto block_rows = [&](int64_t b, int64_t which) {
    return cache + blocks[b] * c.stride_block + which * c.stride_kv + kv_begin * c.stride_head;
  };
  const int64_t block_bytes = item_block_bytes(c, num_kv, sizeof(int8_t));
  // fn(kv, tile, m, position of its first row) for every tile of up to 16 rows of K (which 0) or
  // V (1), block by block, the item's KV heads of a block before the next block (one contiguous
  // stretch of the cache), asking for the blocks ahead.
  auto for_each_tile = [&](int64_t which, auto&& fn) VLLM_LITE_AVX512_TARGET {
    auto prefetch_block = [&](int64_t b) {
      if (b < num_blocks) prefetch_l2(block_rows(b, which), block_bytes);
    };
    for (int64_t b = 0; b < kPrefetchBlocks; ++b) prefetch_block(b);
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t start = b * c.block_size, n = std::min(c.block_size, seq_len - start);
      prefetch_block(b + kPrefetchBlocks);
      for (int64_t kv = 0; kv < num_kv; ++kv) {
        const int8_t* rows = block_rows(b, which) + kv * c.stride_head;
        for (int64_t t = 0; t < n; t += kLanes) fn(kv, rows + t * c.stride_offset, std::min(kLanes, n - t), start + t);
      }
    }
  };
  for_each_tile(0, [&](int64_t kv, const int8_t* tile, int64_t m, int64_t position) VLLM_LITE_AVX512_TARGET {
    float* tile_logits = logits + kv * group * seq_len + position;
    const vfloat row_scales = tile_scales(tile, c.stride_offset, m, head_dim) * scale;
    if (query.tiles != nullptr)
      score_tile_amx_i8<C>(tile_logits, seq_len, query.tiles + kv * (head_dim / 64) * kQueryTileBytes,
                           query.scales + kv * group, group, tile, c.stride_offset, m, row_scales);
    else
      score_tile_vnni<C>(tile_logits, seq_len, query.codes + kv * group * head_dim, query.scales + kv * group, group,
                         tile, c.stride_offset, m, row_scales);
  });
  for (int64_t h = 0; h < num_heads; ++h) inv_sum[h] = 1.f / softmax_numerators(logits + h * seq_len, seq_len);
  std::fill(acc, acc + num_heads * head_dim, 0.f);
  for_each_tile(1, [&](int64_t kv, const int8_t* tile, int64_t m, int64_t position) VLLM_LITE_AVX512_TARGET {
    weighted_sum_heads_i8<C>(acc + kv * group * head_dim, logits + kv * group * seq_len + position, seq_len, tile,
                             c.stride_offset, m, group);
  });
  for (int64_t h = 0; h < num_heads; ++h)
    for (int k = 0; k < C; ++k)
      store(out + h * head_dim + k * kLanes, load(acc + h * head_dim + k * kLanes) * inv_sum[h]);
}

#define VLLM_LITE_DECODE_I8(C)                                                                          \
  VLLM_LITE_AVX512_TARGET                                                                               \
  void decode_one_i8_##C(float* out, const QueryRows& query, const int8_t* cache, const int32_t* blocks, \
                         int64_t seq_len, int64_t kv_begin, int64_t kv_end, int64_t group,              \
                         const CacheLayout& c, float scale, std::vector<float>& scratch) {              \
    decode_one_i8_tiled<C>(out, query, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale,        \
                           scratch);                                                                    \
  }
VLLM_LITE_DECODE_I8(2)
VLLM_LITE_DECODE_I8(4)
VLLM_LITE_DECODE_I8(8)
#undef VLLM_LITE_DECODE_I8

#endif  // VLLM_LITE_I8_AVX512

// ---- decode attention over the int8 cache on AVX2 (no VNNI): head_dim 32, 64 and 128, tiles of 8
// rows. Scores: each K row's codes widened to int16 and multiplied into the query head's int16
// codes by vpmaddwd (exact int32 sums, the same integers as vpdpbusd and AMX), times the same
// scales in the same order as the AVX-512 path. V: each row's codes widened to fp32 and added into
// the head's sums (a head at a time: 8 accumulators of 8 lanes fill the 16 AVX2 registers). ----

#if VLLM_LITE_I8_AVX512
#define VLLM_LITE_AVX2_INLINE VLLM_LITE_INLINE VLLM_LITE_TARGET_AVX2
constexpr int64_t kTile8 = 8;
typedef VecF<8> vfloat8;
typedef VecI32<8> vi32x8;

// The scales of up to 8 rows (0 past n), from the 4 bytes after each row's codes.
VLLM_LITE_AVX2_INLINE vfloat8 tile_scales8(const int8_t* rows, int64_t row_stride, int64_t n, int64_t head_dim) {
  alignas(32) float scales[kTile8] = {};
  for (int64_t j = 0; j < n; ++j) scales[j] = row_scale(rows + j * row_stride, head_dim);
  return load<vfloat8>(scales);
}

// The group's query heads (int16 codes, head after head) against up to 8 K rows of their KV head.
template <int D>
VLLM_LITE_AVX2_INLINE void score_tile_avx2(float* logits, int64_t logit_stride, const int16_t* q_wide,
                                           const float* q_scale, int64_t group, const int8_t* rows,
                                           int64_t row_stride, int64_t n, vfloat8 row_scales) {
  constexpr int K = D / 16;  // 16 codes per vpmaddwd
  for (int64_t g = 0; g < group; ++g) {
    __m256i q[K];
    for (int k = 0; k < K; ++k) q[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q_wide + g * D + 16 * k));
    vi32x8 acc[kTile8];
#pragma GCC unroll 8
    for (int64_t j = 0; j < kTile8; ++j) {
      __m256i sum = _mm256_setzero_si256();
      if (j < n)
#pragma GCC unroll 8
        for (int k = 0; k < K; ++k) {
          const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + j * row_stride + 16 * k));
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_cvtepi8_epi16(codes), q[k]));
        }
      acc[j] = (vi32x8)sum;
    }
    const vfloat8 scores = __builtin_convertvector(transpose_sums(acc), vfloat8) * row_scales * q_scale[g];
    for (int64_t j = 0; j < n; ++j) logits[g * logit_stride + j] = scores[j];
  }
}

// acc[0:CC*8] += sum_i weights[i] * V codes of row i (dims [0, CC * 8) of each row), i < n.
template <int CC>
VLLM_LITE_AVX2_INLINE void weighted_sum_avx2(float* acc, const float* weights, const int8_t* rows, int64_t row_stride,
                                             int64_t n) {
  __m256 sum[CC];
  for (int c = 0; c < CC; ++c) sum[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 w = _mm256_set1_ps(weights[i]);
    const int8_t* row = rows + i * row_stride;
#pragma GCC unroll 8
    for (int c = 0; c < CC; ++c) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * c));
      sum[c] = _mm256_fmadd_ps(w, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), sum[c]);
    }
  }
  for (int c = 0; c < CC; ++c) _mm256_storeu_ps(acc + 8 * c, sum[c]);
}

template <int D>
VLLM_LITE_AVX2_INLINE void decode_one_i8_avx2(float* out, const QueryRows& query, const int8_t* cache,
                                              const int32_t* blocks, int64_t seq_len, int64_t kv_begin, int64_t kv_end,
                                              int64_t group, const CacheLayout& c, float scale,
                                              std::vector<float>& scratch) {
  constexpr int CC = D < 64 ? D / 8 : 8;  // vectors of a dim chunk in the V pass
  const int64_t num_kv = kv_end - kv_begin, num_heads = num_kv * group;
  const ItemScratch space = item_scratch(scratch, num_heads, seq_len, D);
  float *logits = space.logits, *acc = space.acc, *inv_sum = space.inv_sum;
  const int64_t num_blocks = (seq_len + c.block_size - 1) / c.block_size;
  const int64_t block_bytes = item_block_bytes(c, num_kv, sizeof(int8_t));
  auto block_rows = [&](int64_t b, int64_t which) {
    return cache + blocks[b] * c.stride_block + which * c.stride_kv + kv_begin * c.stride_head;
  };
  // fn(kv, tile, m, position of its first row) for every tile of up to 8 rows, block by block (as
  // the AVX-512 kernel walks them), asking for the blocks ahead.
  auto for_each_tile = [&](int64_t which, auto&& fn) VLLM_LITE_TARGET_AVX2 {
    for (int64_t b = 0; b < std::min(kPrefetchBlocks, num_blocks); ++b) prefetch_l2(block_rows(b, which), block_bytes);
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t start = b * c.block_size, n = std::min(c.block_size, seq_len - start);
      if (b + kPrefetchBlocks < num_blocks) prefetch_l2(block_rows(b + kPrefetchBlocks, which), block_bytes);
      for (int64_t kv = 0; kv < num_kv; ++kv) {
        const int8_t* rows = block_rows(b, which) + kv * c.stride_head;
        for (int64_t t = 0; t < n; t += kTile8) fn(kv, rows + t * c.stride_offset, std::min(kTile8, n - t), start + t);
      }
    }
  };
  for_each_tile(0, [&](int64_t kv, const int8_t* tile, int64_t m, int64_t position) VLLM_LITE_TARGET_AVX2 {
    const vfloat8 row_scales = tile_scales8(tile, c.stride_offset, m, D) * scale;
    score_tile_avx2<D>(logits + kv * group * seq_len + position, seq_len, query.wide + kv * group * D,
                       query.scales + kv * group, group, tile, c.stride_offset, m, row_scales);
  });
  for (int64_t h = 0; h < num_heads; ++h) inv_sum[h] = 1.f / softmax_numerators<vfloat8>(logits + h * seq_len, seq_len);
  std::fill(acc, acc + num_heads * D, 0.f);
  for_each_tile(1, [&](int64_t kv, const int8_t* tile, int64_t m, int64_t position) VLLM_LITE_TARGET_AVX2 {
    const vfloat8 scales = tile_scales8(tile, c.stride_offset, m, D);
    for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
      alignas(32) float weights[kTile8];
      store(weights, load<vfloat8>(logits + h * seq_len + position) * scales);  // lanes past m: unused
      for (int64_t d = 0; d < D; d += CC * 8)
        weighted_sum_avx2<CC>(acc + h * D + d, weights, tile + d, c.stride_offset, m);
    }
  });
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t d = 0; d < D; d += 8) store(out + h * D + d, load<vfloat8>(acc + h * D + d) * inv_sum[h]);
}

#define VLLM_LITE_DECODE_I8_AVX2(D)                                                                        \
  VLLM_LITE_TARGET_AVX2                                                                                    \
  void decode_one_i8_avx2_##D(float* out, const QueryRows& query, const int8_t* cache, const int32_t* blocks, \
                              int64_t seq_len, int64_t kv_begin, int64_t kv_end, int64_t group,           \
                              const CacheLayout& c, float scale, std::vector<float>& scratch) {           \
    decode_one_i8_avx2<D>(out, query, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale, scratch); \
  }
VLLM_LITE_DECODE_I8_AVX2(32)
VLLM_LITE_DECODE_I8_AVX2(64)
VLLM_LITE_DECODE_I8_AVX2(128)
#undef VLLM_LITE_DECODE_I8_AVX2
#endif  // VLLM_LITE_I8_AVX512

// The AVX2 kernels run where the AVX-512 ones do not and the CPU (and VLLM_LITE_CPU_CAPABILITY)
// allow AVX2.
bool avx2_tiles_fit(int64_t head_dim) {
  return VLLM_LITE_I8_AVX512 && !cpu_has_avx512_vnni() && isa_lanes() >= 8 &&
         (head_dim == 32 || head_dim == 64 || head_dim == 128);
}

// Any head_dim: each row dequantized into fp32 as it is read, then dot / axpy.
template <int L>
VLLM_LITE_INLINE void decode_one_i8_any_head_dim(float* out, const QueryRows& query, const int8_t* cache,
                                                 const int32_t* blocks, int64_t seq_len, int64_t kv_begin,
                                                 int64_t kv_end, int64_t group, int64_t head_dim, const CacheLayout& c,
                                                 float scale, std::vector<float>& scratch) {
  typedef VecF<L> V;
  const int64_t num_heads = (kv_end - kv_begin) * group;
  scratch.resize(num_heads * (seq_len + head_dim + 1) + head_dim);
  float* logits = scratch.data();
  float* acc = logits + num_heads * seq_len;
  float* inv_sum = acc + num_heads * head_dim;
  float* row = inv_sum + num_heads;
  auto widen = [&](int64_t t, int64_t which, int64_t kv) {
    const int8_t* r = cache + blocks[t / c.block_size] * c.stride_block + which * c.stride_kv +
                      (t % c.block_size) * c.stride_offset + (kv_begin + kv) * c.stride_head;
    const float s = row_scale(r, head_dim);
    for (int64_t d = 0; d < head_dim; ++d) row[d] = r[d] * s;
  };
  for (int64_t t = 0; t < seq_len; ++t)
    for (int64_t kv = 0; kv < kv_end - kv_begin; ++kv) {
      widen(t, 0, kv);
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h)
        logits[h * seq_len + t] = dot<V>(query.values + h * head_dim, row, head_dim) * scale;
    }
  for (int64_t h = 0; h < num_heads; ++h) inv_sum[h] = 1.f / softmax_numerators<V>(logits + h * seq_len, seq_len);
  std::fill(acc, acc + num_heads * head_dim, 0.f);
  for (int64_t t = 0; t < seq_len; ++t)
    for (int64_t kv = 0; kv < kv_end - kv_begin; ++kv) {
      widen(t, 1, kv);
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h)
        axpy<V>(acc + h * head_dim, logits[h * seq_len + t], row, head_dim);
    }
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t d = 0; d < head_dim; ++d) out[h * head_dim + d] = acc[h * head_dim + d] * inv_sum[h];
}

VLLM_LITE_PER_ISA(decode_one_i8_any, decode_one_i8_any_head_dim<L>,
                  (float* out, const QueryRows& query, const int8_t* cache, const int32_t* blocks, int64_t seq_len,
                   int64_t kv_begin, int64_t kv_end, int64_t group, int64_t head_dim, const CacheLayout& c,
                   float scale, std::vector<float>& scratch),
                  (out, query, cache, blocks, seq_len, kv_begin, kv_end, group, head_dim, c, scale, scratch))

void decode_item_i8(float* out, const QueryRows& query, const int8_t* cache, const int32_t* blocks,
                    int64_t seq_len, int64_t kv_begin, int64_t kv_end, int64_t group, int64_t head_dim,
                    const CacheLayout& c, float scale, std::vector<float>& scratch) {
  if (seq_len <= 0) {  // a padded row: nothing to attend to
    std::fill(out, out + (kv_end - kv_begin) * group * head_dim, 0.f);
    return;
  }
#if VLLM_LITE_I8_AVX512
  if (cpu_has_avx512_vnni()) switch (head_dim) {
    case 2 * kLanes:
      return decode_one_i8_2(out, query, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale, scratch);
    case 4 * kLanes:
      return decode_one_i8_4(out, query, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale, scratch);
    case 8 * kLanes:
      return decode_one_i8_8(out, query, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale, scratch);
    default:
      break;
  }
  if (query.wide != nullptr) switch (head_dim) {
    case 32:
      return decode_one_i8_avx2_32(out, query, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale, scratch);
    case 64:
      return decode_one_i8_avx2_64(out, query, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale, scratch);
    case 128:
      return decode_one_i8_avx2_128(out, query, cache, blocks, seq_len, kv_begin, kv_end, group, c, scale, scratch);
    default:
      break;
  }
#endif
  decode_one_i8_any(out, query, cache, blocks, seq_len, kv_begin, kv_end, group, head_dim, c, scale,
                    scratch);
}

void paged_attention_decode_int8(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                                 const at::Tensor& block_table, const at::Tensor& seq_lens, double scale) {
  check_int8_cache(kv_cache);
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_attention_decode_int8 takes a float32 query and output");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1,
              "query must be [num_seqs, num_q_heads, head_dim] with a contiguous last dimension");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), "out must be contiguous and shaped like query");
  const int64_t num_seqs = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(head_dim + kScaleBytes == kv_cache.size(4), "head_dim differs between query and kv_cache");
  TORCH_CHECK(num_q_heads % num_kv_heads == 0, "num_q_heads must be a multiple of num_kv_heads");
  const int32_t* lens = check_decode_tables(block_table, seq_lens, num_seqs, kv_cache.size(2));
  const CacheLayout layout = cache_layout(kv_cache);
  const int num_threads = at::get_num_threads();
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t heads_per_item = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  const bool amx = amx_tiles_fit(head_dim, layout.block_size, group) && cpu_has_avx512_vnni() &&
                   cpu_has_amx(AmxKind::kInt8);
  const bool avx2 = avx2_tiles_fit(head_dim);
  float* o = out.data_ptr<float>();
  const float* q = query.data_ptr<float>();
  const int8_t* cache = kv_cache.data_ptr<int8_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t q_stride_t = query.stride(0), q_stride_h = query.stride(1), bt_stride = block_table.stride(0);
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scratch;
    QueryBuffers query_buffers;
#if VLLM_LITE_I8_AVX512
    if (amx) load_tile_config(3);  // per thread: the tile configuration is thread state
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * items_per_seq; ++item) {
      const int64_t s = item / items_per_seq;
      const int64_t kv_begin = (item % items_per_seq) * heads_per_item;
      const QueryRows rows = quantize_queries(query_buffers, q + s * q_stride_t + kv_begin * group * q_stride_h,
                                              q_stride_h, heads_per_item * group, group, head_dim, amx, avx2);
      decode_item_i8(o + (s * num_q_heads + kv_begin * group) * head_dim, rows, cache, table + s * bt_stride,
                     lens[s], kv_begin, kv_begin + heads_per_item, group, head_dim, layout,
                     static_cast<float>(scale), scratch);
    }
#if VLLM_LITE_I8_AVX512
    if (amx) release_tiles();
#endif
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_lite_C, m) {
  m.def("reshape_and_cache_int8(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention_decode_int8(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, "
      "Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) {
  m.impl("reshape_and_cache_int8", &reshape_and_cache_int8);
  m.impl("paged_attention_decode_int8", &paged_attention_decode_int8);
}
