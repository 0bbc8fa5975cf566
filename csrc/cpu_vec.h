// Shared by the csrc CPU sources: float vectors of L lanes (GCC vector extensions) with unaligned
// loads/stores and a tree sum of the lanes. `vfloat` (16 lanes: one AVX-512 register) is what the
// kernels compiled by target_clones use; kernels compiled per ISA level with the width its
// registers hold (cpu_multiversion.h: 16 on AVX-512, 8 on AVX2, 4 baseline) take the vector type
// V as a template parameter: a vector wider than the target's registers lives in memory (GCC has
// no register mode for it), so a 16-lane kernel compiled for AVX2 spends its time on the stack.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace vllm_lite_cpu {

#define VLLM_LITE_INLINE inline __attribute__((always_inline))

template <int L>
struct VecTypes {
  typedef float f __attribute__((vector_size(L * sizeof(float))));
  typedef int32_t i32 __attribute__((vector_size(L * sizeof(int32_t))));
  typedef uint32_t u32 __attribute__((vector_size(L * sizeof(uint32_t))));
  typedef uint16_t bf16 __attribute__((vector_size(L * sizeof(uint16_t))));
};
template <int L>
using VecF = typename VecTypes<L>::f;
template <int L>
using VecI32 = typename VecTypes<L>::i32;

// Lanes of a vector of 4-byte elements.
template <typename V>
constexpr int lanes_of = static_cast<int>(sizeof(V) / 4);

constexpr int64_t kLanes = 16;
typedef VecF<kLanes> vfloat;
typedef VecI32<kLanes> vi32;

