// Shared by the int8 csrc sources (int8_ops.cpp, int8_linear_ops.cpp): one row's dynamic
// quantization and one row's rescale, the two ends of a W8A8 linear layer, so that the separate
// ops and the fused AMX linear give the same values.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_vec.h"

namespace vllm_lite_cpu {

constexpr float kInt8Max = 127.f;
constexpr float kMinScale = 1e-12f;  // a row of zeros keeps a finite scale
// Adding and subtracting 1.5 * 2^23 rounds a float of magnitude < 2^22 to an integer, to
// nearest with ties to even (the FPU's default rounding), in two vector ops.
constexpr float kRoundMagic = 12582912.f;

template <typename V, typename T>
VLLM_LITE_INLINE float row_abs_max(const T* x, int64_t n) {
  constexpr int L = lanes_of<V>;
  V vmax = {};
  int64_t d = 0;
  for (; d + L <= n; d += L) {
    const V v = load_any<V>(x + d);
    const V a = v < 0.f ? -v : v;
    vmax = a > vmax ? a : vmax;
  }
  float m = 0.f;
  for (int64_t i = 0; i < L; ++i) m = std::max(m, vmax[i]);
  for (; d < n; ++d) m = std::max(m, std::abs(to_float(x[d])));
  return m;
}

template <typename V, typename T>
VLLM_LITE_INLINE float quantize_row(int8_t* q, const T* x, int64_t n) {
  constexpr int L = lanes_of<V>;
  typedef int8_t Codes __attribute__((vector_size(L)));
  const float scale = std::max(row_abs_max<V>(x, n) / kInt8Max, kMinScale);
  int64_t d = 0;
  for (; d + L <= n; d += L) {
    V v = load_any<V>(x + d) / scale;
    v = (v + kRoundMagic) - kRoundMagic;
    v = v > kInt8Max ? kInt8Max + V{} : v;
    v = v < -kInt8Max ? -kInt8Max + V{} : v;
    const Codes packed = __builtin_convertvector(__builtin_convertvector(v, VecI32<L>), Codes);
    std::memcpy(q + d, &packed, sizeof packed);
  }
  for (; d < n; ++d) {
    const float v = (to_float(x[d]) / scale + kRoundMagic) - kRoundMagic;
    q[d] = static_cast<int8_t>(std::clamp(v, -kInt8Max, kInt8Max));
  }
  return scale;
}

// x as computed so far, rounded: GCC's default -ffp-contract=fast fused the rescale's product into
// the bias add (an FMA) in some unrolled copies of a loop and not in others, so the same row gave
// different last bits in the separate op and the fused AMX linear. The product is rounded, then
// the bias added, in every kernel and at every ISA level (as torch's multiply then add).
template <typename V>
VLLM_LITE_INLINE V rounded(V x) {
#if defined(__GNUC__) && defined(__x86_64__)
  asm("" : "+v"(x));
#elif defined(__GNUC__) && defined(__aarch64__)
  asm("" : "+w"(x));
#else
  asm volatile("" : "+m"(x));
#endif
  return x;
}

template <typename V, typename T>
VLLM_LITE_INLINE void dequantize_row(T* out, const int32_t* acc, float row_scale, const float* col_scale,
                                     const T* bias, int64_t n) {
  constexpr int L = lanes_of<V>;
  int64_t d = 0;
  for (; d + L <= n; d += L) {
    VecI32<L> a;
    std::memcpy(&a, acc + d, sizeof a);
    V v = rounded(__builtin_convertvector(a, V) * row_scale * load<V>(col_scale + d));
    if (bias != nullptr) v += load_any<V>(bias + d);
    store_any(out + d, v);
  }
  for (; d < n; ++d) {
    float v = rounded(static_cast<float>(acc[d]) * row_scale * col_scale[d]);
    if (bias != nullptr) v += to_float(bias[d]);
    store_one(out + d, v);
  }
}

}  // namespace vllm_lite_cpu
