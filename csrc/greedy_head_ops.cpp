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
//   pack_head_screen(weight) -> (int16 codes, float32 stats)   [AVX-512 VNNI or AVX2: head_screen_supported()]
//   greedy_head_screened(hidden, panels, codes, stats, vocab_size) -> int64 [rows]
//       greedy_head's tokens, bit for bit, from int16 estimates first (see its section below).
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
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>
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

// The vocabulary's column groups, of which each thread takes a contiguous share, in column order
// (the merges of the threads' results rely on it: a later thread's columns are larger).
struct GroupShares {
  int64_t groups;
  int threads;

  int64_t group_begin(int t) const { return groups * t / threads; }
  int64_t group_end(int t) const { return groups * (t + 1) / threads; }
};

GroupShares group_shares(int64_t groups) {
  return {groups, static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups)))};
}

// What greedy_head and head_logits set up before their threads run: the hidden states by tile,
// and the column groups' shares.
struct HeadPass : GroupShares {
  at::Tensor xt;
  int64_t rows, k_size, lanes;
};

HeadPass head_pass(const at::Tensor& hidden, const at::Tensor& panels, int64_t vocab_size) {
  check_head_args(hidden, panels, vocab_size);
  const int64_t lanes = isa_lanes();
  return {group_shares((vocab_size + 2 * lanes - 1) / (2 * lanes)), rows_by_tile(hidden, tile_rows_at_level()),
          hidden.size(0), hidden.size(1), lanes};
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

// ---- greedy_head_screened: the same tokens, from int16 dot products first (AVX-512 VNNI, AVX2) ----
//
// Each row's logits are first estimated from int16 codes of the hidden row (per-row scale) and
// of the weight (per-column scale): exact int32 dot products, by vpdpwssd on AVX-512 VNNI (twice
// the multiply-adds of an fp32 FMA per instruction) or by vpmaddwd + vpaddd on AVX2 (16
// multiply-adds per pair of instructions against an FMA's 8; measured 1.4-1.7x greedy_head on
// Zen 3), over half the weight's bytes. E (per row) bounds
// how far an estimate can be from the fp32 logit greedy_head computes: the rounding of both
// codes, the fp32 dot product's own rounding and the estimate's. A column can be the row's first
// maximum only if its estimate is within 2E of the largest estimate; those candidates (one to a
// few a row) are computed again with greedy_head's arithmetic (tile_dot: one FMA chain per column
// in k order), which decides. A row whose candidates overflow the list, or which the bound cannot
// cover (not finite, zero, large enough to overflow a logit), is computed exactly over its whole
// share. So the tokens are greedy_head's, bit for bit. (int8 codes, 4x the multiply-adds, were
// tried first: the proven bound is ~10x the actual error, which at 576 -> 49,152 left ~38
// candidates a row.)

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VLLM_LITE_SCREEN 1
#include <immintrin.h>
#define VLLM_LITE_SCREEN_TARGET __attribute__((target("arch=x86-64-v4,avx512vnni")))
#else
#define VLLM_LITE_SCREEN 0
#endif

// Rows per tile of the hidden states' codes: a VNNI tile (2 accumulators a row, as the fp32
// tile); on AVX2 four tiles of kScreenRowsAvx2 rows against a whole column group (4 accumulators
// of 8 columns a row, a broadcast, the weight vectors as memory operands: 13 of the 16
// registers). 3 x 32 ran ~10% faster than 6 x 16 on Zen 3 (a broadcast serves 4 vectors, not 2).
constexpr int kScreenRows = 12;
constexpr int kScreenRowsAvx2 = 3;
constexpr int64_t kCandidates = 128;  // per row and thread; past this the row is computed exactly
// A recomputed column costs about this many of greedy_head's: one row's FMA chains wait on their
// latency where a 12-row tile keeps 24 going.
constexpr double kRecomputeCost = 4.0;
constexpr int kStats = 4;           // pack_head_screen's stats rows (see there)

// The codes' largest magnitude for hidden size K: K * max^2 < 2^31, so that every int32 sum of
// K products (and every partial sum) is exact.
inline float screen_max_code(int64_t k_size) {
  return static_cast<float>(std::min<int64_t>(32767, static_cast<int64_t>(std::sqrt(2147483647.0 / k_size))));
}

// One value's int16 code at `scale` (round(v / scale), clamped to +-max_code) and what the code
// leaves out, v - scale * code: the rule of both the weight's columns and the hidden rows.
struct ScreenCode {
  int code;
  double residual;
};

VLLM_LITE_INLINE ScreenCode screen_code(float value, float scale, float max_code) {
  const int code = static_cast<int>(std::nearbyint(std::min(max_code, std::max(-max_code, value / scale))));
  return {code, value - static_cast<double>(scale) * code};
}

// The screen's vector width: 16 on AVX-512 with VNNI, 8 where AVX2 is the level (an AVX-512 CPU
// without VNNI keeps greedy_head: half-width integer code would not beat its 16-lane FMAs), else
// 0 (no screen).
int screen_lanes() {
  if (!VLLM_LITE_SCREEN) return 0;
  if (cpu_has_avx512_vnni()) return 16;
  return isa_lanes() == 8 ? 8 : 0;
}

bool screen_supported() { return screen_lanes() != 0; }

// The weight's int16 codes, per column: scale = max|w| / max_code, codes = round(w / scale); laid
// out by column group (32 columns) and k pair: [groups][k pairs][2 vectors][16 columns][2 codes].
// stats [4, padded columns]: the scale and the column's parts of the error bound
// (quantize_screen_row): |w - scale * codes|_2, scale * |codes|_2, max_code * gamma_K * |w|_1.
std::tuple<at::Tensor, at::Tensor> pack_head_screen(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "pack_head_screen takes a float32 CPU weight [vocab, hidden]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k_size = w.size(1), pairs = (k_size + 1) / 2;
  TORCH_CHECK(k_size <= 65536, "pack_head_screen: hidden size ", k_size, " past 65,536");
  const int64_t padded = (n + kPadTo - 1) / kPadTo * kPadTo;
  const float max_code = screen_max_code(k_size);
  at::Tensor codes = at::zeros({padded / kPadTo, pairs, 2, 16, 2}, w.options().dtype(at::kShort));
  at::Tensor stats = at::zeros({kStats, padded}, w.options());
  const float* src = w.data_ptr<float>();
  int16_t* dst = codes.data_ptr<int16_t>();
  float* st = stats.data_ptr<float>();
  const double gamma = k_size * std::ldexp(1.0, -24) / (1 - k_size * std::ldexp(1.0, -24));
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const float* row = src + c * k_size;
      float max_abs = 0.f;
      double l1 = 0.0;
      for (int64_t k = 0; k < k_size; ++k) {
        max_abs = std::max(max_abs, std::fabs(row[k]));
        l1 += std::fabs(row[k]);
      }
      const float scale = max_abs > 0.f ? max_abs / max_code : 1.f;
      double residual2 = 0.0, code2 = 0.0;
      int16_t* column = dst + (c / kPadTo) * pairs * 64 + ((c % kPadTo) / 16) * 32 + (c % 16) * 2;
      for (int64_t k = 0; k < k_size; ++k) {
        const ScreenCode q = screen_code(row[k], scale, max_code);
        column[(k / 2) * 64 + k % 2] = static_cast<int16_t>(q.code);
        residual2 += q.residual * q.residual;
        code2 += static_cast<double>(q.code) * q.code;
      }
      const double up = 1 + std::ldexp(1.0, -16);  // (each rounded up a little: they bound)
      st[c] = scale;
      st[padded + c] = static_cast<float>(std::sqrt(residual2) * up);
      st[2 * padded + c] = static_cast<float>(scale * std::sqrt(code2) * up);
      st[3 * padded + c] = static_cast<float>(max_code * gamma * l1 * up);
    }
  });
  return {codes, stats};
}

