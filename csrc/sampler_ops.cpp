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
// Both thresholds come from selection, not sorting. A histogram of the row's probabilities by
// their float bit patterns' top bits (count and mass per bucket, one pass) finds the bucket the
// threshold lies in, and a second level over that bucket's values the sub-bucket where it holds
// many; the selection then runs over those few values only: std::nth_element for top-k, and for
// top-p a quickselect that partitions around a pivot and descends into the side that holds the
// boundary (the larger side's mass is known after each partition). Selection over the whole row
// cost 5-6 ns a token in mispredicted branches, ten times the rest of a draw; the histograms take
// it to ~2.5x less for the whole op (benchmarks/RESULTS.md). A row with neither (top_k 0, top_p
// 1.0) skips them. The draw passes whole blocks of 256 tokens by their sums, walking one block; the
// max, the exps and the block sums run a vector at a time (per ISA level). Rows run in parallel.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu_multiversion.h"
#include "cpu_vec.h"

namespace {

using vllm_lite_cpu::VecF;

// The draw's blocks: whole vectors at every ISA level (16, 8 or 4 lanes).
constexpr int64_t kDrawBlock = 256;

int64_t num_blocks(int64_t n) { return (n + kDrawBlock - 1) / kDrawBlock; }

// sums[b] = the sum of probs over block b (the last block possibly shorter), a vector at a time.
template <int L>
VLLM_LITE_INLINE void sum_blocks(const float* probs, int64_t n, float* sums) {
  using V = VecF<L>;
  for (int64_t begin = 0, b = 0; begin < n; begin += kDrawBlock, ++b) {
    const int64_t end = std::min(n, begin + kDrawBlock);
    V acc = {};
    int64_t i = begin;
    for (; i + L <= end; i += L) acc += vllm_lite_cpu::load<V>(probs + i);
    float sum = vllm_lite_cpu::hsum(acc);
    for (; i < end; ++i) sum += probs[i];
    sums[b] = sum;
  }
}

// probs[i] = exp(logits[i] - peak) (peak: the row's largest logit), 0 where that underflows,
// for -inf and for NaN; then sum_blocks. The last partial vector goes through the same vector
// exp as the rest (padded): equal logits must give equal probabilities wherever they sit, or a
// top-k / top-p threshold on a tie keeps part of it (std::exp there differed from the vector
// exp by an ulp: at 16 lanes a 3,000-token vocabulary's last 8 tokens fell out of their tie).
template <int L>
VLLM_LITE_INLINE void exp_blocks(const float* logits, int64_t n, float peak, float* probs, float* sums) {
  using V = VecF<L>;
  const V zero = {};
  auto exp_of = [&](const V x) {
    const V shifted = x - peak;
    const V e = vllm_lite_cpu::exp_nonpositive(shifted);  // (0 below -87 already; not for NaN)
    return shifted > -87.f ? e : zero;
  };
  int64_t i = 0;
  for (; i + L <= n; i += L) vllm_lite_cpu::store(probs + i, exp_of(vllm_lite_cpu::load<V>(logits + i)));
  if (i < n) {
    float last[L];
    for (int64_t j = 0; j < L; ++j) last[j] = i + j < n ? logits[i + j] : peak;
    vllm_lite_cpu::store(last, exp_of(vllm_lite_cpu::load<V>(last)));
    std::copy(last, last + (n - i), probs + i);
  }
  sum_blocks<L>(probs, n, sums);
}

// probs[i] = 0 where probs[i] < threshold (the tokens truncation drops); then sum_blocks.
template <int L>
VLLM_LITE_INLINE void drop_below(float* probs, int64_t n, float threshold, float* sums) {
  using V = VecF<L>;
  const V zero = {};
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const V v = vllm_lite_cpu::load<V>(probs + i);
    vllm_lite_cpu::store(probs + i, v >= threshold ? v : zero);
  }
  for (; i < n; ++i) probs[i] = probs[i] >= threshold ? probs[i] : 0.0f;
  sum_blocks<L>(probs, n, sums);
}

template <int L>
VLLM_LITE_INLINE void row_peak(const float* x, int64_t n, float* peak) {
  *peak = vllm_lite_cpu::max_of<VecF<L>>(x, n);
}

VLLM_LITE_PER_ISA(largest_logit, row_peak<L>, (const float* x, int64_t n, float* peak), (x, n, peak))
VLLM_LITE_PER_ISA(exp_and_sum, exp_blocks<L>,
                  (const float* logits, int64_t n, float peak, float* probs, float* sums),
                  (logits, n, peak, probs, sums))
