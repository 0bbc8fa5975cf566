// The Gated DeltaNet's decode step (Qwen3.5's linear-attention layers) on the engine's state
// slots, in place:
//
//   gated_delta_rule_decode(states, slots, q, k, v, decay, beta) -> out
//       states float32 [slots, H, dk, dv]; per sequence n and head h, with S = states[slots[n], h]:
//       S = exp(decay) * S + k (beta (v - exp(decay) S^T k))^T;  out[n, h] = S^T q
//       q, k float32 [n, H, dk] (q already scaled, both unit length), v float32 [n, H, dv],
//       decay / beta float32 [n, H].
//
// Why here: with torch ops the step gathers each sequence's state out of the pool, makes four
// temporaries of its size and scatters it back: about seven passes over every state per layer.
// Here one sequence-head's state (64 KB at 128 x 128) is read once for S^T k and once more,
// from the cache, to update it and read it with q; nothing is copied.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_multiversion.h"
#include "cpu_rows.h"

namespace vllm_lite_cpu {
namespace {

VLLM_LITE_MULTIVERSION
void delta_rule_item(float* __restrict__ state, const float* __restrict__ q, const float* __restrict__ k,
                     const float* __restrict__ v, float gate, float beta, float* __restrict__ out,
                     float* __restrict__ write, int64_t dk, int64_t dv) {
  for (int64_t j = 0; j < dv; ++j) write[j] = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = k[i];
    const float* row = state + i * dv;
    for (int64_t j = 0; j < dv; ++j) write[j] += ki * row[j];
  }
  for (int64_t j = 0; j < dv; ++j) {
    write[j] = beta * (v[j] - gate * write[j]);
    out[j] = 0.f;
  }
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = k[i], qi = q[i];
    float* row = state + i * dv;
    for (int64_t j = 0; j < dv; ++j) {
      const float s = gate * row[j] + ki * write[j];
      row[j] = s;
      out[j] += qi * s;
    }
  }
}

void check_f32(const at::Tensor& t, const char* name, at::IntArrayRef sizes) {
  const char* op = "gated_delta_rule_decode";
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), op, ": ", name,
              " must be a contiguous float32 CPU tensor");
  TORCH_CHECK(t.sizes() == sizes, op, ": ", name, " must have sizes ", sizes, ", got ", t.sizes());
}

at::Tensor gated_delta_rule_decode(at::Tensor& states, const at::Tensor& slots, const at::Tensor& q,
                                   const at::Tensor& k, const at::Tensor& v, const at::Tensor& decay,
                                   const at::Tensor& beta) {
  const char* op = "gated_delta_rule_decode";
  TORCH_CHECK(states.dim() == 4, op, ": states must be [slots, heads, key dim, value dim]");
  const int64_t num_slots = states.size(0), heads = states.size(1), dk = states.size(2), dv = states.size(3);
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              op, ": slots must be a contiguous 1-D int64 CPU tensor");
  const int64_t n = slots.size(0);
  check_f32(states, "states", states.sizes());
  check_f32(q, "q", {n, heads, dk});
  check_f32(k, "k", {n, heads, dk});
  check_f32(v, "v", {n, heads, dv});
  check_f32(decay, "decay", {n, heads});
  check_f32(beta, "beta", {n, heads});
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t s = 0; s < n; ++s)
    TORCH_CHECK(slot[s] >= 0 && slot[s] < num_slots, op, ": slot ", slot[s], " is outside the ", num_slots,
                " states");
  at::Tensor out = at::empty({n, heads, dv}, q.options());
  float* S = states.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const int64_t items = n * heads;
  const int threads = threads_for(items * dk * dv);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> write(dv);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t seq = item / heads, head = item % heads;
      delta_rule_item(S + (slot[seq] * heads + head) * dk * dv, qp + item * dk, kp + item * dk, vp + item * dv,
                      std::exp(dp[item]), bp[item], o + item * dv, write.data(), dk, dv);
    }
  }
  return out;
}

}  // namespace
}  // namespace vllm_lite_cpu

TORCH_LIBRARY_FRAGMENT(vllm_lite_C, m) {
  m.def("gated_delta_rule_decode(Tensor(a!) states, Tensor slots, Tensor q, Tensor k, Tensor v, Tensor decay, "
        "Tensor beta) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_lite_C, CPU, m) {
  m.impl("gated_delta_rule_decode", &vllm_lite_cpu::gated_delta_rule_decode);
}