#if VLLM_LITE_SCREEN
// One thread's state for one row: the largest estimate so far, the threshold below which no
// column can win, and the candidates above it (in column order).
struct ScreenRow {
  float max_estimate, threshold, error;  // threshold = max_estimate - 2 * error (lowered a little)
  int32_t count;
  bool exact;  // candidates overflowed, or the row is not finite: compute the whole share
};

VLLM_LITE_INLINE float lowered(float threshold) {  // below by a relative 2^-20: fp32 rounding of the subtraction
  return threshold - std::fabs(threshold) * 0x1p-20f;
}

// The hidden rows' int16 codes, 2 to a 32-bit word, k-pair major per tile of kScreenRows rows:
// [tiles][pairs][kScreenRows] words; and each row's error bound (or `exact`).
struct ScreenRows {
  std::vector<uint32_t> words;
  std::vector<ScreenRow> rows;
};

// The column terms' maxima over the vocabulary, for each row's bound.
struct ColumnBounds {
  double scale, residual, codes, rounding;
};

VLLM_LITE_SCREEN_TARGET void quantize_screen_row_avx512(const float* row, int64_t r, int64_t k_size,
                                                         const ColumnBounds& columns, ScreenRows& out);
VLLM_LITE_TARGET_AVX2 void quantize_screen_row_avx2(const float* row, int64_t r, int64_t k_size,
                                                    const ColumnBounds& columns, ScreenRows& out);