VLLM_LITE_PER_ISA(drop_below_and_sum, drop_below<L>, (float* probs, int64_t n, float threshold, float* sums),
                  (probs, n, threshold, sums))

double total_of(const float* sums, int64_t n) {
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks(n); ++b) total += sums[b];
  return total;
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

// The inverse-CDF draw over `weights` (>= 0, not all 0) in vocabulary order: the first index
// whose running sum exceeds u times the total. Whole blocks are passed by their sums; only the
// block that holds the boundary is walked value by value (a running sum over the whole row, one
// chain of dependent adds, made the draw cost as much as the rest of the row).
int64_t draw(const float* weights, int64_t n, float u, const float* sums) {
  const double target = static_cast<double>(u) * total_of(sums, n);
  double before = 0.0;
  for (int64_t begin = 0, b = 0; begin < n; begin += kDrawBlock, ++b) {
    if (before + sums[b] > target) {
      double running = before;
      for (int64_t i = begin; i < std::min(n, begin + kDrawBlock); ++i) {
        running += weights[i];
        if (running > target) return i;  // only a positive weight moves the sum past the target
      }
    }
    before += sums[b];
  }
  for (int64_t i = n - 1; i > 0; --i)  // rounding left the target just out of reach
    if (weights[i] > 0.0f) return i;
  return 0;
}

// The probabilities' buckets, in two levels. For positive floats the bit pattern orders as the
// value does. Level 1: the exponent and 3 mantissa bits (1/8 of an octave a bucket; probs are
// exp(logit - peak), in (0, 1]: below bucket 1,017). Level 2, inside one level-1 bucket: the
// next 8 mantissa bits.
constexpr int kNumBuckets = 1024;

VLLM_LITE_INLINE uint32_t pattern_of(float p) {
  uint32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  return bits;
}

// (Function objects, not functions: passed as template arguments they are inlined.)
struct Level1 {
  VLLM_LITE_INLINE int operator()(float p) const {
    return static_cast<int>(std::min<uint32_t>(pattern_of(p) >> 20, kNumBuckets - 1));
  }
};

struct Level2 {
  VLLM_LITE_INLINE int operator()(float p) const { return static_cast<int>((pattern_of(p) >> 12) & 0xFF); }
};

// Per bucket, how many positive values fall in it and their mass. Two interleaved copies: in a
// flat row most values share a bucket, and one copy's adds would wait on each other.
struct Histogram {
  static constexpr int kCopies = 2;
  int32_t count[kCopies * kNumBuckets];
  double mass[kCopies * kNumBuckets];

  template <typename Bucket>
  void fill(const float* values, int64_t n, Bucket bucket_of) {
    std::fill(count, count + kCopies * kNumBuckets, 0);
    std::fill(mass, mass + kCopies * kNumBuckets, 0.0);
    int64_t i = 0;
    for (; i + kCopies <= n; i += kCopies)
      for (int c = 0; c < kCopies; ++c) add(values[i + c], c * kNumBuckets, bucket_of);
    for (; i < n; ++i) add(values[i], 0, bucket_of);
    for (int c = 1; c < kCopies; ++c) {
      for (int b = 0; b < kNumBuckets; ++b) {
        count[b] += count[c * kNumBuckets + b];
        mass[b] += mass[c * kNumBuckets + b];
      }
    }
  }

  int64_t total_count() const { return std::accumulate(count, count + kNumBuckets, int64_t{0}); }
  double total_mass() const { return std::accumulate(mass, mass + kNumBuckets, 0.0); }

  // Walking down from the top bucket with what the buckets above hold (`above_count`,
  // `above_mass`, updated): the first bucket b where `reached(above + b's)` holds; -1 if none.
  template <typename Reached>
  int find(int64_t& above_count, double& above_mass, Reached reached) const {
    for (int b = kNumBuckets - 1; b >= 0; --b) {
      if (reached(above_count + count[b], above_mass + mass[b])) return b;
      above_count += count[b];
      above_mass += mass[b];
    }
    return -1;
  }

 private:
  template <typename Bucket>
  VLLM_LITE_INLINE void add(float p, int copy, Bucket bucket_of) {
    const bool positive = p > 0.0f;
    const int b = copy + (positive ? bucket_of(p) : 0);
    count[b] += positive;
    mass[b] += positive ? p : 0.0f;
  }
};

// The values of `values[0, n)` that are positive and in bucket `b` into `out` (which may be
// `values` itself); returns how many.
template <typename Bucket>
int64_t collect_bucket(const float* values, int64_t n, int b, float* out, Bucket bucket_of) {
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float p = values[i];
    out[m] = p;
    m += static_cast<int64_t>(p > 0.0f) & static_cast<int64_t>(bucket_of(p) == b);
  }
  return m;
}