template <typename V = vfloat>
VLLM_LITE_INLINE V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
VLLM_LITE_INLINE void store(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

// Sum of the lanes as a tree (halving the vector), not a serial chain of scalar adds.
template <typename V>
VLLM_LITE_INLINE float hsum(V v) {
  constexpr int L = lanes_of<V>;
  if constexpr (L == 4) {
    return (v[0] + v[2]) + (v[1] + v[3]);
  } else {
    VecF<L / 2> a, b;
    std::memcpy(&a, &v, sizeof a);
    std::memcpy(&b, reinterpret_cast<const char*>(&v) + sizeof a, sizeof b);
    return hsum(a + b);
  }
}

// ---- bfloat16 storage (the upper half of a float's bits), widened to fp32 for arithmetic ----

template <typename V = vfloat>
VLLM_LITE_INLINE V load_bf16(const uint16_t* p) {
  constexpr int L = lanes_of<V>;
  typename VecTypes<L>::bf16 h;
  std::memcpy(&h, p, sizeof h);
  const typename VecTypes<L>::u32 wide = __builtin_convertvector(h, typename VecTypes<L>::u32) << 16;
  V f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

VLLM_LITE_INLINE float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays a (quiet) NaN.
VLLM_LITE_INLINE uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// float_to_bf16 on every lane.
template <typename V>
VLLM_LITE_INLINE void store_bf16(uint16_t* p, V v) {
  typedef typename VecTypes<lanes_of<V>>::u32 U;
  U bits;
  std::memcpy(&bits, &v, sizeof bits);
  const U rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const U quiet_nan = (bits >> 16) | 0x40u;
  const U wide = (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
  const auto h = __builtin_convertvector(wide, typename VecTypes<lanes_of<V>>::bf16);
  std::memcpy(p, &h, sizeof h);
}

// ---- float8 storage (vLLM's fp8 KV cache, scale 1.0): e4m3fn and e5m2 bytes widened to fp32 ----
// A normal byte's exponent and mantissa bits go into a float's fields with the exponent rebiased
// (+120 for e4m3, bias 7; +112 for e5m2, bias 15): the same value, exactly. A subnormal byte
// (exponent 0) is read as the smallest normal exponent with its mantissa, minus that power of two
// (2^-6, 2^-14): exact too, and no float subnormal appears (x86 would take a slow assist on one).
// The formats' special bytes (e4m3fn: NaN at magnitude 0x7f; e5m2: inf and NaN at exponent 31) read
// as the float inf / NaN: writes saturate, so only a NaN the model computed is ever stored.
struct fp8_e4m3 { uint8_t bits; };
struct fp8_e5m2 { uint8_t bits; };
template <typename T>
struct Fp8Format;
template <>
struct Fp8Format<fp8_e4m3> {
  static constexpr int kMantissaBits = 3;
  static constexpr uint32_t kRebias = 120;
  static constexpr uint32_t kSpecial = 0x7f;  // magnitudes from here up are NaN
};
template <>
struct Fp8Format<fp8_e5m2> {
  static constexpr int kMantissaBits = 2;
  static constexpr uint32_t kRebias = 112;
  static constexpr uint32_t kSpecial = 0x7c;  // inf, then NaN
};

template <typename T, typename U>
VLLM_LITE_INLINE U fp8_magnitude_bits(U w) {  // of the normal reading; the subnormal one is below
  return ((w & 0x7fu) << (23 - Fp8Format<T>::kMantissaBits)) + (Fp8Format<T>::kRebias << 23);
}

template <typename T, typename V = vfloat>
VLLM_LITE_INLINE V load_fp8(const T* p) {
  constexpr int L = lanes_of<V>;
  typedef uint8_t bytes __attribute__((vector_size(L)));
  typedef typename VecTypes<L>::u32 U;
  bytes b;
  std::memcpy(&b, p, sizeof b);
  const U w = __builtin_convertvector(b, U);
  const U normal = fp8_magnitude_bits<T>(w);
  const uint32_t smallest_normal = (Fp8Format<T>::kRebias + 1) << 23;
  V as_normal, as_subnormal, floor;
  const U subnormal_bits = normal + (1u << 23);  // (exponent 0 read as 1)
  std::memcpy(&as_normal, &normal, sizeof as_normal);
  std::memcpy(&as_subnormal, &subnormal_bits, sizeof as_subnormal);
  const U floor_bits = U{} + smallest_normal;
  std::memcpy(&floor, &floor_bits, sizeof floor);
  as_subnormal -= floor;
  const auto is_subnormal = (w & (0x7fu & ~((1u << Fp8Format<T>::kMantissaBits) - 1))) == 0;
  V magnitude = is_subnormal ? as_subnormal : as_normal;
  U bits;
  std::memcpy(&bits, &magnitude, sizeof bits);
  // inf (e5m2's 0x7c) and NaN: an all-ones exponent keeping the mantissa (non-zero for NaN)
  const U special = (w & 0x7fu) >= Fp8Format<T>::kSpecial;
  bits = special ? (((w & 0x7fu) - Fp8Format<T>::kSpecial) | (Fp8Format<T>::kSpecial == 0x7f)) << 21 | 0x7f800000u
                 : bits;
  bits |= (w & 0x80u) << 24;
  V f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
VLLM_LITE_INLINE float fp8_to_float(T x) {
  const uint32_t w = x.bits;
  const bool subnormal = (w & (0x7fu & ~((1u << Fp8Format<T>::kMantissaBits) - 1))) == 0;
  uint32_t bits = fp8_magnitude_bits<T>(w) + (subnormal ? 1u << 23 : 0u);
  float f, floor = 0.f;
  std::memcpy(&f, &bits, sizeof f);
  if (subnormal) {
    const uint32_t floor_bits = (Fp8Format<T>::kRebias + 1) << 23;
    std::memcpy(&floor, &floor_bits, sizeof floor);
  }
  f -= floor;
  std::memcpy(&bits, &f, sizeof bits);
  if ((w & 0x7fu) >= Fp8Format<T>::kSpecial)
    bits = (((w & 0x7fu) - Fp8Format<T>::kSpecial) | (Fp8Format<T>::kSpecial == 0x7f)) << 21 | 0x7f800000u;
  bits |= (w & 0x80u) << 24;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Rows of either storage type, read and written as fp32 vectors/scalars.
template <typename V = vfloat>
VLLM_LITE_INLINE V load_any(const float* p) {
  return load<V>(p);
}
template <typename V = vfloat>
VLLM_LITE_INLINE V load_any(const uint16_t* p) {
  return load_bf16<V>(p);
}
template <typename V>
VLLM_LITE_INLINE void store_any(float* p, V v) {
  store(p, v);
}
template <typename V>
VLLM_LITE_INLINE void store_any(uint16_t* p, V v) {
  store_bf16(p, v);
}
template <typename V = vfloat>
VLLM_LITE_INLINE V load_any(const fp8_e4m3* p) {
  return load_fp8<fp8_e4m3, V>(p);
}
template <typename V = vfloat>
VLLM_LITE_INLINE V load_any(const fp8_e5m2* p) {
  return load_fp8<fp8_e5m2, V>(p);
}
VLLM_LITE_INLINE float to_float(float x) { return x; }
VLLM_LITE_INLINE float to_float(uint16_t x) { return bf16_to_float(x); }
VLLM_LITE_INLINE float to_float(fp8_e4m3 x) { return fp8_to_float(x); }
VLLM_LITE_INLINE float to_float(fp8_e5m2 x) { return fp8_to_float(x); }
VLLM_LITE_INLINE void store_one(float* p, float x) { *p = x; }
VLLM_LITE_INLINE void store_one(uint16_t* p, float x) { *p = float_to_bf16(x); }

// exp(x) given the integer n (as float `n` and as int `n_int`) with x = n ln2 + r, |r| <= ln2/2:
// exp(r) by a degree-6 Taylor polynomial (rel. error < 2e-7), 2^n by exponent bits. The callers
// choose how n is rounded and what range of x they admit.
template <typename V>
VLLM_LITE_INLINE V exp_reduced(V x, V n, VecI32<lanes_of<V>> n_int) {
  const V zero = {};
  const V r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  V p = zero + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const VecI32<lanes_of<V>> bits = (n_int + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// exp(x) for any float x, n rounded to nearest by the 1.5 * 2^23 trick. x is clamped to
// [-87, 88] (exp(-87) ~ 1.6e-38, exp(88) ~ 1.7e38): callers need no more range.
template <typename V>
VLLM_LITE_INLINE V exp_clamped(V x) {
  const V zero = {};
  x = x < -87.f ? zero - 87.f : x;
  x = x > 88.f ? zero + 88.f : x;
  const V magic = zero + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (x * 1.44269504088896341f + magic) - magic;
  return exp_reduced(x, n, __builtin_convertvector(n, VecI32<lanes_of<V>>));
}

// exp(x) for x <= 0 (softmax after subtracting the max), vectorized (exp_reduced); below -87
// exp underflows to 0.
template <typename V>
VLLM_LITE_INLINE V exp_nonpositive(V x) {
  typedef VecI32<lanes_of<V>> I;
  const V zero = {};
  const V keep = x < -87.f ? zero : zero + 1.f;
  x = x < -87.f ? zero - 87.f : x;
  // Round to nearest: x <= 0, and the conversion truncates toward zero.
  const I n_int = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, I);
  return exp_reduced(x, __builtin_convertvector(n_int, V), n_int) * keep;
}

// The largest of x[0:n], a vector at a time (a serial chain of scalar maxes cost as much as a
// decode's scores); NaNs are skipped as std::max skips them.
template <typename V = vfloat>
VLLM_LITE_INLINE float max_of(const float* x, int64_t n) {
  constexpr int L = lanes_of<V>;
  float max = -std::numeric_limits<float>::infinity();
  V lanes = V{} + max;
  int64_t t = 0;
  for (; t + L <= n; t += L) {
    const V v = load<V>(x + t);
    lanes = v > lanes ? v : lanes;
  }
  for (int64_t j = 0; j < L; ++j) max = std::max(max, lanes[j]);
  for (; t < n; ++t) max = std::max(max, x[t]);
  return max;
}

}  // namespace vllm_lite_cpu
