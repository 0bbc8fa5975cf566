// Shared by the csrc CPU sources: inner loops compiled once per ISA level (AVX-512, AVX2+FMA,
// baseline) and picked at load time by target_clones, so the build stays portable without
// -march=native.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VLLM_LITE_MULTIVERSION \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VLLM_LITE_MULTIVERSION
#endif