// `lanes`: the screen's width (screen_lanes()), which picks the level the rows are coded at.
ScreenRows quantize_screen_rows(const float* x, int64_t rows, int64_t k_size, const ColumnBounds& columns,
                                int lanes) {
  const int64_t pairs = (k_size + 1) / 2, tiles = (rows + kScreenRows - 1) / kScreenRows;
  ScreenRows out{std::vector<uint32_t>(tiles * pairs * kScreenRows, 0u), std::vector<ScreenRow>(rows)};
  const auto quantize = lanes == 16 ? quantize_screen_row_avx512 : quantize_screen_row_avx2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize(x + r * k_size, r, k_size, columns, out);
  });
  return out;
}

// One row's codes and bound; the same arithmetic at either level (each wrapper below compiles it
// for its own, so that the rounding and the products are instructions, not library calls).
VLLM_LITE_INLINE void quantize_screen_row(const float* row, int64_t r, int64_t k_size, const ColumnBounds& columns,
                                          ScreenRows& out) {
  const int64_t pairs = (k_size + 1) / 2;
  const float max_code = screen_max_code(k_size);
  float max_abs = 0.f;
  bool finite = true;
  for (int64_t k = 0; k < k_size; ++k) {
    finite &= std::isfinite(row[k]);
    max_abs = std::max(max_abs, std::fabs(row[k]));
  }
  ScreenRow& state = out.rows[r];
  state = {-std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), 0.f, 0, false};
  // Not finite, zero, or so large that a logit could overflow fp32 (where the bound no longer
  // holds): the row is computed exactly.
  if (!finite || !(max_abs > 1e-30f) || double(max_abs) * columns.scale * max_code * k_size > 1e36) {
    state.exact = true;
    return;
  }
  const float scale = max_abs / max_code;
  int16_t* halves = reinterpret_cast<int16_t*>(out.words.data() + (r / kScreenRows) * pairs * kScreenRows);
  double norm2 = 0.0, residual2 = 0.0;
  for (int64_t k = 0; k < k_size; ++k) {
    const ScreenCode q = screen_code(row[k], scale, max_code);
    halves[((k / 2) * kScreenRows + r % kScreenRows) * 2 + k % 2] = static_cast<int16_t>(q.code);
    norm2 += static_cast<double>(row[k]) * row[k];
    residual2 += q.residual * q.residual;
  }
  // With x = s q + e and w = t p + f (codes q, p; residuals e, f), the real logit x.w is
  // s t q.p + x.f + e.(t p): by Cauchy-Schwarz within |x|_2 |f|_2 + |e|_2 |t p|_2 of s times the
  // estimate t q.p. The fp32 dot product is within gamma_K |x|_inf |w|_1 of the real one, and the
  // estimate's own fp32 rounding (the int32 sum's conversion, the scaling) within
  // t * K * max_code^2 * 2^-22. All of it over s: the estimates' units.
  const double bound = (std::sqrt(norm2) * columns.residual + std::sqrt(residual2) * columns.codes) / scale +
                       columns.rounding + columns.scale * k_size * max_code * max_code * std::ldexp(1.0, -22);
  state.error = static_cast<float>(bound * (1 + std::ldexp(1.0, -10)));
  if (!std::isfinite(state.error)) state.exact = true;
}

VLLM_LITE_SCREEN_TARGET void quantize_screen_row_avx512(const float* row, int64_t r, int64_t k_size,
                                                         const ColumnBounds& columns, ScreenRows& out) {
  quantize_screen_row(row, r, k_size, columns, out);
}

VLLM_LITE_TARGET_AVX2 void quantize_screen_row_avx2(const float* row, int64_t r, int64_t k_size,
                                                    const ColumnBounds& columns, ScreenRows& out) {
  quantize_screen_row(row, r, k_size, columns, out);
}

