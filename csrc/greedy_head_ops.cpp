// The fp32 LM head on CPU, from a layout of its own: the logits, or greedy sampling straight from
// the hidden states (each row's argmax over `hidden @ weight.T` without writing the logits).
//
//   pack_head_panels(weight) -> float32 [panels, K, 16]
//       the LM head's fp32 weight [N, K] as column panels of 16 vocabulary entries (k-major inside
//       a panel), zero-padded to a multiple of 32 entries: the layout both kernels stream.
//   head_logits(hidden, panels, vocab_size) -> float32 [rows, vocab_size]
//       hidden [rows, K] @ weight.T over the first `vocab_size` entries.
//   greedy_head(hidden, panels, vocab_size) -> int64 [rows]
//       the argmax of those logits, the first index of the maximum (torch.argmax's rule), as
//       argmax_rows over head_logits' output gives.
//
// Why: in an all-greedy decode step of a small model at a large batch, the LM head writes
// rows x vocab float32 logits (32 MB at 1,024 rows x 8,192) that the argmax then reads back once;
// greedy_head keeps each tile of logits in registers only. Each logit is one fp32 dot product
// summed in k order (fused multiply-adds), the same for a row whatever else is in the batch.
//
// Blocking: threads split the vocabulary (column groups of 2 vectors); each thread walks its
// columns in blocks that fit in L2, and for each block every tile of R rows (the hidden states,
// repacked once k-major per tile) against every column group of the block: R x 2 accumulators in
// registers, then the tile is stored (head_logits) or folded into a lane-wise running maximum per
// row (greedy_head), whose per-thread, per-lane maxima are merged at the end (ties: the smallest
// index).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_multiversion.h"
#include "cpu_vec.h"

