// Native CPU sampling op: top-k / top-p truncation and the random draw in expected O(vocab) per
// row, whatever the distribution looks like.
//
//   top_k_top_p_sample(logits, top_k, top_p, uniforms) -> int64 [rows]
//
// Rule (the same as the torch fallback in vllm_lite/sample/ops/topk_topp.py): a row keeps the
// tokens whose probability is at least a threshold. top-k's threshold is the k-th largest
// probability; top-p's is the largest t such that the tokens with p >= t hold at least a
// fraction top_p of the (top-k-kept) mass. Ties at a threshold are all kept. The draw is an
// inverse CDF over the kept tokens in vocabulary order: the first token whose cumulative kept
// mass exceeds u * kept_mass.
//
// Both thresholds come from selection, not sorting: std::nth_element for top-k, and for top-p a
// quickselect that partitions around a pivot and descends into the side that holds the boundary
// (the larger side's mass is known after each partition). Rows run in parallel.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_multiversion.h"

namespace {

// out[i] = exp(x[i] - shift) for x[i] <= shift, 0 for -inf. libm's expf
// does not vectorize without -ffast-math, so 2^t is split as 2^floor(t) (exponent bits) times a
// degree-6 polynomial for 2^frac (relative error ~2e-7, plenty for sampling).
VLLM_LITE_MULTIVERSION
void exp_shifted(const float* x, float shift, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float t = (x[i] - shift) * 1.44269504f;
    const bool underflow = !(t > -125.0f);  // also true for NaN and -inf
    t = underflow ? -125.0f : t;
    const float whole = __builtin_floorf(t);
    const float f = t - whole;
    const float p =
        1.0f + f * (0.693147182f + f * (0.240226507f + f * (0.0555041087f +
        f * (0.00961812911f + f * (0.00133335581f + f * 0.000154035304f)))));
    const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
    float scale;
    __builtin_memcpy(&scale, &bits, sizeof(scale));
    out[i] = underflow ? 0.0f : p * scale;
  }
}

VLLM_LITE_MULTIVERSION
float row_max(const float* x, int64_t n) {
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) peak = x[i] > peak ? x[i] : peak;
  return peak;
}

// Largest threshold t among `values[0, n)` (all > 0) such that sum(values >= t) >= target.
// `values` is reordered. Expected O(n): each round partitions the remaining range in three.
float top_p_threshold(float* values, int64_t n, double target) {
  int64_t lo = 0, hi = n;
  double above = 0.0;  // mass of values already known to be > everything in [lo, hi)
  float threshold = values[0];
  while (lo < hi) {
    const float pivot = values[lo + (hi - lo) / 2];
    // [lo, gt) > pivot, [gt, eq) == pivot, [eq, hi) < pivot
    float* first = values + lo;
    float* last = values + hi;
    float* mid_gt = std::partition(first, last, [pivot](float v) { return v > pivot; });
    float* mid_eq = std::partition(mid_gt, last, [pivot](float v) { return v == pivot; });
    double mass_gt = 0.0;
    for (float* p = first; p < mid_gt; ++p) mass_gt += *p;
    if (above + mass_gt >= target) {
      hi = lo + (mid_gt - first);  // the boundary lies among the larger values
      continue;
    }
    above += mass_gt;
    threshold = pivot;
    above += static_cast<double>(pivot) * static_cast<double>(mid_eq - mid_gt);
    if (above >= target) return pivot;
    lo = lo + (mid_eq - first);  // everything >= pivot is kept; look among the smaller values
  }
  return threshold;  // rounding left the target just out of reach: keep everything seen
}

int64_t sample_row(const float* logits, int64_t vocab, int64_t top_k, float top_p, float u,
                   std::vector<float>& probs, std::vector<float>& scratch) {
  const float peak = row_max(logits, vocab);
  if (!std::isfinite(peak)) return 0;  // every token masked: nothing sensible to draw
  exp_shifted(logits, peak, probs.data(), vocab);

  float threshold = 0.0f;
  int64_t num_kept = 0;
  for (int64_t i = 0; i < vocab; ++i)
    if (probs[i] > 0.0f) scratch[num_kept++] = probs[i];
  if (top_k > 0 && top_k < num_kept) {
    std::nth_element(scratch.begin(), scratch.begin() + (top_k - 1), scratch.begin() + num_kept,
                     [](float a, float b) { return a > b; });
    threshold = scratch[top_k - 1];
    num_kept = 0;
    for (int64_t i = 0; i < vocab; ++i)
      if (probs[i] >= threshold && probs[i] > 0.0f) scratch[num_kept++] = probs[i];
  }
  if (top_p < 1.0f && num_kept > 1) {
    double kept_mass = 0.0;
    for (int64_t i = 0; i < num_kept; ++i) kept_mass += scratch[i];
    threshold = std::max(threshold, top_p_threshold(scratch.data(), num_kept, top_p * kept_mass));
  }

  double kept_mass = 0.0;
  int64_t last_kept = 0;
  for (int64_t i = 0; i < vocab; ++i)
    if (probs[i] >= threshold && probs[i] > 0.0f) {
      kept_mass += probs[i];
      last_kept = i;
    }
  const double target = static_cast<double>(u) * kept_mass;
  double cumulative = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (probs[i] < threshold || probs[i] <= 0.0f) continue;
    cumulative += probs[i];
    if (cumulative > target) return i;
  }
  return last_kept;
}

at::Tensor top_k_top_p_sample(const at::Tensor& logits, const at::Tensor& top_k,
                              const at::Tensor& top_p, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be float32 [rows, vocab] with a contiguous last dimension");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.is_contiguous() && top_k.numel() == rows,
              "top_k must be contiguous int64 [rows]");
  TORCH_CHECK(top_p.scalar_type() == at::kFloat && top_p.is_contiguous() && top_p.numel() == rows,
              "top_p must be contiguous float32 [rows]");
  TORCH_CHECK(uniforms.scalar_type() == at::kFloat && uniforms.is_contiguous() &&
                  uniforms.numel() == rows,
              "uniforms must be contiguous float32 [rows]");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* data = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  const int64_t* ks = top_k.data_ptr<int64_t>();
  const float* ps = top_p.data_ptr<float>();
  const float* us = uniforms.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(vocab), scratch(vocab);
    for (int64_t r = begin; r < end; ++r)
      result[r] = sample_row(data + r * row_stride, vocab, ks[r], ps[r], us[r], probs, scratch);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_lite_C, m) {
  m.def("top_k_top_p_sample(Tensor logits, Tensor top_k, Tensor top_p, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) { m.impl("top_k_top_p_sample", &top_k_top_p_sample); }