// The values of `row` among which a threshold lies, into scratch[0, return) (`row` may be
// scratch itself): the one level-1 bucket that `reached` picks in `histogram` (filled from `row`),
// then, where it holds many, the one level-2 bucket; the count and mass of the values above them
// are added to `above_count` / `above_mass`. -1: `reached` held nowhere.
template <typename Reached>
int64_t narrow_to_bucket(const float* row, int64_t n, Histogram& histogram, std::vector<float>& scratch,
                         int64_t& above_count, double& above_mass, Reached reached) {
  const int b = histogram.find(above_count, above_mass, reached);
  if (b < 0) return -1;
  int64_t m = collect_bucket(row, n, b, scratch.data(), Level1{});
  if (m > 256) {
    histogram.fill(scratch.data(), m, Level2{});
    int64_t count_before = above_count;
    double mass_before = above_mass;
    const int b2 = histogram.find(count_before, mass_before, reached);
    if (b2 >= 0) {  // (else the sub-buckets' mass, summed otherwise, fell short by rounding: keep the bucket)
      above_count = count_before;
      above_mass = mass_before;
      m = collect_bucket(scratch.data(), m, b2, scratch.data(), Level2{});
    }
  }
  return m;
}

// The smallest probability (unnormalized, as `probs`) that top-k and top-p keep. Histograms of
// the row's values by bucket (narrow_to_bucket) find the few values each threshold lies among
// (counting from the top: top-k's k-th value, top-p's mass target); the selection runs over
// those only, not over the whole row with its unpredictable branches (5-6 ns a token, ten times
// the rest of a draw).
float truncation_threshold(const float* probs, int64_t vocab, int64_t top_k, float top_p, Histogram& histogram,
                           std::vector<float>& scratch) {
  float threshold = 0.0f;
  const float* row = probs;
  if (top_k > 0) {
    histogram.fill(probs, vocab, Level1{});
    if (top_k < histogram.total_count()) {
      int64_t above = 0;
      double ignored = 0.0;
      const int64_t m = narrow_to_bucket(probs, vocab, histogram, scratch, above, ignored,
                                         [top_k](int64_t count, double) { return count >= top_k; });
      std::nth_element(scratch.begin(), scratch.begin() + (top_k - above - 1), scratch.begin() + m,
                       [](float a, float b) { return a > b; });
      threshold = scratch[top_k - above - 1];
      if (top_p < 1.0f) {  // top-p over the tokens top-k keeps: the others as zeros
        for (int64_t i = 0; i < vocab; ++i) scratch[i] = probs[i] >= threshold ? probs[i] : 0.0f;
        row = scratch.data();
      }
    }
  }
  if (top_p >= 1.0f) return threshold;
  histogram.fill(row, vocab, Level1{});
  if (histogram.total_count() <= 1) return threshold;
  const double target = top_p * histogram.total_mass();
  int64_t ignored = 0;
  double above = 0.0;
  const int64_t m = narrow_to_bucket(row, vocab, histogram, scratch, ignored, above,
                                     [target](int64_t, double mass) { return mass >= target; });
  if (m <= 0) return threshold;  // rounding left the target out of reach: keep every kept token
  return std::max(threshold, top_p_threshold(scratch.data(), m, target - above));
}

int64_t sample_row(const float* logits, int64_t vocab, int64_t top_k, float top_p, float u,
                   std::vector<float>& probs, std::vector<float>& scratch, std::vector<float>& sums,
                   Histogram& histogram) {
  float peak;
  largest_logit(logits, vocab, &peak);
  if (!std::isfinite(peak)) return 0;  // every token masked: nothing sensible to draw
  exp_and_sum(logits, vocab, peak, probs.data(), sums.data());
  if (top_k > 0 || top_p < 1.0f) {
    const float threshold = truncation_threshold(probs.data(), vocab, top_k, top_p, histogram, scratch);
    drop_below_and_sum(probs.data(), vocab, threshold, sums.data());
  }
  return draw(probs.data(), vocab, u, sums.data());
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
    std::vector<float> probs(vocab), scratch(vocab), sums(num_blocks(vocab));
    Histogram histogram;
    for (int64_t r = begin; r < end; ++r)
      result[r] = sample_row(data + r * row_stride, vocab, ks[r], ps[r], us[r], probs, scratch, sums, histogram);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_lite_C, m) {
  m.def("top_k_top_p_sample(Tensor logits, Tensor top_k, Tensor top_p, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) { m.impl("top_k_top_p_sample", &top_k_top_p_sample); }
