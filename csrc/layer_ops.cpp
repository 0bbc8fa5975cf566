// Fused elementwise ops of a decoder layer (vLLM's CPU op names and argument order), float32 or
// bfloat16 storage with fp32 arithmetic inside, each result rounded once:
//
//   rms_norm(out, x, weight, eps)                 out = x * rsqrt(mean(x^2) + eps) * weight
//   fused_add_rms_norm(x, residual, weight, eps)  residual += x; x = rms_norm(residual) (in place)
//   rotary_embedding(positions, query, key, cos_sin_cache)
//       neox-style rotary in place on query [T, Hq, D] and key [T, Hkv, D] (strided rows allowed:
//       views into the fused qkv output); cos_sin_cache [max_position, D] holds cos in its first
//       half and sin in its second (one value per rotated pair).
//   silu_and_mul(out, x)                          out = silu(x[:, :d]) * x[:, d:]
//
// Why fused: with torch ops each of these is 5-14 kernels, each its own pass over memory, Python
// dispatch, and (above torch's grain size) its own OpenMP parallel region, whose sleeping threads
// must be woken under OMP_WAIT_POLICY=PASSIVE. Here each op is one pass and at most ONE parallel
// region, and none for decode-sized inputs (kParallelElements), where waking a thread costs
// more than the work.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_multiversion.h"
#include "cpu_rows.h"
#include "cpu_vec.h"

namespace {

using namespace vllm_lite_cpu;  // NOLINT: the helpers of cpu_vec.h and cpu_rows.h

// ---- RMSNorm ----

// Sum of squares of one row of n elements.
template <typename V, typename T>
VLLM_LITE_INLINE float sum_squares(const T* x, int64_t n) {
  constexpr int L = lanes_of<V>;
  V acc = {};
  int64_t d = 0;
  for (; d + L <= n; d += L) {
    const V v = load_any<V>(x + d);
    acc += v * v;
  }
  float sum = hsum(acc);
  for (; d < n; ++d) sum += to_float(x[d]) * to_float(x[d]);
  return sum;
}

// out = (x * inv_rms) * weight, the order of transformers' LlamaRMSNorm.
template <typename V, typename T>
VLLM_LITE_INLINE void scale_row(T* out, const T* x, const T* weight, float inv_rms, int64_t n) {
  constexpr int L = lanes_of<V>;
  int64_t d = 0;
  for (; d + L <= n; d += L) store_any(out + d, load_any<V>(x + d) * inv_rms * load_any<V>(weight + d));
  for (; d < n; ++d) store_one(out + d, to_float(x[d]) * inv_rms * to_float(weight[d]));
}

VLLM_LITE_INLINE float inv_rms(float sum_sq, int64_t n, float eps) {
  return 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
}

template <typename V, typename T>
VLLM_LITE_INLINE void rms_norm_row(T* out, const T* x, const T* weight, int64_t n, float eps) {
  scale_row<V>(out, x, weight, inv_rms(sum_squares<V>(x, n), n, eps), n);
}

// residual = x + residual (rounded to T: the stored sum is what is normalized, as when torch adds
// first), then x = rms_norm(residual).
template <typename V, typename T>
VLLM_LITE_INLINE void add_rms_norm_row(T* x, T* residual, const T* weight, int64_t n, float eps) {
  constexpr int L = lanes_of<V>;
  int64_t d = 0;
  for (; d + L <= n; d += L) store_any(residual + d, load_any<V>(x + d) + load_any<V>(residual + d));
  for (; d < n; ++d) store_one(residual + d, to_float(x[d]) + to_float(residual[d]));
  scale_row<V>(x, residual, weight, inv_rms(sum_squares<V>(residual, n), n, eps), n);
}

template <int L, typename T>
VLLM_LITE_INLINE void rms_norm_rows(T* out, const T* x, const T* weight, int64_t n, int64_t x_stride, float eps,
                                    int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) rms_norm_row<VecF<L>>(out + r * n, x + r * x_stride, weight, n, eps);
}

