// The elementwise ends of a dynamic W8A8 linear layer (quantization="int8"), around the int8
// matmul (torch._int_mm: oneDNN, VNNI dot products where the CPU has them):
//
//   quantize_rows_int8(x) -> (q int8 [M, K], scale float32 [M, 1])
//       per-row symmetric int8: scale = max(max|x| / 127, 1e-12), q = round(x / scale) (to
//       nearest, ties to even: torch.round's rule); x float32 or bfloat16 [M, K], rows contiguous.
//   dequantize_int32(acc, row_scale, col_scale, bias, dtype) -> out [M, N]
//       out = acc * row_scale[m] * col_scale[n] (+ bias[n]) in fp32, rounded once to `dtype`
//       (float32 or bfloat16); acc int32 [M, N] contiguous, bias of `dtype` or None.
//
// Why fused: with torch ops the two ends are nine kernels (abs, amax, divide, clamp, round, cast;
// two multiplies and a cast), each a pass over memory with its own dispatch; at prefill sizes they
// cost more than the int8 matmul between them (benchmarks/RESULTS.md). Here each end is one pass.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "cpu_int8_rows.h"
#include "cpu_multiversion.h"
#include "cpu_rows.h"
#include "cpu_vec.h"

namespace {

using namespace vllm_lite_cpu;  // NOLINT: the helpers of cpu_vec.h and cpu_rows.h

template <int L, typename T>
VLLM_LITE_INLINE void quantize_rows(int8_t* q, float* scale, const T* x, int64_t n, int64_t x_stride, int64_t begin,
                                    int64_t end) {
  for (int64_t r = begin; r < end; ++r) scale[r] = quantize_row<VecF<L>>(q + r * n, x + r * x_stride, n);
}

template <int L, typename T>
VLLM_LITE_INLINE void dequantize_rows(T* out, const int32_t* acc, const float* row_scale, const float* col_scale,
                                      const T* bias, int64_t n, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) dequantize_row<VecF<L>>(out + r * n, acc + r * n, row_scale[r], col_scale, bias, n);
}

// Compiled per ISA level per row range (OpenMP outlines the parallel loop into a function that
// the target attributes would not reach).
#define VLLM_LITE_INT8_RANGES(T, SUFFIX)                                                                    \
  VLLM_LITE_PER_ISA(quantize_range_##SUFFIX, (quantize_rows<L, T>),                                        \
                    (int8_t* q, float* scale, const T* x, int64_t n, int64_t x_stride, int64_t begin,      \
                     int64_t end),                                                                          \
                    (q, scale, x, n, x_stride, begin, end))                                                 \
  VLLM_LITE_PER_ISA(dequantize_range_##SUFFIX, (dequantize_rows<L, T>),                                    \
                    (T* out, const int32_t* acc, const float* row_scale, const float* col_scale, const T* bias, \
                     int64_t n, int64_t begin, int64_t end),                                                \
                    (out, acc, row_scale, col_scale, bias, n, begin, end))
VLLM_LITE_INT8_RANGES(float, f32)
VLLM_LITE_INT8_RANGES(uint16_t, bf16)
#undef VLLM_LITE_INT8_RANGES

std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x) {
  const char* op = "quantize_rows_int8";
  check_float_cpu(x, op, "x");
  TORCH_CHECK(x.dim() == 2 && (x.stride(1) == 1 || x.size(1) <= 1), op, ": x must be 2-D with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor q = at::empty({rows, n}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  const int threads = threads_for(x.numel());
  if (x.scalar_type() == at::kFloat) {
    const float* in = x.data_ptr<float>();
    for_row_chunks(rows, threads, [&](int64_t b, int64_t e) { quantize_range_f32(qp, sp, in, n, stride, b, e); });
  } else {
    const uint16_t* in = static_cast<const uint16_t*>(x.data_ptr());
    for_row_chunks(rows, threads, [&](int64_t b, int64_t e) { quantize_range_bf16(qp, sp, in, n, stride, b, e); });
  }
  return {q, scale};
}

at::Tensor dequantize_int32(const at::Tensor& acc, const at::Tensor& row_scale, const at::Tensor& col_scale,
                            const std::optional<at::Tensor>& bias, at::ScalarType dtype) {
  const char* op = "dequantize_int32";
  TORCH_CHECK(acc.device().is_cpu() && acc.scalar_type() == at::kInt && acc.dim() == 2 && acc.is_contiguous(), op,
              ": acc must be a contiguous int32 CPU tensor [M, N]");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": dtype must be float32 or bfloat16");
  const int64_t rows = acc.size(0), n = acc.size(1);
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous() && row_scale.numel() == rows, op,
              ": row_scale must be contiguous float32 with one value per row of acc");
  TORCH_CHECK(col_scale.scalar_type() == at::kFloat && col_scale.is_contiguous() && col_scale.numel() == n, op,
              ": col_scale must be contiguous float32 with one value per column of acc");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == n, op,
                ": bias must be contiguous, of dtype, with one value per column of acc");
  at::Tensor out = at::empty({rows, n}, acc.options().dtype(dtype));
  const int32_t* a = acc.data_ptr<int32_t>();
  const float *rs = row_scale.data_ptr<float>(), *cs = col_scale.data_ptr<float>();
  const int threads = threads_for(acc.numel());
  if (dtype == at::kFloat) {
    float* o = out.data_ptr<float>();
    const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
    for_row_chunks(rows, threads, [&](int64_t b, int64_t e) { dequantize_range_f32(o, a, rs, cs, bp, n, b, e); });
  } else {
    uint16_t* o = static_cast<uint16_t*>(out.data_ptr());
    const uint16_t* bp = has_bias ? static_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
    for_row_chunks(rows, threads, [&](int64_t b, int64_t e) { dequantize_range_bf16(o, a, rs, cs, bp, n, b, e); });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_lite_C, m) {
  m.def("quantize_rows_int8(Tensor x) -> (Tensor, Tensor)");
  m.def("dequantize_int32(Tensor acc, Tensor row_scale, Tensor col_scale, Tensor? bias, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) {
  m.impl("quantize_rows_int8", &quantize_rows_int8);
  m.impl("dequantize_int32", &dequantize_int32);
}
