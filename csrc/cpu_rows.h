// Shared by the csrc CPU sources: row-parallel loops that stay on the calling thread for
// decode-sized work, and the argument checks of ops on float32/bfloat16 CPU rows.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

namespace vllm_lite_cpu {

// Below this many elements an op runs on the calling thread: ~10-20 us of work, about what
// waking a sleeping OpenMP thread costs.
constexpr int64_t kParallelElements = 1 << 16;

inline int threads_for(int64_t elements) {
  return elements >= kParallelElements ? at::get_num_threads() : 1;
}

// body(begin, end) over [0, rows): on the calling thread when threads == 1, else in one parallel
// region handing out chunks of kChunkRows dynamically (a thread that starts late, e.g. behind
// another process, takes fewer chunks instead of holding up the rest).
constexpr int64_t kChunkRows = 16;

template <typename Body>
void for_row_chunks(int64_t rows, int threads, const Body& body) {
  if (threads <= 1 || rows <= kChunkRows) return body(0, rows);
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t c = 0; c < chunks; ++c) body(c * kChunkRows, std::min(rows, (c + 1) * kChunkRows));
}

inline void check_float_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op, ": ", name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

}  // namespace vllm_lite_cpu