// One row's candidates in one column group: the live lanes of `estimates` (32 columns from
// `column0` on) at or above the row's threshold, `above` (the lanes at or above it before
// `tile_max`, the group's largest estimate, raised it). Both levels' tiles end here.
VLLM_LITE_INLINE void take_candidates(ScreenRow& state, const float* estimates, uint32_t above, float tile_max,
                                      int64_t column0, float* values, int32_t* columns) {
  if (tile_max > state.max_estimate) {
    state.max_estimate = tile_max;
    state.threshold = lowered(tile_max - 2 * state.error);
  }
  while (above && !state.exact) {
    const int lane = __builtin_ctz(above);
    above &= above - 1;
    if (!(estimates[lane] >= state.threshold)) continue;
    if (state.count == kCandidates) {  // drop those the threshold has passed since
      int32_t kept = 0;
      for (int32_t i = 0; i < state.count; ++i)
        if (values[i] >= state.threshold) {
          values[kept] = values[i];
          columns[kept++] = columns[i];
        }
      state.count = kept;
      if (kept == kCandidates) {
        state.exact = true;
        break;
      }
    }
    values[state.count] = estimates[lane];
    columns[state.count++] = static_cast<int32_t>(column0 + lane);
  }
}

// One tile of R rows against column group `group`: exact int32 sums of row code * column code,
// then the estimates (times the column scales) compared with each row's threshold; a row with a
// lane at or above it takes the slow path.
template <int R>
VLLM_LITE_INLINE VLLM_LITE_SCREEN_TARGET void screen_tile(const uint32_t* words, const int16_t* codes, const float* stats,
                                                          int64_t padded, int64_t pairs, int64_t group, int64_t row0,
                                                          int used, int64_t vocab_size, ScreenRow* states,
                                                          float* cand_value, int32_t* cand_column) {
  __m512i acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  const int16_t* w = codes + group * pairs * 64;
  for (int64_t q = 0; q < pairs; ++q) {
    const __m512i a = _mm512_loadu_si512(w + q * 64);
    const __m512i b = _mm512_loadu_si512(w + q * 64 + 32);
    const uint32_t* x = words + q * kScreenRows;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512i xr = _mm512_set1_epi32(static_cast<int>(x[r]));
      acc[r][0] = _mm512_dpwssd_epi32(acc[r][0], xr, a);
      acc[r][1] = _mm512_dpwssd_epi32(acc[r][1], xr, b);
    }
  }
  // Through memory: indexing the accumulators by the run-time row count below made GCC keep
  // them on the stack, a store per accumulator every k pair.
  alignas(64) int32_t sums[R][2][16];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_store_si512(sums[r][0], acc[r][0]);
    _mm512_store_si512(sums[r][1], acc[r][1]);
  }
  const int64_t column0 = group * 32;
  __m512 scale[2];
  for (int v = 0; v < 2; ++v) scale[v] = _mm512_loadu_ps(stats + column0 + 16 * v);
  // Padding columns past the vocabulary must never raise a row's maximum.
  const int64_t live = std::min<int64_t>(32, vocab_size - column0);
  const __mmask16 live_mask[2] = {static_cast<__mmask16>(live >= 16 ? 0xffff : (1u << live) - 1),
                                  static_cast<__mmask16>(live >= 32 ? 0xffff : live <= 16 ? 0 : (1u << (live - 16)) - 1)};
  for (int r = 0; r < used; ++r) {
    ScreenRow& state = states[row0 + r];
    __m512 estimate[2];
    __mmask16 above[2];
    for (int v = 0; v < 2; ++v) {
      estimate[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[r][v])), scale[v]);
      above[v] = _mm512_mask_cmp_ps_mask(live_mask[v], estimate[v], _mm512_set1_ps(state.threshold), _CMP_GE_OQ);
    }
    if (!(above[0] | above[1]) || state.exact) continue;
    const float tile_max = std::max(_mm512_mask_reduce_max_ps(live_mask[0], estimate[0]),
                                    _mm512_mask_reduce_max_ps(live_mask[1], estimate[1]));
    alignas(64) float lanes[32];
    _mm512_store_ps(lanes, estimate[0]);
    _mm512_store_ps(lanes + 16, estimate[1]);
    take_candidates(state, lanes, above[0] | (static_cast<uint32_t>(above[1]) << 16), tile_max, column0,
                    cand_value + (row0 + r) * kCandidates, cand_column + (row0 + r) * kCandidates);
  }
}