namespace {

using namespace vllm_lite_cpu;

constexpr int64_t kPanel = 16;        // vocabulary entries per panel
constexpr int64_t kPadTo = 32;        // entries: a column group is 2 vectors of up to 16 lanes
constexpr int64_t kBlockBytes = 192 << 10;  // the weight a thread keeps in L2 while rows pass

// Rows per register tile: 2 accumulators a row, plus 2 weight vectors and a broadcast, within
// the vector registers of the level (32 on AVX-512, 16 below; at 6 rows GCC kept one AVX2
// accumulator on the stack in greedy_head, a store and reload every k).
template <int L>
constexpr int tile_rows() {
  return L == 16 ? 12 : 5;
}

// The height of the last tile for `rest` (< tile_rows) rows: the smallest of 1, 2, 4, 8 (and
// tile_rows) that holds them, so that a decode step of a few rows computes few padding rows.
inline int tail_rows(int64_t rest, int full) {
  for (const int height : {1, 2, 4, 8})
    if (rest <= height && height < full) return height;
  return full;
}

// Address of vector `v` (0 or 1) of column group `group`, at k = 0; consecutive k are 16 floats
// apart.
template <int L>
VLLM_LITE_INLINE const float* group_vector(const float* panels, int64_t group, int v, int64_t k_size) {
  const int64_t column = group * 2 * L + v * L;
  return panels + (column / kPanel) * k_size * kPanel + column % kPanel;
}

// One register tile: the rows of `xt` (k-major, R floats per k) times the 2L columns of `group`,
// written to `tile` (R x 2 vectors). Through memory, so that what the caller does with the tile
// takes no registers from the accumulators (it made GCC spill a weight vector in the k loop).
template <int L, int R>
VLLM_LITE_INLINE void tile_dot(const float* xt, const float* panels, int64_t group, int64_t k_size, float* tile) {
  typedef VecF<L> V;
  const float* w0 = group_vector<L>(panels, group, 0, k_size);
  const float* w1 = group_vector<L>(panels, group, 1, k_size);
  V acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = V{};
  for (int64_t k = 0; k < k_size; ++k) {
    const V a = load<V>(w0 + k * kPanel);
    const V b = load<V>(w1 + k * kPanel);
    const float* x = xt + k * R;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V xr = x[r] - V{};  // a broadcast (x - 0 is x, unlike 0 + x for x = -0)
      acc[r][0] += xr * a;
      acc[r][1] += xr * b;
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    store(tile + (2 * r) * L, acc[r][0]);
    store(tile + (2 * r + 1) * L, acc[r][1]);
  }
}

// tile_dot for a tile of `height` rows (tile_rows or a tail_rows height).
template <int L>
VLLM_LITE_INLINE void tile_dot_rows(int height, const float* xt, const float* panels, int64_t group, int64_t k_size,
                                    float* tile) {
  switch (height) {
    case 1: return tile_dot<L, 1>(xt, panels, group, k_size, tile);
    case 2: return tile_dot<L, 2>(xt, panels, group, k_size, tile);
    case 4: return tile_dot<L, 4>(xt, panels, group, k_size, tile);
    case 8:
      if constexpr (tile_rows<L>() > 8) return tile_dot<L, 8>(xt, panels, group, k_size, tile);
      [[fallthrough]];
    default: return tile_dot<L, tile_rows<L>()>(xt, panels, group, k_size, tile);
  }
}

// Where a tile's results go: the lane-wise running maximum of each row (best values / indices,
// L lanes a row), or the logits themselves.
struct ArgmaxSink {
  float* best_value;
  int32_t* best_tag;
};
struct LogitsSink {
  float* logits;
  int64_t stride;
};

// A lane keeps the best value among its columns and where it was: the tile's vector as
// 2 * group + v (the column is then (2 * group + v) * L + lane). A broadcast tag rather than an
// index vector keeps the constants of this step out of the registers of the k loop.
template <int L>
VLLM_LITE_INLINE void take_tile(float* tile, int64_t row, int rows, int64_t group, int64_t vocab_size,
                                const ArgmaxSink& sink) {
  typedef VecF<L> V;
  typedef VecI32<L> I;
  const int64_t past = (group + 1) * 2 * L - vocab_size;  // zero-padded columns in this group
  for (int r = 0; past > 0 && r < rows; ++r)
    for (int64_t j = 2 * L - past; j < 2 * L; ++j) tile[2 * r * L + j] = -std::numeric_limits<float>::infinity();
  for (int v = 0; v < 2; ++v) {
    const I tag = static_cast<int32_t>(2 * group + v) - I{};
    for (int r = 0; r < rows; ++r) {
      const V logits = load<V>(tile + (2 * r + v) * L);
      float* best_at = sink.best_value + (row + r) * L;
      int32_t* tag_at = sink.best_tag + (row + r) * L;
      const V best = load<V>(best_at);
      I best_tag;
      std::memcpy(&best_tag, tag_at, sizeof best_tag);
      const I greater = logits > best;
      store(best_at, greater ? logits : best);
      best_tag = greater ? tag : best_tag;
      std::memcpy(tag_at, &best_tag, sizeof best_tag);
    }
  }
}

template <int L>
VLLM_LITE_INLINE void take_tile(float* tile, int64_t row, int rows, int64_t group, int64_t vocab_size,
                                const LogitsSink& sink) {
  for (int v = 0; v < 2; ++v) {
    const int64_t column = group * 2 * L + v * L;
    const int64_t width = std::min<int64_t>(L, vocab_size - column);
    if (width <= 0) return;
    for (int r = 0; r < rows; ++r) {
      float* out = sink.logits + (row + r) * sink.stride + column;
      const float* values = tile + (2 * r + v) * L;
      if (width == L) {
        store(out, load<VecF<L>>(values));
      } else {
        std::memcpy(out, values, width * sizeof(float));
      }
    }
  }
}

// Column groups [group_begin, group_end) against every row: blocks of groups that stay in L2,
// each against every row tile in turn.
template <int L, typename Sink>
VLLM_LITE_INLINE void head_groups(const float* xt, int64_t rows, const float* panels, int64_t k_size,
                                  int64_t vocab_size, int64_t group_begin, int64_t group_end, const Sink& sink) {
  constexpr int R = tile_rows<L>();
  const int64_t group_bytes = k_size * 2 * L * static_cast<int64_t>(sizeof(float));
  const int64_t block = std::max<int64_t>(1, kBlockBytes / group_bytes);
  alignas(64) float tile[R * 2 * L];
  for (int64_t b = group_begin; b < group_end; b += block) {
    const int64_t b_end = std::min(group_end, b + block);
    for (int64_t r = 0; r < rows; r += R) {
      const int used = static_cast<int>(std::min<int64_t>(R, rows - r));
      const int height = used == R ? R : tail_rows(used, R);
      for (int64_t g = b; g < b_end; ++g) {
        tile_dot_rows<L>(height, xt + r * k_size, panels, g, k_size, tile);
        take_tile<L>(tile, r, used, g, vocab_size, sink);
      }
    }
  }
}

VLLM_LITE_PER_ISA(head_argmax_groups, (head_groups<L, ArgmaxSink>),
                  (const float* xt, int64_t rows, const float* panels, int64_t k_size, int64_t vocab_size,
                   int64_t group_begin, int64_t group_end, const ArgmaxSink& sink),
                  (xt, rows, panels, k_size, vocab_size, group_begin, group_end, sink))
VLLM_LITE_PER_ISA(head_logits_groups, (head_groups<L, LogitsSink>),
                  (const float* xt, int64_t rows, const float* panels, int64_t k_size, int64_t vocab_size,
                   int64_t group_begin, int64_t group_end, const LogitsSink& sink),
                  (xt, rows, panels, k_size, vocab_size, group_begin, group_end, sink))

int tile_rows_at_level() {
  switch (isa_lanes()) {
    case 16: return tile_rows<16>();
    case 8: return tile_rows<8>();
    default: return tile_rows<4>();
  }
}

at::Tensor pack_head_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "pack_head_panels takes a float32 CPU weight [vocab, hidden]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k_size = w.size(1);
  const int64_t padded = (n + kPadTo - 1) / kPadTo * kPadTo;
  at::Tensor panels = at::zeros({padded / kPanel, k_size, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = panels.data_ptr<float>();
  at::parallel_for(0, padded / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j)
        for (int64_t k = 0; k < k_size; ++k) dst[(p * k_size + k) * kPanel + j] = src[(p * kPanel + j) * k_size + k];
  });
  return panels;
}

