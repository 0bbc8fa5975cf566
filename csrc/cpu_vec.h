// Shared by the csrc CPU sources: 16-lane float vectors (GCC vector extensions; one AVX-512
// register, two AVX2 ones) with unaligned loads/stores and a tree sum of the lanes. Functions that
// use them are compiled per ISA level through cpu_multiversion.h.
#pragma once

#include <cstdint>
#include <cstring>

namespace vllm_lite_cpu {

#define VLLM_LITE_INLINE inline __attribute__((always_inline))

constexpr int64_t kLanes = 16;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi32 __attribute__((vector_size(kLanes * sizeof(int32_t))));

VLLM_LITE_INLINE vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

VLLM_LITE_INLINE void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// Sum of the lanes as a tree (halving the vector), not a serial chain of scalar adds.
VLLM_LITE_INLINE float hsum(vfloat v) {
  typedef float half8 __attribute__((vector_size(8 * sizeof(float))));
  typedef float half4 __attribute__((vector_size(4 * sizeof(float))));
  half8 a, b;
  std::memcpy(&a, &v, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&v) + sizeof a, sizeof b);
  a += b;
  half4 c, e;
  std::memcpy(&c, &a, sizeof c);
  std::memcpy(&e, reinterpret_cast<const char*>(&a) + sizeof c, sizeof e);
  c += e;
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// ---- bfloat16 storage (the upper half of a float's bits), widened to fp32 for arithmetic ----

typedef uint16_t vbf16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vu32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));

VLLM_LITE_INLINE vfloat load_bf16(const uint16_t* p) {
  vbf16 h;
  std::memcpy(&h, p, sizeof h);
  const vu32 wide = __builtin_convertvector(h, vu32) << 16;
  vfloat f;
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

// float_to_bf16 on 16 lanes.
VLLM_LITE_INLINE void store_bf16(uint16_t* p, vfloat v) {
  vu32 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const vu32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const vu32 quiet_nan = (bits >> 16) | 0x40u;
  const vu32 wide = (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
  const vbf16 h = __builtin_convertvector(wide, vbf16);
  std::memcpy(p, &h, sizeof h);
}

// Rows of either storage type, read and written as fp32 vectors/scalars.
VLLM_LITE_INLINE vfloat load_any(const float* p) { return load(p); }
VLLM_LITE_INLINE vfloat load_any(const uint16_t* p) { return load_bf16(p); }
VLLM_LITE_INLINE void store_any(float* p, vfloat v) { store(p, v); }
VLLM_LITE_INLINE void store_any(uint16_t* p, vfloat v) { store_bf16(p, v); }
VLLM_LITE_INLINE float to_float(float x) { return x; }
VLLM_LITE_INLINE float to_float(uint16_t x) { return bf16_to_float(x); }
VLLM_LITE_INLINE void store_one(float* p, float x) { *p = x; }
VLLM_LITE_INLINE void store_one(uint16_t* p, float x) { *p = float_to_bf16(x); }

// exp(x) given the integer n (as float `n` and as int `n_int`) with x = n ln2 + r, |r| <= ln2/2:
// exp(r) by a degree-6 Taylor polynomial (rel. error < 2e-7), 2^n by exponent bits. The callers
// choose how n is rounded and what range of x they admit.
VLLM_LITE_INLINE vfloat exp_reduced(vfloat x, vfloat n, vi32 n_int) {
  const vfloat zero = {};
  const vfloat r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  vfloat p = zero + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const vi32 bits = (n_int + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// exp(x) for any float x, n rounded to nearest by the 1.5 * 2^23 trick. x is clamped to
// [-87, 88] (exp(-87) ~ 1.6e-38, exp(88) ~ 1.7e38): callers need no more range.
VLLM_LITE_INLINE vfloat exp_clamped(vfloat x) {
  const vfloat zero = {};
  x = x < -87.f ? zero - 87.f : x;
  x = x > 88.f ? zero + 88.f : x;
  const vfloat magic = zero + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const vfloat n = (x * 1.44269504088896341f + magic) - magic;
  return exp_reduced(x, n, __builtin_convertvector(n, vi32));
}

}  // namespace vllm_lite_cpu