template <int L, typename T>
VLLM_LITE_INLINE void add_rms_norm_rows(T* x, T* residual, const T* weight, int64_t n, float eps, int64_t begin,
                                        int64_t end) {
  for (int64_t r = begin; r < end; ++r) add_rms_norm_row<VecF<L>>(x + r * n, residual + r * n, weight, n, eps);
}

// Compiled per ISA level per row range (not around the parallel loop: OpenMP outlines the loop
// body into a function that the target attributes would not reach).
#define VLLM_LITE_NORM_RANGES(T, SUFFIX)                                                                      \
  VLLM_LITE_PER_ISA(rms_norm_range_##SUFFIX, (rms_norm_rows<L, T>),                                          \
                    (T* out, const T* x, const T* weight, int64_t n, int64_t x_stride, float eps, int64_t begin, \
                     int64_t end),                                                                            \
                    (out, x, weight, n, x_stride, eps, begin, end))                                           \
  VLLM_LITE_PER_ISA(add_rms_norm_range_##SUFFIX, (add_rms_norm_rows<L, T>),                                  \
                    (T* x, T* residual, const T* weight, int64_t n, float eps, int64_t begin, int64_t end),  \
                    (x, residual, weight, n, eps, begin, end))
VLLM_LITE_NORM_RANGES(float, f32)
VLLM_LITE_NORM_RANGES(uint16_t, bf16)
#undef VLLM_LITE_NORM_RANGES

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": ", what, " must have the same dtype (",
              a.scalar_type(), " vs ", b.scalar_type(), ")");
}

// Rows of the last dimension: contiguous, or a 2-D tensor with contiguous rows.
void check_rows(const at::Tensor& t, int64_t n, const char* op, const char* name) {
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) == n, op, ": ", name, " must end in a dimension of ", n);
  TORCH_CHECK(t.is_contiguous() || (t.dim() == 2 && t.stride(1) == 1), op, ": ", name,
              " must be contiguous (or 2-D with contiguous rows)");
}

// x a float32/bf16 CPU tensor, weight a contiguous 1-D tensor of its dtype: returns its length.
int64_t check_norm_weight(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  check_float_cpu(x, op, "x");
  check_same_dtype(x, weight, op, "x and weight");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous(), op, ": weight must be contiguous 1-D");
  return weight.size(0);
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const char* op = "rms_norm";
  const int64_t n = check_norm_weight(x, weight, op);
  check_same_dtype(x, out, op, "x and out");
  check_rows(x, n, op, "x");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes(), op, ": out must be contiguous and shaped like x");
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const int64_t x_stride = x.dim() == 2 ? x.stride(0) : n;
  const int threads = threads_for(x.numel());
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    float* o = out.data_ptr<float>();
    const float *in = x.data_ptr<float>(), *w = weight.data_ptr<float>();
    return for_row_chunks(rows, threads, [&](int64_t b, int64_t end) { rms_norm_range_f32(o, in, w, n, x_stride, e, b, end); });
  }
  uint16_t* o = static_cast<uint16_t*>(out.data_ptr());
  const uint16_t *in = static_cast<const uint16_t*>(x.data_ptr()), *w = static_cast<const uint16_t*>(weight.data_ptr());
  for_row_chunks(rows, threads, [&](int64_t b, int64_t end) { rms_norm_range_bf16(o, in, w, n, x_stride, e, b, end); });
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const char* op = "fused_add_rms_norm";
  const int64_t n = check_norm_weight(x, weight, op);
  check_same_dtype(x, residual, op, "x and residual");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() &&
                  x.dim() >= 1 && x.size(-1) == n,
              op, ": x and residual must be contiguous, alike, and end in a dimension of ", n);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const int threads = threads_for(x.numel());
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    float *in = x.data_ptr<float>(), *res = residual.data_ptr<float>();
    const float* w = weight.data_ptr<float>();
    return for_row_chunks(rows, threads, [&](int64_t b, int64_t end) { add_rms_norm_range_f32(in, res, w, n, e, b, end); });
  }
  uint16_t *in = static_cast<uint16_t*>(x.data_ptr()), *res = static_cast<uint16_t*>(residual.data_ptr());
  const uint16_t* w = static_cast<const uint16_t*>(weight.data_ptr());
  for_row_chunks(rows, threads, [&](int64_t b, int64_t end) { add_rms_norm_range_bf16(in, res, w, n, e, b, end); });
}