VLLM_LITE_SCREEN_TARGET void screen_tile_rows_avx512(int height, const uint32_t* words, const int16_t* codes,
                                                      const float* stats, int64_t padded, int64_t pairs,
                                                      int64_t group, int64_t row0, int used, int64_t vocab_size,
                                                      ScreenRow* states, float* cand_value, int32_t* cand_column) {
  switch (height) {
    case 1: return screen_tile<1>(words, codes, stats, padded, pairs, group, row0, used, vocab_size, states, cand_value, cand_column);
    case 2: return screen_tile<2>(words, codes, stats, padded, pairs, group, row0, used, vocab_size, states, cand_value, cand_column);
    case 4: return screen_tile<4>(words, codes, stats, padded, pairs, group, row0, used, vocab_size, states, cand_value, cand_column);
    case 8: return screen_tile<8>(words, codes, stats, padded, pairs, group, row0, used, vocab_size, states, cand_value, cand_column);
    default: return screen_tile<kScreenRows>(words, codes, stats, padded, pairs, group, row0, used, vocab_size, states, cand_value, cand_column);
  }
}

// ---- the AVX2 tile: R rows (at `first` of a kScreenRows tile) against the 32 columns of `group`
// (8 to a register), into `sums`. ----
template <int R>
VLLM_LITE_INLINE VLLM_LITE_TARGET_AVX2 void screen_sums_avx2(const uint32_t* words, const int16_t* codes, int64_t pairs,
                                                            int64_t group, int first, int32_t (*sums)[32]) {
  __m256i acc[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_si256();
  const int16_t* w = codes + group * pairs * 64;
  for (int64_t q = 0; q < pairs; ++q) {
    const uint32_t* x = words + q * kScreenRows + first;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256i xr = _mm256_set1_epi32(static_cast<int>(x[r]));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        acc[r][j] = _mm256_add_epi32(
            acc[r][j], _mm256_madd_epi16(xr, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + q * 64 + 16 * j))));
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(sums[first + r] + 8 * j), acc[r][j]);
}

// screen_tile's AVX2 counterpart for a tile of `height` rows (`used` of them real).
VLLM_LITE_TARGET_AVX2 void screen_tile_rows_avx2(int height, const uint32_t* words, const int16_t* codes,
                                                 const float* stats, int64_t padded, int64_t pairs, int64_t group,
                                                 int64_t row0, int used, int64_t vocab_size, ScreenRow* states,
                                                 float* cand_value, int32_t* cand_column) {
  alignas(32) int32_t sums[kScreenRows][32];
  for (int first = 0; first < height; first += kScreenRowsAvx2) {
    const int rest = std::min(kScreenRowsAvx2, height - first);
    if (rest > 2) {
      screen_sums_avx2<3>(words, codes, pairs, group, first, sums);
    } else if (rest == 2) {
      screen_sums_avx2<2>(words, codes, pairs, group, first, sums);
    } else {
      screen_sums_avx2<1>(words, codes, pairs, group, first, sums);
    }
  }
  const int64_t column0 = group * 32;
  // Padding columns past the vocabulary must never raise a row's maximum.
  const int64_t live = std::min<int64_t>(32, vocab_size - column0);
  const uint32_t live_bits = live >= 32 ? 0xffffffffu : (1u << live) - 1;
  __m256 scale[4];
  for (int j = 0; j < 4; ++j) scale[j] = _mm256_loadu_ps(stats + column0 + 8 * j);
  for (int r = 0; r < used; ++r) {
    ScreenRow& state = states[row0 + r];
    if (state.exact) continue;
    const __m256 threshold = _mm256_set1_ps(state.threshold);
    alignas(32) float lanes[32];
    uint32_t above = 0;
    for (int j = 0; j < 4; ++j) {
      const __m256i sum = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums[r] + 8 * j));
      const __m256 estimate = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), scale[j]);
      _mm256_store_ps(lanes + 8 * j, estimate);
      above |= static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(estimate, threshold, _CMP_GE_OQ))) << (8 * j);
    }
    above &= live_bits;
    if (!above) continue;
    float tile_max = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < live; ++j) tile_max = std::max(tile_max, lanes[j]);
    take_candidates(state, lanes, above, tile_max, column0, cand_value + (row0 + r) * kCandidates,
                    cand_column + (row0 + r) * kCandidates);
  }
}

