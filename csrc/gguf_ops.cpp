// Native CPU ops for linear layers whose weights stay in GGUF's block formats (llama.cpp's
// layouts, 32 weights a block, blocks in row order along the input dimension):
//
//   Q8_0 (ggml type 8): fp16 scale d, then 32 int8 q            -> w = d * q            (34 bytes)
//   Q4_1 (ggml type 3): fp16 scale d, fp16 min m, 16 bytes of   -> w[j]      = d * (qs[j] & 15) + m
//                       nibbles qs                                 w[j + 16] = d * (qs[j] >> 4) + m
//                                                                                      (20 bytes)
//
//   gguf_gemm(x, qweight, qtype) -> float32 [M, N]
//       x float32 [M, K] times the transposed [N, K] weight held as uint8 [N, K / 32 * bytes]:
//       each weight block is widened to fp32 in registers as it is read and multiplied into up
//       to 4 rows of x at once, fp32 accumulation. For decode-sized M (the weight is read
//       M / 4 times; prefill-sized M dequantizes once and takes a matmul: vllm_lite/model/
//       layers/gguf_quant.py).
//   gguf_dequantize(qweight, qtype) -> float32 [R, K]
//       the rows widened to fp32 (prefill, embedding lookups).
//
// Output rows are split across torch's intra-op threads; the inner loops use GCC vector
// extensions, compiled per ISA level at its register width (VLLM_LITE_PER_ISA, cpu_multiversion.h).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "cpu_multiversion.h"
#include "cpu_vec.h"

namespace {

using namespace vllm_lite_cpu;  // NOLINT: the vector helpers of cpu_vec.h

constexpr int64_t kBlock = 32;
constexpr int64_t kTypeQ4_1 = 3;
constexpr int64_t kTypeQ8_0 = 8;
constexpr int64_t kMaxRowsAtOnce = 4;

// Bytes -> int32 lanes (a sign / zero extension) -> float: GCC turns a direct byte -> float
// conversion into one scalar conversion per lane.
template <typename V, typename Bytes>
VLLM_LITE_INLINE V to_float(Bytes bytes) {
  return __builtin_convertvector(__builtin_convertvector(bytes, VecI32<lanes_of<V>>), V);
}

int64_t block_bytes(int64_t qtype) {
  TORCH_CHECK(qtype == kTypeQ4_1 || qtype == kTypeQ8_0,
              "GGUF type ", qtype, " is not supported (supported: 3 = Q4_1, 8 = Q8_0)");
  return qtype == kTypeQ4_1 ? 20 : 34;
}

// _Float16 lets each ISA level convert with the instructions it has (F16C's vcvtph2ps on
// x86-64-v3/v4); c10's portable bit-twiddling conversion cost more than the rest of a block's work.
VLLM_LITE_INLINE float half_at(const uint8_t* p) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
  _Float16 h;
  std::memcpy(&h, p, sizeof h);
  return static_cast<float>(h);
#else
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// One block of 32 weights -> 32 / L vectors of L lanes, in order.
template <int64_t QType, int L>
VLLM_LITE_INLINE void widen_block(const uint8_t* block, VecF<L>* w) {
  typedef VecF<L> V;
  typedef uint8_t Bytes __attribute__((vector_size(L)));
  typedef int8_t SignedBytes __attribute__((vector_size(L)));
  if constexpr (QType == kTypeQ8_0) {
    const float d = half_at(block);
    for (int v = 0; v < kBlock / L; ++v) {
      SignedBytes q;
      std::memcpy(&q, block + 2 + v * L, sizeof q);
      w[v] = to_float<V>(q) * d;
    }
  } else {  // weights j and j + 16 share byte j of qs: low and high nibble
    const float d = half_at(block), m = half_at(block + 2);
    constexpr int half = kBlock / 2 / L;  // vectors per 16 weights
    for (int v = 0; v < half; ++v) {
      Bytes qs;
      std::memcpy(&qs, block + 4 + v * L, sizeof qs);
      w[v] = to_float<V>(qs & 15) * d + m;
      w[v + half] = to_float<V>(qs >> 4) * d + m;
    }
  }
}

// out[r * ldo] = dot(weight row, x row r) for Rows rows of x; two accumulators per row (the
// block's vectors alternate between them).
template <int64_t QType, int Rows, int L>
VLLM_LITE_INLINE void weight_row_times_x(const uint8_t* row, int64_t num_blocks, const float* x,
                                         int64_t ldx, float* out, int64_t ldo) {
  typedef VecF<L> V;
  constexpr int64_t bytes = QType == kTypeQ4_1 ? 20 : 34;
  V acc[Rows][2] = {};
  for (int64_t b = 0; b < num_blocks; ++b) {
    V w[kBlock / L];
    widen_block<QType, L>(row + b * bytes, w);
    const float* xb = x + b * kBlock;
    for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < kBlock / L; ++v) acc[r][v % 2] += w[v] * load<V>(xb + r * ldx + v * L);
  }
  for (int r = 0; r < Rows; ++r) out[r * ldo] = hsum(acc[r][0] + acc[r][1]);
}