// ---- Rotary embedding (neox style: pairs (i, i + D/2)) ----

// One head in place: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (transformers' rotate_half form).
template <typename V, typename T, typename C>
VLLM_LITE_INLINE void rotate_head(T* x, const C* cos, const C* sin, int64_t half) {
  constexpr int L = lanes_of<V>;
  T* x2 = x + half;
  int64_t i = 0;
  for (; i + L <= half; i += L) {
    const V a = load_any<V>(x + i), b = load_any<V>(x2 + i), c = load_any<V>(cos + i), s = load_any<V>(sin + i);
    store_any(x + i, a * c - b * s);
    store_any(x2 + i, b * c + a * s);
  }
  for (; i < half; ++i) {
    const float a = to_float(x[i]), b = to_float(x2[i]), c = to_float(cos[i]), s = to_float(sin[i]);
    store_one(x + i, a * c - b * s);
    store_one(x2 + i, b * c + a * s);
  }
}

struct HeadsView {
  int64_t num_heads, stride_token, stride_head;
};

template <int L, typename T>
VLLM_LITE_INLINE void rotary_tokens(const int64_t* positions, T* query, HeadsView q, T* key, HeadsView k,
                                    const T* cos_sin, int64_t head_dim, int64_t begin, int64_t end) {
  const int64_t half = head_dim / 2;
  for (int64_t t = begin; t < end; ++t) {
    const T* cos = cos_sin + positions[t] * head_dim;
    const T* sin = cos + half;
    for (int64_t h = 0; h < q.num_heads; ++h)
      rotate_head<VecF<L>>(query + t * q.stride_token + h * q.stride_head, cos, sin, half);
    for (int64_t h = 0; h < k.num_heads; ++h) rotate_head<VecF<L>>(key + t * k.stride_token + h * k.stride_head, cos, sin, half);
  }
}

#define VLLM_LITE_ROTARY_RANGE(T, SUFFIX)                                                                 \
  VLLM_LITE_PER_ISA(rotary_range_##SUFFIX, (rotary_tokens<L, T>),                                         \
                    (const int64_t* positions, T* query, HeadsView q, T* key, HeadsView k, const T* cos_sin, \
                     int64_t head_dim, int64_t begin, int64_t end),                                        \
                    (positions, query, q, key, k, cos_sin, head_dim, begin, end))
VLLM_LITE_ROTARY_RANGE(float, f32)
VLLM_LITE_ROTARY_RANGE(uint16_t, bf16)
#undef VLLM_LITE_ROTARY_RANGE