// The fp32 logits of row `x` over the 32 columns of `group`, by greedy_head's arithmetic at the
// level (tile_dot: one FMA chain per column in k order, as greedy_head's tiles at any width).
VLLM_LITE_SCREEN_TARGET void exact_group_avx512(const float* x, const float* panels, int64_t group, int64_t k_size,
                                                float* logits) {
  tile_dot<16, 1>(x, panels, group, k_size, logits);
}

VLLM_LITE_TARGET_AVX2 void exact_group_avx2(const float* x, const float* panels, int64_t group, int64_t k_size,
                                            float* logits) {
  tile_dot<8, 1>(x, panels, 2 * group, k_size, logits);  // (8-lane groups: 16 columns each)
  tile_dot<8, 1>(x, panels, 2 * group + 1, k_size, logits + 16);
}

// The first maximum of row `x`'s fp32 logits over the columns (candidates, or every column of
// [group_begin, group_end)). `recomputed`: the columns computed again (a group of 32 at a time).
struct Best {
  float value;
  int64_t column;
};

template <int L>
Best exact_best(const float* x, const float* panels, int64_t k_size, int64_t vocab_size, const ScreenRow& state,
                const float* values, const int32_t* columns, int64_t group_begin, int64_t group_end,
                int64_t& recomputed) {
  const auto exact_group = L == 16 ? exact_group_avx512 : exact_group_avx2;
  alignas(64) float logits[32];
  Best best{-std::numeric_limits<float>::infinity(), -1};
  if (state.exact || !std::isfinite(state.threshold)) {
    recomputed += (group_end - group_begin) * 32;
    for (int64_t g = group_begin; g < group_end; ++g) {
      exact_group(x, panels, g, k_size, logits);
      for (int64_t j = 0; j < 32 && g * 32 + j < vocab_size; ++j)
        if (logits[j] > best.value) best = {logits[j], g * 32 + j};
    }
    return best;
  }
  int64_t computed = -1;
  for (int32_t i = 0; i < state.count; ++i) {
    if (values[i] < state.threshold) continue;
    const int64_t group = columns[i] / 32;
    if (group != computed) {
      exact_group(x, panels, group, k_size, logits);
      computed = group;
      recomputed += 32;
    }
    const float value = logits[columns[i] % 32];
    if (value > best.value) best = {value, columns[i]};
  }
  return best;
}

