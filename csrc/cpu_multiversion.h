// Shared by the csrc CPU sources: inner loops compiled once per ISA level (AVX-512, AVX2+FMA,
// baseline) and picked at run time, so the build stays portable without -march=native.
//
// Two ways, both picking by what the CPU has:
// - VLLM_LITE_MULTIVERSION (GCC's target_clones): one function body compiled per level. Its
//   16-lane `vfloat`s fit AVX-512 registers only; elsewhere they live on the stack.
// - VLLM_LITE_PER_ISA: a kernel template over its vector width L, compiled per level with the
//   width the level's registers hold (16 lanes AVX-512, 8 AVX2, 4 baseline). The hot kernels use
//   it: on an AVX2-only CPU the fp32 decode attention ran 3x slower as a 16-lane clone.
//
// VLLM_LITE_CPU_CAPABILITY=avx512|avx2|default caps the level VLLM_LITE_PER_ISA picks (as
// PyTorch's ATEN_CPU_CAPABILITY does), so one machine can test every width it can run.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VLLM_LITE_MULTIVERSION \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define VLLM_LITE_TARGET_AVX512 __attribute__((target("arch=x86-64-v4")))
#define VLLM_LITE_TARGET_AVX2 __attribute__((target("arch=x86-64-v3")))
#define VLLM_LITE_HAS_ISA_LEVELS 1
#else
#define VLLM_LITE_MULTIVERSION
#define VLLM_LITE_HAS_ISA_LEVELS 0
#endif

namespace vllm_lite_cpu {

// Float lanes of the widest level this CPU runs, capped by VLLM_LITE_CPU_CAPABILITY: 16, 8 or 4.
inline int detect_isa_lanes() {
  int lanes = 4;
#if VLLM_LITE_HAS_ISA_LEVELS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4"))
    lanes = 16;
  else if (__builtin_cpu_supports("x86-64-v3"))
    lanes = 8;
#endif
  const char* cap = std::getenv("VLLM_LITE_CPU_CAPABILITY");
  if (cap == nullptr || *cap == '\0') return lanes;
  int cap_lanes = 0;
  if (std::strcmp(cap, "avx512") == 0) cap_lanes = 16;
  if (std::strcmp(cap, "avx2") == 0) cap_lanes = 8;
  if (std::strcmp(cap, "default") == 0) cap_lanes = 4;
  TORCH_CHECK(cap_lanes != 0, "VLLM_LITE_CPU_CAPABILITY=", cap, " is not one of avx512, avx2, default");
  return cap_lanes < lanes ? cap_lanes : lanes;
}

inline int isa_lanes() {
  static const int lanes = detect_isa_lanes();
  return lanes;
}

// AVX-512 with VNNI at the level picked (Intel since Cascade Lake, AMD since Zen 4): the int8 and
// int16 dot-product kernels (vpdpbusd, vpdpwssd). 16 lanes means x86-64-v4 (AVX-512 F, BW, CD,
// DQ, VL) and no VLLM_LITE_CPU_CAPABILITY cap below it.
inline bool cpu_has_avx512_vnni() {
#if VLLM_LITE_HAS_ISA_LEVELS
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx512vnni"));
  return has && isa_lanes() == 16;
#else
  return false;
#endif
}

inline const char* isa_name(int lanes) { return lanes == 16 ? "avx512" : lanes == 8 ? "avx2" : "default"; }

}  // namespace vllm_lite_cpu

// Defines `void NAME PARAMS`, which runs KERNEL ARGS compiled for the CPU's level (isa_lanes()):
// KERNEL is an expression naming a function in which the constant `L` is the vector width.
// KERNEL and everything it calls must be always_inline (VLLM_LITE_INLINE) to be compiled for the
// level; PARAMS and ARGS are parenthesized lists.
#if VLLM_LITE_HAS_ISA_LEVELS
#define VLLM_LITE_PER_ISA(NAME, KERNEL, PARAMS, ARGS)                 \
  VLLM_LITE_TARGET_AVX512 void NAME##_avx512 PARAMS {                 \
    constexpr int L = 16;                                             \
    (KERNEL)ARGS;                                                     \
  }                                                                   \
  VLLM_LITE_TARGET_AVX2 void NAME##_avx2 PARAMS {                     \
    constexpr int L = 8;                                              \
    (KERNEL)ARGS;                                                     \
  }                                                                   \
  void NAME##_default PARAMS {                                        \
    constexpr int L = 4;                                              \
    (KERNEL)ARGS;                                                     \
  }                                                                   \
  void NAME PARAMS {                                                  \
    switch (::vllm_lite_cpu::isa_lanes()) {                           \
      case 16: return NAME##_avx512 ARGS;                             \
      case 8: return NAME##_avx2 ARGS;                                \
      default: return NAME##_default ARGS;                            \
    }                                                                 \
  }
#else
#define VLLM_LITE_PER_ISA(NAME, KERNEL, PARAMS, ARGS) \
  void NAME PARAMS {                                  \
    constexpr int L = 4;                              \
    (KERNEL)ARGS;                                     \
  }
#endif
