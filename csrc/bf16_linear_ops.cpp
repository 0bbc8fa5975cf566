// bf16 linear layers on AMX tiles (CPUs with AMX-BF16):
//
//   amx_bf16_linear(x, packed_weight, out_features, bias) -> out
//       out [M, N] = x [M, K] @ W^T (+ bias): bf16 in and out, bf16 products summed in fp32 by the
//       tiles, the bias added in fp32 and each result rounded to bf16 once.
//   amx_bf16_usable() -> bool
//       whether this CPU has AMX-BF16 and the process may use it.
//
// packed_weight is W [N, K] zero-padded to multiples of 32 and laid out as oneDNN's AB16b32a2b
// blocks, [N/32][K/32][16 k-pairs][32 n][2 k] (model/layers/amx_linear.py packs it): the two B
// tiles of one 32-column block are the two halves of its 128-byte rows, and one block's B tiles
// over all of K are one contiguous stretch of memory, which a thread streams start to end.
//
// Why not oneDNN (torch.ops.mkldnn._linear_pointwise, which runs AMX too): at decode sizes its
// call costs tens of microseconds before any work and streams the weights at 5-20 GB/s; the LM
// head of the demo model took 5-12 ms per decode step (benchmarks/RESULTS.md, twelfth session).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "cpu_amx.h"

namespace {

using namespace vllm_lite_cpu;  // NOLINT: cpu_amx.h's helpers

constexpr int64_t kTileRows = 16;                     // rows of every tile; columns of a C tile
constexpr int64_t kBlockK = 32;                       // bf16 values of K per tile row
constexpr int64_t kBlockN = 32;                       // output columns per packed block: two C tiles

// The GEMM's operands. x is copied into whole A tiles first (amx_a_tiles: 1 KB each).
struct Operands {
  const uint16_t* x_tiles;
  const uint16_t* weight;
  int64_t k_blocks;
  const uint16_t* bias;  // nullptr: none
  uint16_t* out;
  int64_t out_stride, rows, cols;
};

// The valid rows and columns of the block's sums at c (row stride kBlockN) (+ bias) into out,
// rounded to bf16.
VLLM_LITE_AMX_BF16_TARGET void store_block(const Operands& g, int64_t row, int64_t block, int row_tiles, const float* c) {
  for (int j = 0; j < 2; ++j) {
    const int64_t col = block * kBlockN + j * kTileRows;
    if (col >= g.cols) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(kTileRows, g.cols - col)) - 1);
    const __m512 bias = g.bias == nullptr ? _mm512_setzero_ps()
        : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, g.bias + col)), 16));
    for (int64_t r = 0; r < std::min(row_tiles * kTileRows, g.rows - row); ++r) {
      const __m512 sum = _mm512_add_ps(_mm512_load_ps(c + r * kBlockN + j * kTileRows), bias);
      _mm256_mask_storeu_epi16(g.out + (row + r) * g.out_stride + col, mask, (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

// Column blocks [first, last) for rows [row_begin, row_end).
VLLM_LITE_AMX_BF16_TARGET void gemm_range(const Operands& g, int64_t row_begin, int64_t row_end, int64_t first, int64_t last) {
  alignas(64) float sums[2 * kTileRows * kBlockN];
  for (int64_t block = first; block < last; ++block)
    for (int64_t row = row_begin; row < row_end; row += 2 * kTileRows) {
      const int row_tiles = row_end - row > kTileRows ? 2 : 1;
      amx_block_product(g.x_tiles, g.weight, g.k_blocks, row, row_tiles, block, sums, kBlockN);
      store_block(g, row, block, row_tiles, sums);
    }
}

bool amx_bf16_usable() { return cpu_has_amx(AmxKind::kBf16); }

at::Tensor amx_bf16_linear(const at::Tensor& x, const at::Tensor& packed_weight, int64_t out_features,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_bf16_usable(), "amx_bf16_linear: this CPU has no AMX-BF16 (or the process may not use it)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "amx_bf16_linear: x must be a bfloat16 CPU tensor [rows, in_features] with contiguous rows");
  const int64_t rows = x.size(0), in_features = x.size(1);
  const int64_t k_blocks = (in_features + kBlockK - 1) / kBlockK;
  const int64_t column_blocks = (out_features + kBlockN - 1) / kBlockN;
  TORCH_CHECK(packed_weight.scalar_type() == at::kBFloat16 && packed_weight.is_contiguous() &&
                  packed_weight.numel() == column_blocks * k_blocks * kBlockN * kBlockK,
              "amx_bf16_linear: packed_weight must be a contiguous bfloat16 packing of a [", out_features, ", ",
              in_features, "] weight (", column_blocks * k_blocks * kBlockN * kBlockK, " values)");
  const uint16_t* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == out_features,
                "amx_bf16_linear: bias must be contiguous bfloat16 [out_features]");
    bias_data = static_cast<const uint16_t*>(bias->data_ptr());
  }
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const std::unique_ptr<uint16_t[]> x_tiles =
      amx_a_tiles(static_cast<const uint16_t*>(x.data_ptr()), rows, x.stride(0), in_features, kBlockK,
                  at::get_num_threads());
  const Operands g{x_tiles.get(), static_cast<const uint16_t*>(packed_weight.data_ptr()), k_blocks, bias_data,
                   static_cast<uint16_t*>(out.data_ptr()), out_features, rows, out_features};
  amx_gemm(g, rows, k_blocks, column_blocks, at::get_num_threads(), &gemm_range);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_lite_C, m) {
  m.def("amx_bf16_linear(Tensor x, Tensor packed_weight, int out_features, Tensor? bias) -> Tensor");
  m.def("amx_bf16_usable() -> bool", &amx_bf16_usable);  // no tensor to dispatch on: one kernel
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) { m.impl("amx_bf16_linear", &amx_bf16_linear); }