void check_head_args(const at::Tensor& hidden, const at::Tensor& panels, int64_t vocab_size) {
  TORCH_CHECK(hidden.device().is_cpu() && hidden.scalar_type() == at::kFloat && hidden.dim() == 2,
              "the LM head kernels take float32 CPU hidden states [rows, hidden]");
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == at::kFloat && panels.dim() == 3 &&
                  panels.size(2) == kPanel && panels.size(1) == hidden.size(1) && panels.is_contiguous(),
              "panels must come from pack_head_panels for a weight of the hidden states' width");
  TORCH_CHECK(vocab_size > 0 && vocab_size <= panels.size(0) * kPanel && vocab_size <= INT32_MAX,
              "vocab_size must be within the packed weight's entries");
}

// The hidden states k-major per tile of R rows (the last tile `tail_rows` high, zero rows past
// the end), tile i from row i * R on: [rows rounded up to R, K] floats.
at::Tensor rows_by_tile(const at::Tensor& hidden, int R) {
  const at::Tensor x = hidden.contiguous();
  const int64_t rows = x.size(0), k_size = x.size(1);
  at::Tensor xt = at::zeros({(rows + R - 1) / R * R * k_size}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = xt.data_ptr<float>();
  for (int64_t first = 0; first < rows; first += R) {
    const int64_t used = std::min<int64_t>(R, rows - first);
    const int height = used == R ? R : tail_rows(used, R);
    float* tile = dst + first * k_size;
    for (int64_t r = 0; r < used; ++r)
      for (int64_t k = 0; k < k_size; ++k) tile[k * height + r] = src[(first + r) * k_size + k];
  }
  return xt;
}

// What both kernels set up before their threads run: the hidden states by tile, and the
// vocabulary's column groups, of which each thread takes a contiguous share.
struct HeadPass {
  at::Tensor xt;
  int64_t rows, k_size, lanes, groups;
  int threads;

  int64_t group_begin(int t) const { return groups * t / threads; }
  int64_t group_end(int t) const { return groups * (t + 1) / threads; }
};

HeadPass head_pass(const at::Tensor& hidden, const at::Tensor& panels, int64_t vocab_size) {
  check_head_args(hidden, panels, vocab_size);
  const int64_t lanes = isa_lanes();
  const int64_t groups = (vocab_size + 2 * lanes - 1) / (2 * lanes);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups)));
  return {rows_by_tile(hidden, tile_rows_at_level()), hidden.size(0), hidden.size(1), lanes, groups, threads};
}

