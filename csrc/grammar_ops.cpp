// Native CPU op for structured outputs: the grammar bitmask applied to the constrained rows'
// logits, in place.
//
//   apply_token_bitmask_inplace(logits, bitmask, rows) -> ()
//
// logits: float32 [num_rows, vocab] (contiguous last dimension); bitmask: int32 [m, words] with
// bit `t % 32` of word `t // 32` set = token t allowed (xgrammar's layout); rows: int64 [m], the
// logits row of each bitmask row. Tokens past words * 32 (logits padded beyond the tokenizer's
// vocabulary) are never allowed. Only the m rows are read and written: one pass over each, a
// word of the mask per 32 logits, no temporaries (the torch fallback unpacks the bits into a
// bool [m, vocab] tensor and gathers / scatters the rows).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu_multiversion.h"

namespace {

VLLM_LITE_MULTIVERSION
void mask_row(float* logits, const int32_t* words, int64_t vocab, int64_t num_words) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t covered = num_words * 32 < vocab ? num_words * 32 : vocab;
  const int64_t full_words = covered / 32;
  for (int64_t w = 0; w < full_words; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    if (word == 0xFFFFFFFFu) continue;  // all 32 allowed (common in free text): nothing to write
    float* chunk = logits + w * 32;
    for (int b = 0; b < 32; ++b) chunk[b] = ((word >> b) & 1u) ? chunk[b] : neg_inf;
  }
  for (int64_t t = full_words * 32; t < covered; ++t)
    if (!((static_cast<uint32_t>(words[t / 32]) >> (t % 32)) & 1u)) logits[t] = neg_inf;
  for (int64_t t = covered; t < vocab; ++t) logits[t] = neg_inf;
}

void apply_token_bitmask_inplace(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be float32 [rows, vocab] with a contiguous last dimension");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "bitmask must be contiguous int32 [m, words]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == bitmask.size(0),
              "rows must be contiguous int64 [m], one per bitmask row");
  const int64_t num_rows = logits.size(0), vocab = logits.size(1), num_words = bitmask.size(1);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < num_rows, "rows[", i, "] = ", row_ids[i],
                " is outside the logits' ", num_rows, " rows");
  float* data = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  const int32_t* masks = bitmask.data_ptr<int32_t>();
  // A row is one memory pass (~20 us at a 49k vocabulary): threads only pay off for many rows,
  // so each thread gets at least ~1M logits.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(vocab, 1));
  at::parallel_for(0, rows.numel(), grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      mask_row(data + row_ids[i] * row_stride, masks + i * num_words, vocab, num_words);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_lite_C, m) {
  m.def("apply_token_bitmask_inplace(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) { m.impl("apply_token_bitmask_inplace", &apply_token_bitmask_inplace); }
