// int8 matmuls on AMX tiles (CPUs with AMX-INT8), for the W8A8 linear layers (quantization="int8"):
//
//   amx_int8_mm(xq, packed_weight, out_features) -> acc
//       acc [M, N] int32 = xq [M, K] int8 @ W^T, W [N, K] int8: exact integer sums, as
//       torch._int_mm gives them (the dynamic quantization's two ends stay int8_ops.cpp's).
//   amx_int8_usable() -> bool
//       whether this CPU has AMX-INT8 and the process may use it.
//
// packed_weight is W zero-padded to multiples of 32 rows and 64 columns and laid out as
// [N/32][K/64][16 k-quads][32 n][4 k] (model/layers/quantization.py packs it): a tdpbssd B tile
// holds 16 rows of 16 columns x 4 consecutive k, so the two B tiles of one 32-column block are
// the two halves of its 128-byte rows, and one block's tiles over all of K are one contiguous
// stretch of memory, which a thread streams start to end (bf16_linear_ops.cpp's scheme, with
// four int8 values where it has two bf16).
//
// Why not torch._int_mm: its weight is not packed ahead, and at decode sizes it streamed the int8
// weights at half the rate the bf16 tiles stream bf16 ones: int8 decode was no faster than bf16
// although it reads half the bytes (benchmarks/RESULTS.md, fifty-fourth session).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "cpu_amx.h"

