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

}  // namespace vllm_lite_cpu