// One thread's share of the column groups at the screen's width L: every row tile against each
// L2 block of the share, then each row's candidates computed again.
template <int L>
void screen_share(const ScreenRows& quantized, const float* x, int64_t rows, int64_t k_size, const float* panels,
                  const int16_t* codes, const float* stats, int64_t padded, int64_t vocab_size, int64_t group_begin,
                  int64_t group_end, Best* best, int64_t& recomputed) {
  const auto screen_tiles = L == 16 ? screen_tile_rows_avx512 : screen_tile_rows_avx2;
  const int64_t pairs = (k_size + 1) / 2;
  std::vector<ScreenRow> states(quantized.rows);
  std::vector<float> cand_value(rows * kCandidates);
  std::vector<int32_t> cand_column(rows * kCandidates);
  const int64_t block = std::max<int64_t>(1, kBlockBytes / (pairs * 128));
  for (int64_t b = group_begin; b < group_end; b += block) {
    const int64_t b_end = std::min(group_end, b + block);
    for (int64_t r = 0; r < rows; r += kScreenRows) {
      const int used = static_cast<int>(std::min<int64_t>(kScreenRows, rows - r));
      const int height = used == kScreenRows ? kScreenRows : tail_rows(used, kScreenRows);
      const uint32_t* words = quantized.words.data() + r * pairs;
      for (int64_t g = b; g < b_end; ++g)
        screen_tiles(height, words, codes, stats, padded, pairs, g, r, used, vocab_size, states.data(),
                     cand_value.data(), cand_column.data());
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    ScreenRow& state = states[r];
    state.threshold = lowered(state.max_estimate - 2 * state.error);
    best[r] = exact_best<L>(x + r * k_size, panels, k_size, vocab_size, state, cand_value.data() + r * kCandidates,
                            cand_column.data() + r * kCandidates, group_begin, group_end, recomputed);
  }
}
#endif

// Returns the tokens and the recomputation's cost as a share of greedy_head's over the same rows
// (kRecomputeCost per column recomputed): where it nears the screen's own saving (about half),
// the screen does not pay for these hidden states (head_panels.py then stops taking it).
std::tuple<at::Tensor, double> greedy_head_screened(const at::Tensor& hidden, const at::Tensor& panels,
                                                    const at::Tensor& codes, const at::Tensor& stats,
                                                    int64_t vocab_size) {
  check_head_args(hidden, panels, vocab_size);
  const int64_t rows = hidden.size(0), k_size = hidden.size(1), pairs = (k_size + 1) / 2;
  const int64_t padded = panels.size(0) * kPanel;
  TORCH_CHECK(codes.scalar_type() == at::kShort && codes.is_contiguous() && codes.numel() == padded / kPadTo * pairs * 64,
              "codes must come from pack_head_screen for the same weight");
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.is_contiguous() && stats.dim() == 2 &&
                  stats.size(0) == kStats && stats.size(1) == padded,
              "stats must come from pack_head_screen for the same weight");
  TORCH_CHECK(screen_supported(), "greedy_head_screened needs AVX-512 with VNNI or AVX2 (head_screen_supported())");
  TORCH_CHECK(k_size <= 65536, "greedy_head_screened: hidden size ", k_size, " past 65,536 (int32 sums)");
  at::Tensor out = at::empty({rows}, hidden.options().dtype(at::kLong));
  double cost = 0.0;
#if VLLM_LITE_SCREEN
  if (rows == 0) return {out, cost};
  const at::Tensor x = hidden.contiguous();
  const float* st = stats.data_ptr<float>();
  auto column_max = [&](int row) { return static_cast<double>(*std::max_element(st + row * padded, st + row * padded + vocab_size)); };
  const ColumnBounds bounds{column_max(0), column_max(1), column_max(2), column_max(3)};
  const int lanes = screen_lanes();
  const ScreenRows quantized = quantize_screen_rows(x.data_ptr<float>(), rows, k_size, bounds, lanes);
  const GroupShares shares = group_shares((vocab_size + 31) / 32);
  const int threads = shares.threads;
  std::vector<Best> best(threads * rows);
  std::vector<int64_t> recomputed(threads, 0);
  const auto share = lanes == 16 ? screen_share<16> : screen_share<8>;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int t = 0; t < threads; ++t)
    share(quantized, x.data_ptr<float>(), rows, k_size, panels.data_ptr<float>(), codes.data_ptr<int16_t>(), st,
          padded, vocab_size, shares.group_begin(t), shares.group_end(t), best.data() + t * rows, recomputed[t]);
  for (const int64_t columns : recomputed) cost += kRecomputeCost * columns;
  cost /= static_cast<double>(rows) * shares.groups * 32;
  int64_t* result = out.data_ptr<int64_t>();
  // greedy_head's rule: the first column above -inf with the largest value (NaN never is), else 0;
  // threads hold increasing columns, so a later one wins only if larger.
  for (int64_t r = 0; r < rows; ++r) {
    Best winner{-std::numeric_limits<float>::infinity(), 0};
    for (int t = 0; t < threads; ++t)
      if (best[t * rows + r].value > winner.value) winner = best[t * rows + r];
    result[r] = winner.column;
  }
#endif
  return {out, cost};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_lite_C, m) {
  m.def("pack_head_panels(Tensor weight) -> Tensor");
  m.def("greedy_head(Tensor hidden, Tensor panels, int vocab_size) -> Tensor");
  m.def("head_logits(Tensor hidden, Tensor panels, int vocab_size) -> Tensor");
  m.def("pack_head_screen(Tensor weight) -> (Tensor, Tensor)");
  m.def("greedy_head_screened(Tensor hidden, Tensor panels, Tensor codes, Tensor stats, int vocab_size) -> (Tensor, float)");
  m.def("head_screen_supported() -> bool", [] { return screen_supported(); });
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) {
  m.impl("pack_head_panels", &pack_head_panels);
  m.impl("greedy_head", &greedy_head);
  m.impl("head_logits", &head_logits);
  m.impl("pack_head_screen", &pack_head_screen);
  m.impl("greedy_head_screened", &greedy_head_screened);
}