namespace {

using namespace vllm_lite_cpu;  // NOLINT: cpu_amx.h's helpers

constexpr int64_t kTileRows = 16;                      // rows of every tile; columns of a C tile
constexpr int64_t kBlockK = 64;                        // int8 values of K per tile row
constexpr int64_t kBlockN = 32;                        // output columns per packed block: two C tiles
constexpr int64_t kBlockElements = kBlockN * kBlockK;  // 2 KB of weights per (column block, K block)
constexpr int64_t kTileElements = kTileRows * kBlockK;
constexpr int64_t kPrefetchBlocks = 4;

struct Operands {
  const int8_t* x_tiles;  // [row tiles][K blocks][16 rows][64], zero-padded
  const int8_t* weight;
  int64_t k_blocks;
  int32_t* out;
  int64_t rows, cols;
};

#if VLLM_LITE_AMX
#define VLLM_LITE_AMX_INT8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-int8")))

// C (16 x 16 int32 tiles [row tile][column tile]) of rows [row, row + 16 * kRowTiles) by column
// block `block`, stored at c (row stride c_stride values). Tiles: 0-3 C, 4-5 A (x), 6-7 B (weights).
template <int kRowTiles>
VLLM_LITE_AMX_INT8_TARGET void tile_product(const Operands& g, int64_t row, int64_t block, int32_t* c,
                                            int64_t c_stride) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kRowTiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int8_t* a0 = g.x_tiles + row / kTileRows * g.k_blocks * kTileElements;
  const int8_t* a1 = a0 + g.k_blocks * kTileElements;
  const int8_t* b = g.weight + block * g.k_blocks * kBlockElements;
  for (int64_t k = 0; k < g.k_blocks; ++k, b += kBlockElements) {
    const char* ahead = reinterpret_cast<const char*>(b + kPrefetchBlocks * kBlockElements);
    for (int64_t line = 0; line < kBlockElements; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    _tile_loadd(6, b, 128);
    _tile_loadd(7, b + 64, 128);  // the second 16 columns: the rows' second 64 bytes
    _tile_loadd(4, a0 + k * kTileElements, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    if constexpr (kRowTiles == 2) {
      _tile_loadd(5, a1 + k * kTileElements, 64);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    }
  }
  const int64_t bytes = c_stride * static_cast<int64_t>(sizeof(int32_t));
  _tile_stored(0, c, bytes);
  _tile_stored(1, c + kTileRows, bytes);
  if constexpr (kRowTiles == 2) {
    _tile_stored(2, c + kTileRows * c_stride, bytes);
    _tile_stored(3, c + kTileRows * c_stride + kTileRows, bytes);
  }
}

// The valid rows and columns of tiles stored at c (row stride kBlockN) into out: the blocks at
// out's last rows or columns, which whole tiles would overrun.
VLLM_LITE_AMX_INT8_TARGET void store_edge(const Operands& g, int64_t row, int64_t block, int row_tiles,
                                          const int32_t* c) {
  const int64_t col = block * kBlockN, n = std::min(row_tiles * kTileRows, g.rows - row);
  const int64_t width = std::min(kBlockN, g.cols - col);
  const __mmask16 low = static_cast<__mmask16>((1u << std::min(kTileRows, width)) - 1);
  const __mmask16 high = static_cast<__mmask16>((1u << std::max<int64_t>(0, width - kTileRows)) - 1);
  for (int64_t r = 0; r < n; ++r) {
    int32_t* out = g.out + (row + r) * g.cols + col;
    _mm512_mask_storeu_epi32(out, low, _mm512_load_si512(c + r * kBlockN));
    _mm512_mask_storeu_epi32(out + kTileRows, high, _mm512_load_si512(c + r * kBlockN + kTileRows));
  }
}

// Column blocks [first, last) for rows [row_begin, row_end). Whole tiles are stored straight into
// out: copying them through a buffer row by row took a third of a 2,048-row prefill's matmul.
VLLM_LITE_AMX_INT8_TARGET void gemm_range(const Operands& g, int64_t row_begin, int64_t row_end, int64_t first,
                                          int64_t last) {
  alignas(64) int32_t edge[2 * kTileRows * kBlockN];
  for (int64_t block = first; block < last; ++block)
    for (int64_t row = row_begin; row < row_end; row += 2 * kTileRows) {
      const int row_tiles = row_end - row > kTileRows ? 2 : 1;
      const bool whole = row + row_tiles * kTileRows <= g.rows && (block + 1) * kBlockN <= g.cols;
      int32_t* c = whole ? g.out + row * g.cols + block * kBlockN : edge;
      const int64_t c_stride = whole ? g.cols : kBlockN;
      if (row_tiles == 2)
        tile_product<2>(g, row, block, c, c_stride);
      else
        tile_product<1>(g, row, block, c, c_stride);
      if (!whole) store_edge(g, row, block, row_tiles, edge);
    }
}

#endif

bool amx_int8_usable() { return cpu_has_amx(AmxKind::kInt8); }

at::Tensor amx_int8_mm(const at::Tensor& xq, const at::Tensor& packed_weight, int64_t out_features) {
  TORCH_CHECK(amx_int8_usable(), "amx_int8_mm: this CPU has no AMX-INT8 (or the process may not use it)");
  TORCH_CHECK(xq.device().is_cpu() && xq.scalar_type() == at::kChar && xq.dim() == 2 && xq.stride(1) == 1,
              "amx_int8_mm: xq must be an int8 CPU tensor [rows, in_features] with contiguous rows");
  const int64_t rows = xq.size(0), in_features = xq.size(1);
  const int64_t k_blocks = (in_features + kBlockK - 1) / kBlockK;
  const int64_t column_blocks = (out_features + kBlockN - 1) / kBlockN;
  TORCH_CHECK(packed_weight.scalar_type() == at::kChar && packed_weight.is_contiguous() &&
                  packed_weight.numel() == column_blocks * k_blocks * kBlockElements,
              "amx_int8_mm: packed_weight must be a contiguous int8 packing of a [", out_features, ", ", in_features,
              "] weight (", column_blocks * k_blocks * kBlockElements, " values)");
  at::Tensor out = at::empty({rows, out_features}, xq.options().dtype(at::kInt));
  if (rows == 0) return out;
#if VLLM_LITE_AMX
  const std::unique_ptr<int8_t[]> x_tiles =
      amx_a_tiles(xq.data_ptr<int8_t>(), rows, xq.stride(0), in_features, kBlockK, at::get_num_threads());
  const Operands g{x_tiles.get(), packed_weight.data_ptr<int8_t>(), k_blocks, out.data_ptr<int32_t>(), rows,
                   out_features};
  amx_gemm(g, rows, k_blocks, column_blocks, at::get_num_threads(), &gemm_range);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_lite_C, m) {
  m.def("amx_int8_mm(Tensor xq, Tensor packed_weight, int out_features) -> Tensor");
  m.def("amx_int8_usable() -> bool", &amx_int8_usable);  // no tensor to dispatch on: one kernel
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) { m.impl("amx_int8_mm", &amx_int8_mm); }