HeadsView heads_view(const at::Tensor& t, int64_t num_tokens, int64_t head_dim, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == num_tokens && t.size(2) == head_dim && t.stride(2) == 1,
              "rotary_embedding: ", name, " must be [num_tokens=", num_tokens, ", heads, head_dim=", head_dim,
              "] with a contiguous last dimension");
  return HeadsView{t.size(1), t.stride(0), t.stride(1)};
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      const at::Tensor& cos_sin_cache) {
  const char* op = "rotary_embedding";
  check_float_cpu(query, op, "query");
  check_same_dtype(query, key, op, "query and key");
  check_same_dtype(query, cos_sin_cache, op, "query and cos_sin_cache");
  TORCH_CHECK(positions.device().is_cpu() && positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.is_contiguous(),
              op, ": positions must be contiguous int64 [num_tokens] on the CPU");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous() && cos_sin_cache.size(1) % 2 == 0,
              op, ": cos_sin_cache must be contiguous [max_position, head_dim] (head_dim even)");
  const int64_t num_tokens = positions.size(0), head_dim = cos_sin_cache.size(1);
  const HeadsView q = heads_view(query, num_tokens, head_dim, "query");
  const HeadsView k = heads_view(key, num_tokens, head_dim, "key");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_position = cos_sin_cache.size(0);
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, op, ": positions[", t, "]=", pos[t],
                " is outside the cache's [0, ", max_position, ")");
  const int threads = threads_for(num_tokens * (q.num_heads + k.num_heads) * head_dim);
  if (query.scalar_type() == at::kFloat) {
    float *qd = query.data_ptr<float>(), *kd = key.data_ptr<float>();
    const float* cs = cos_sin_cache.data_ptr<float>();
    return for_row_chunks(num_tokens, threads,
                          [&](int64_t b, int64_t end) { rotary_range_f32(pos, qd, q, kd, k, cs, head_dim, b, end); });
  }
  uint16_t *qd = static_cast<uint16_t*>(query.data_ptr()), *kd = static_cast<uint16_t*>(key.data_ptr());
  const uint16_t* cs = static_cast<const uint16_t*>(cos_sin_cache.data_ptr());
  for_row_chunks(num_tokens, threads,
                 [&](int64_t b, int64_t end) { rotary_range_bf16(pos, qd, q, kd, k, cs, head_dim, b, end); });
}

// ---- SiLU and multiply ----

// out[i] = gate[i] / (1 + exp(-gate[i])) * up[i].
template <typename V, typename T>
VLLM_LITE_INLINE void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t d) {
  constexpr int L = lanes_of<V>;
  int64_t i = 0;
  for (; i + L <= d; i += L) {
    const V g = load_any<V>(gate + i);
    store_any(out + i, g / (1.f + exp_clamped(-g)) * load_any<V>(up + i));
  }
  for (; i < d; ++i) {
    const float g = to_float(gate[i]);
    store_one(out + i, g / (1.f + std::exp(-g)) * to_float(up[i]));
  }
}

template <int L, typename T>
VLLM_LITE_INLINE void silu_and_mul_rows(T* out, const T* x, int64_t d, int64_t x_stride, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r)
    silu_and_mul_row<VecF<L>>(out + r * d, x + r * x_stride, x + r * x_stride + d, d);
}

#define VLLM_LITE_SILU_RANGE(T, SUFFIX)                                                                          \
  VLLM_LITE_PER_ISA(silu_and_mul_range_##SUFFIX, (silu_and_mul_rows<L, T>),                                     \
                    (T* out, const T* x, int64_t d, int64_t x_stride, int64_t begin, int64_t end),              \
                    (out, x, d, x_stride, begin, end))
VLLM_LITE_SILU_RANGE(float, f32)
VLLM_LITE_SILU_RANGE(uint16_t, bf16)
#undef VLLM_LITE_SILU_RANGE

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  const char* op = "silu_and_mul";
  check_float_cpu(x, op, "x");
  check_same_dtype(x, out, op, "x and out");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, op,
              ": x must be 2-D [rows, 2 * d] with contiguous rows");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == rows && out.size(1) == d, op,
              ": out must be contiguous [rows, d]");
  const int threads = threads_for(x.numel());
  const int64_t stride = x.stride(0);
  if (x.scalar_type() == at::kFloat) {
    float* o = out.data_ptr<float>();
    const float* in = x.data_ptr<float>();
    return for_row_chunks(rows, threads, [&](int64_t b, int64_t end) { silu_and_mul_range_f32(o, in, d, stride, b, end); });
  }
  uint16_t* o = static_cast<uint16_t*>(out.data_ptr());
  const uint16_t* in = static_cast<const uint16_t*>(x.data_ptr());
  for_row_chunks(rows, threads, [&](int64_t b, int64_t end) { silu_and_mul_range_bf16(o, in, d, stride, b, end); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_lite_C, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
