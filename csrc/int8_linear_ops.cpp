// int8 matmuls on AMX tiles (CPUs with AMX-INT8), for the W8A8 linear layers (quantization="int8"):
//
//   amx_int8_linear(x, packed_weight, weight_scale, bias) -> out
//       the layer in one op: x's rows quantized per row straight into A tiles, the int8 product
//       on the tiles, each C tile rescaled into out as it leaves them. The same arithmetic as
//       int8_ops.cpp's quantize_rows_int8, amx_int8_mm and dequantize_int32 in turn (the row
//       code is cpu_int8_rows.h's), so the same values; x float32 or bfloat16 [M, K] with
//       contiguous rows, out [M, N] of x's dtype, weight_scale float32 [N], bias of x's dtype.
//   amx_int8_mm(xq, packed_weight, out_features) -> acc
//       acc [M, N] int32 = xq [M, K] int8 @ W^T, W [N, K] int8: exact integer sums, as
//       torch._int_mm gives them.
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
// although it reads half the bytes (benchmarks/RESULTS.md, fifty-fourth session). Why one op:
// on a small model's layers the three ops' own costs (dispatch, a pass over memory each) were as
// much as the product between them (fifty-sixth session).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "cpu_amx.h"
#include "cpu_int8_rows.h"
#include "cpu_rows.h"