at::Tensor greedy_head(const at::Tensor& hidden, const at::Tensor& panels, int64_t vocab_size) {
  const HeadPass pass = head_pass(hidden, panels, vocab_size);
  const int64_t rows = pass.rows, lanes = pass.lanes;
  at::Tensor out = at::empty({rows}, hidden.options().dtype(at::kLong));
  if (rows == 0) return out;
  at::Tensor best_value =
      at::full({pass.threads, rows, lanes}, -std::numeric_limits<float>::infinity(), hidden.options());
  at::Tensor best_tag = at::zeros({pass.threads, rows, lanes}, hidden.options().dtype(at::kInt));
  const float* xt_data = pass.xt.data_ptr<float>();
  const float* panel_data = panels.data_ptr<float>();
  float* value_data = best_value.data_ptr<float>();
  int32_t* tag_data = best_tag.data_ptr<int32_t>();
  const int64_t per_thread = rows * lanes;
  const int threads = pass.threads;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int t = 0; t < threads; ++t) {
    const ArgmaxSink sink{value_data + t * per_thread, tag_data + t * per_thread};
    head_argmax_groups(xt_data, rows, panel_data, pass.k_size, vocab_size, pass.group_begin(t), pass.group_end(t),
                       sink);
  }
  // Each (thread, lane) holds the first maximum of its columns: the answer is the largest value,
  // ties to the smallest column.
  int64_t* result = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    float best = value_data[r * lanes];
    int64_t index = static_cast<int64_t>(tag_data[r * lanes]) * lanes;
    for (int t = 0; t < threads; ++t) {
      const float* values = value_data + t * per_thread + r * lanes;
      const int32_t* tags = tag_data + t * per_thread + r * lanes;
      for (int j = 0; j < lanes; ++j) {
        const int64_t column = static_cast<int64_t>(tags[j]) * lanes + j;
        if (values[j] > best || (values[j] == best && column < index)) {
          best = values[j];
          index = column;
        }
      }
    }
    result[r] = index;
  }
  return out;
}

at::Tensor head_logits(const at::Tensor& hidden, const at::Tensor& panels, int64_t vocab_size) {
  const HeadPass pass = head_pass(hidden, panels, vocab_size);
  at::Tensor logits = at::empty({pass.rows, vocab_size}, hidden.options());
  if (pass.rows == 0) return logits;
  const float* xt_data = pass.xt.data_ptr<float>();
  const float* panel_data = panels.data_ptr<float>();
  const LogitsSink sink{logits.data_ptr<float>(), vocab_size};
  const int threads = pass.threads;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int t = 0; t < threads; ++t)
    head_logits_groups(xt_data, pass.rows, panel_data, pass.k_size, vocab_size, pass.group_begin(t),
                       pass.group_end(t), sink);
  return logits;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_lite_C, m) {
  m.def("pack_head_panels(Tensor weight) -> Tensor");
  m.def("greedy_head(Tensor hidden, Tensor panels, int vocab_size) -> Tensor");
  m.def("head_logits(Tensor hidden, Tensor panels, int vocab_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) {
  m.impl("pack_head_panels", &pack_head_panels);
  m.impl("greedy_head", &greedy_head);
  m.impl("head_logits", &head_logits);
}