template <int64_t QType, int L>
VLLM_LITE_INLINE void gemm_rows(const uint8_t* weight, int64_t row_bytes, int64_t n_begin,
                                int64_t n_end, const float* x, int64_t m_rows, int64_t k,
                                float* out, int64_t n_total) {
  const int64_t num_blocks = k / kBlock;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = weight + n * row_bytes;
    int64_t m = 0;
    for (; m + kMaxRowsAtOnce <= m_rows; m += kMaxRowsAtOnce)
      weight_row_times_x<QType, kMaxRowsAtOnce, L>(row, num_blocks, x + m * k, k, out + m * n_total + n, n_total);
    switch (m_rows - m) {
      case 3: weight_row_times_x<QType, 3, L>(row, num_blocks, x + m * k, k, out + m * n_total + n, n_total); break;
      case 2: weight_row_times_x<QType, 2, L>(row, num_blocks, x + m * k, k, out + m * n_total + n, n_total); break;
      case 1: weight_row_times_x<QType, 1, L>(row, num_blocks, x + m * k, k, out + m * n_total + n, n_total); break;
      default: break;
    }
  }
}

VLLM_LITE_PER_ISA(gemm_rows_q4_1, (gemm_rows<kTypeQ4_1, L>),
                  (const uint8_t* weight, int64_t row_bytes, int64_t n_begin, int64_t n_end, const float* x,
                   int64_t m_rows, int64_t k, float* out, int64_t n_total),
                  (weight, row_bytes, n_begin, n_end, x, m_rows, k, out, n_total))
VLLM_LITE_PER_ISA(gemm_rows_q8_0, (gemm_rows<kTypeQ8_0, L>),
                  (const uint8_t* weight, int64_t row_bytes, int64_t n_begin, int64_t n_end, const float* x,
                   int64_t m_rows, int64_t k, float* out, int64_t n_total),
                  (weight, row_bytes, n_begin, n_end, x, m_rows, k, out, n_total))

template <int64_t QType, int L>
VLLM_LITE_INLINE void widen_rows(const uint8_t* weight, int64_t row_bytes, int64_t r_begin,
                                 int64_t r_end, int64_t k, float* out) {
  constexpr int64_t bytes = QType == kTypeQ4_1 ? 20 : 34;
  for (int64_t r = r_begin; r < r_end; ++r)
    for (int64_t b = 0; b < k / kBlock; ++b) {
      VecF<L> w[kBlock / L];
      widen_block<QType, L>(weight + r * row_bytes + b * bytes, w);
      for (int v = 0; v < kBlock / L; ++v) store(out + r * k + b * kBlock + v * L, w[v]);
    }
}

VLLM_LITE_PER_ISA(widen_rows_q4_1, (widen_rows<kTypeQ4_1, L>),
                  (const uint8_t* weight, int64_t row_bytes, int64_t r_begin, int64_t r_end, int64_t k, float* out),
                  (weight, row_bytes, r_begin, r_end, k, out))
VLLM_LITE_PER_ISA(widen_rows_q8_0, (widen_rows<kTypeQ8_0, L>),
                  (const uint8_t* weight, int64_t row_bytes, int64_t r_begin, int64_t r_end, int64_t k, float* out),
                  (weight, row_bytes, r_begin, r_end, k, out))

// K (the dequantized row length) of a uint8 [R, row_bytes] weight of type qtype.
int64_t check_weight(const at::Tensor& qweight, int64_t qtype) {
  const int64_t bytes = block_bytes(qtype);
  TORCH_CHECK(qweight.device().is_cpu() && qweight.scalar_type() == at::kByte && qweight.dim() == 2 &&
                  qweight.is_contiguous(),
              "qweight must be a contiguous uint8 CPU tensor [rows, row_bytes]");
  TORCH_CHECK(qweight.size(1) % bytes == 0, "qweight row_bytes=", qweight.size(1),
              " is not a whole number of ", bytes, "-byte blocks");
  return qweight.size(1) / bytes * kBlock;
}

at::Tensor gguf_gemm(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype) {
  const int64_t k = check_weight(qweight, qtype);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 CPU tensor [M, K]");
  TORCH_CHECK(x.size(1) == k, "x has K=", x.size(1), " but the weight rows hold ", k, " values");
  const int64_t m_rows = x.size(0), n_total = qweight.size(0), row_bytes = qweight.size(1);
  at::Tensor out = at::empty({m_rows, n_total}, x.options());
  if (m_rows == 0 || n_total == 0) return out;
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto rows = qtype == kTypeQ4_1 ? gemm_rows_q4_1 : gemm_rows_q8_0;
  // ~16 output rows a task: small enough to balance two threads on a 64-row projection.
  at::parallel_for(0, n_total, 16, [&](int64_t begin, int64_t end) {
    rows(w, row_bytes, begin, end, xp, m_rows, k, op, n_total);
  });
  return out;
}

at::Tensor gguf_dequantize(const at::Tensor& qweight, int64_t qtype) {
  const int64_t k = check_weight(qweight, qtype);
  const int64_t r_total = qweight.size(0), row_bytes = qweight.size(1);
  at::Tensor out = at::empty({r_total, k}, qweight.options().dtype(at::kFloat));
  if (r_total == 0) return out;
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  auto rows = qtype == kTypeQ4_1 ? widen_rows_q4_1 : widen_rows_q8_0;
  at::parallel_for(0, r_total, 64, [&](int64_t begin, int64_t end) { rows(w, row_bytes, begin, end, k, op); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_lite_C, m) {
  m.def("gguf_gemm(Tensor x, Tensor qweight, int qtype) -> Tensor");
  m.def("gguf_dequantize(Tensor qweight, int qtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) {
  m.impl("gguf_gemm", &gguf_gemm);
  m.impl("gguf_dequantize", &gguf_dequantize);
}