namespace {

using namespace vllm_lite_cpu;  // NOLINT: the helpers of cpu_amx.h and cpu_int8_rows.h

constexpr int64_t kTileRows = 16;                      // rows of every tile; columns of a C tile
constexpr int64_t kBlockK = 64;                        // int8 values of K per tile row
constexpr int64_t kBlockN = 32;                        // output columns per packed block: two C tiles

struct TileInputs {
  const int8_t* x_tiles;  // [row tiles][K blocks][16 rows][64], zero-padded
  const int8_t* weight;
  int64_t k_blocks;
};

// amx_int8_mm's: int32 sums into out.
struct SumOperands {
  TileInputs in;
  int32_t* out;
  int64_t rows, cols;
};

// amx_int8_linear's: rescaled sums (+ bias) into out, of T (float or bfloat16 bits).
template <typename T>
struct LinearOperands {
  TileInputs in;
  const float* row_scale;  // x's per-row quantization scales
  const float* col_scale;  // the weight's per-output-channel scales
  const T* bias;           // or nullptr
  T* out;
  int64_t rows, cols;
};

int64_t column_blocks_of(int64_t out_features) { return (out_features + kBlockN - 1) / kBlockN; }
int64_t k_blocks_of(int64_t in_features) { return (in_features + kBlockK - 1) / kBlockK; }

void check_packed_weight(const at::Tensor& packed_weight, int64_t out_features, int64_t in_features, const char* op) {
  const int64_t values = column_blocks_of(out_features) * k_blocks_of(in_features) * kBlockN * kBlockK;
  TORCH_CHECK(packed_weight.scalar_type() == at::kChar && packed_weight.is_contiguous() &&
                  packed_weight.numel() == values,
              op, ": packed_weight must be a contiguous int8 packing of a [", out_features, ", ", in_features,
              "] weight (", values, " values)");
}

#if VLLM_LITE_AMX
#define VLLM_LITE_AMX_INT8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-int8")))

// The block's int32 sums (cpu_amx.h's product) at c.
VLLM_LITE_AMX_INT8_TARGET void block_product(const TileInputs& g, int64_t row, int row_tiles, int64_t block,
                                             int32_t* c, int64_t c_stride) {
  amx_block_product(g.x_tiles, g.weight, g.k_blocks, row, row_tiles, block, c, c_stride);
}

// The valid rows and columns of tiles stored at c (row stride kBlockN) into out: the blocks at
// out's last rows or columns, which whole tiles would overrun.
VLLM_LITE_AMX_INT8_TARGET void store_edge(const SumOperands& g, int64_t row, int64_t block, int row_tiles,
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

// amx_int8_mm's column blocks [first, last) for rows [row_begin, row_end). Whole tiles are stored
// straight into out: copying them through a buffer row by row took a third of a 2,048-row
// prefill's matmul.
VLLM_LITE_AMX_INT8_TARGET void sum_range(const SumOperands& g, int64_t row_begin, int64_t row_end, int64_t first,
                                         int64_t last) {
  alignas(64) int32_t edge[2 * kTileRows * kBlockN];
  for (int64_t block = first; block < last; ++block)
    for (int64_t row = row_begin; row < row_end; row += 2 * kTileRows) {
      const int row_tiles = row_end - row > kTileRows ? 2 : 1;
      const bool whole = row + row_tiles * kTileRows <= g.rows && (block + 1) * kBlockN <= g.cols;
      block_product(g.in, row, row_tiles, block, whole ? g.out + row * g.cols + block * kBlockN : edge,
                    whole ? g.cols : kBlockN);
      if (!whole) store_edge(g, row, block, row_tiles, edge);
    }
}

// amx_int8_linear's column blocks [first, last) for rows [row_begin, row_end): each block's sums
// rescaled from a buffer in L1 into out.
template <typename T>
VLLM_LITE_AMX_INT8_TARGET void linear_range(const LinearOperands<T>& g, int64_t row_begin, int64_t row_end,
                                            int64_t first, int64_t last) {
  alignas(64) int32_t sums[2 * kTileRows * kBlockN];
  for (int64_t block = first; block < last; ++block)
    for (int64_t row = row_begin; row < row_end; row += 2 * kTileRows) {
      const int row_tiles = row_end - row > kTileRows ? 2 : 1;
      block_product(g.in, row, row_tiles, block, sums, kBlockN);
      const int64_t col = block * kBlockN, width = std::min(kBlockN, g.cols - col);
      const T* bias = g.bias == nullptr ? nullptr : g.bias + col;
      for (int64_t r = 0; r < std::min(row_tiles * kTileRows, g.rows - row); ++r)
        dequantize_row<VecF<16>>(g.out + (row + r) * g.cols + col, sums + r * kBlockN, g.row_scale[row + r],
                                 g.col_scale + col, bias, width);
    }
}

// One row of x quantized (cpu_int8_rows.h's rule) into q; its scale.
template <typename T>
VLLM_LITE_AMX_INT8_TARGET float quantize_one_row(int8_t* q, const T* x, int64_t n) {
  return quantize_row<VecF<16>>(q, x, n);
}

template <typename T>
void linear_on_tiles(const at::Tensor& x, const at::Tensor& packed_weight, const at::Tensor& weight_scale,
                     const at::Tensor* bias, at::Tensor& out) {
  const int64_t rows = x.size(0), in_features = x.size(1), stride = x.stride(0);
  const T* xp = static_cast<const T*>(x.data_ptr());
  std::vector<float> row_scale(rows);
  // Quantizing is more work per value than a copy: threads from quantize_rows_int8's size on.
  const std::unique_ptr<int8_t[]> x_tiles =
      amx_a_tiles_of<int8_t>(rows, in_features, kBlockK, threads_for(rows * in_features), [&](int64_t r, int8_t* scratch) {
        row_scale[r] = quantize_one_row(scratch, xp + r * stride, in_features);
        return scratch;
      });
  const LinearOperands<T> g{{x_tiles.get(), packed_weight.data_ptr<int8_t>(), k_blocks_of(in_features)},
                            row_scale.data(),
                            weight_scale.data_ptr<float>(),
                            bias == nullptr ? nullptr : static_cast<const T*>(bias->data_ptr()),
                            static_cast<T*>(out.data_ptr()),
                            rows,
                            out.size(1)};
  amx_gemm(g, rows, g.in.k_blocks, column_blocks_of(out.size(1)), at::get_num_threads(), &linear_range<T>);
}
#endif

bool amx_int8_usable() { return cpu_has_amx(AmxKind::kInt8); }

at::Tensor amx_int8_mm(const at::Tensor& xq, const at::Tensor& packed_weight, int64_t out_features) {
  TORCH_CHECK(amx_int8_usable(), "amx_int8_mm: this CPU has no AMX-INT8 (or the process may not use it)");
  TORCH_CHECK(xq.device().is_cpu() && xq.scalar_type() == at::kChar && xq.dim() == 2 && xq.stride(1) == 1,
              "amx_int8_mm: xq must be an int8 CPU tensor [rows, in_features] with contiguous rows");
  const int64_t rows = xq.size(0), in_features = xq.size(1);
  check_packed_weight(packed_weight, out_features, in_features, "amx_int8_mm");
  at::Tensor out = at::empty({rows, out_features}, xq.options().dtype(at::kInt));
  if (rows == 0) return out;
#if VLLM_LITE_AMX
  const int threads = at::get_num_threads();
  const std::unique_ptr<int8_t[]> x_tiles =
      amx_a_tiles(xq.data_ptr<int8_t>(), rows, xq.stride(0), in_features, kBlockK, threads);
  const SumOperands g{{x_tiles.get(), packed_weight.data_ptr<int8_t>(), k_blocks_of(in_features)},
                      out.data_ptr<int32_t>(), rows, out_features};
  amx_gemm(g, rows, g.in.k_blocks, column_blocks_of(out_features), threads, &sum_range);
#endif
  return out;
}

at::Tensor amx_int8_linear(const at::Tensor& x, const at::Tensor& packed_weight, const at::Tensor& weight_scale,
                           const std::optional<at::Tensor>& bias) {
  const char* op = "amx_int8_linear";
  TORCH_CHECK(amx_int8_usable(), op, ": this CPU has no AMX-INT8 (or the process may not use it)");
  check_float_cpu(x, op, "x");
  TORCH_CHECK(x.dim() == 2 && (x.stride(1) == 1 || x.size(1) <= 1), op, ": x must be 2-D with contiguous rows");
  const int64_t rows = x.size(0), in_features = x.size(1), out_features = weight_scale.numel();
  TORCH_CHECK(weight_scale.device().is_cpu() && weight_scale.scalar_type() == at::kFloat &&
                  weight_scale.is_contiguous(),
              op, ": weight_scale must be contiguous float32 [out_features]");
  check_packed_weight(packed_weight, out_features, in_features, op);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == out_features, op,
                ": bias must be contiguous, of x's dtype, with one value per output feature");
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
#if VLLM_LITE_AMX
  const at::Tensor* bias_tensor = has_bias ? &*bias : nullptr;
  if (x.scalar_type() == at::kFloat)
    linear_on_tiles<float>(x, packed_weight, weight_scale, bias_tensor, out);
  else
    linear_on_tiles<uint16_t>(x, packed_weight, weight_scale, bias_tensor, out);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_lite_C, m) {
  m.def("amx_int8_mm(Tensor xq, Tensor packed_weight, int out_features) -> Tensor");
  m.def("amx_int8_linear(Tensor x, Tensor packed_weight, Tensor weight_scale, Tensor? bias) -> Tensor");
  m.def("amx_int8_usable() -> bool", &amx_int8_usable);  // no tensor to dispatch on: one kernel
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) {
  m.impl("amx_int8_mm", &amx_int8_mm);
  m.impl("amx_int8_linear", &amx_int8_linear);
}
