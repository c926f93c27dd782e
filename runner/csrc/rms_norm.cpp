// Fused RMSNorm for the CPU, optionally after the residual add, computed as transformers' RMSNorm does:
// in fp32 (x widened), variance = mean(x^2), y = x * rsqrt(variance + eps), then for bf16 y is rounded
// to bf16 before the weight multiplies it in bf16; for fp32, weight * y in fp32. The residual add is in
// the model dtype (bf16 + bf16 rounded to bf16), as HF's decoder layer adds. One pass per row instead
// of torch's pow / mean / add / rsqrt / mul (each a separate op and allocation): on small decode
// batches those ops' overheads, not the arithmetic, were the cost.
//
// Only the variance's summation order differs from torch's (16 fp32 lanes x 4 accumulators, then a
// tree), so a result can differ from F.rms_norm by an ulp; rl_on_policy_target="fsdp" keeps torch's ops.
// Loaded with paged_decode_attention.cpp as one extension (runner/cpu_kernels.py).
// The Tensor class and the two factory ops used, not all of ATen.h: ~5 s less compile per file.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>

#include "lanes.h"
#include <omp.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using namespace rollout_lanes;

// One row: (optionally) s = round(x + r) written to res_out, then out = w * round(s * rsqrt(mean(s^2) + eps)).
template <typename T>
void norm_row(const T* x, const T* res, const T* w, T* out, T* res_out, int64_t h, float eps) {
  V16 acc[4] = {vzero(), vzero(), vzero(), vzero()};
  int k = 0;
  for (int64_t i = 0; i < h; i += 16, k = (k + 1) & 3) {
    const Mask m = lanes(h - i);
    V16 s = load16(x + i, m);
    if (res != nullptr) {
      s = round_like(vadd(s, load16(res + i, m)), T());
      store16(res_out + i, s, m);
    }
    acc[k] = vfmadd(s, s, acc[k]);
  }
  const float var = vsum(vadd(vadd(acc[0], acc[1]), vadd(acc[2], acc[3]))) / static_cast<float>(h);
  const V16 r = vset1(1.0f / std::sqrt(var + eps));
  const T* src = res != nullptr ? res_out : x;
  for (int64_t i = 0; i < h; i += 16) {
    const Mask m = lanes(h - i);
    const V16 y = round_like(vmul(load16(src + i, m), r), T());
    store16(out + i, vmul(load16(w + i, m), y), m);
  }
}

void check(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), name, ": x and weight must be on the CPU");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0), name, ": weight [", w.numel(),
              "] does not match x's last dimension ", x.dim() ? x.size(-1) : 0);
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              name, ": x and weight must both be float32 or both bfloat16, got ", x.scalar_type(), " and ",
              w.scalar_type());
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor* res, const at::Tensor& w, double eps, at::Tensor& out, at::Tensor* res_out) {
  const int64_t h = x.size(-1), rows = x.numel() / h;
  const T* xp = x.data_ptr<T>();
  const T* rp = res ? res->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* rop = res_out ? res_out->data_ptr<T>() : nullptr;
  const float e = static_cast<float>(eps);
  // Rows are independent; a team only pays off for prefill-sized inputs (a decode batch is ~1 us of work).
#pragma omp parallel for if (rows * h >= (1 << 16)) schedule(static)
  for (int64_t i = 0; i < rows; ++i)
    norm_row<T>(xp + i * h, rp ? rp + i * h : nullptr, wp, op + i * h, rop ? rop + i * h : nullptr, h, e);
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check(x_in, weight_in, "rms_norm");
  const at::Tensor x = x_in.contiguous(), w = weight_in.contiguous();
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) run<float>(x, nullptr, w, eps, out, nullptr);
  else run<c10::BFloat16>(x, nullptr, w, eps, out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& residual_in,
                                                const at::Tensor& weight_in, double eps) {
  check(x_in, weight_in, "add_rms_norm");
  TORCH_CHECK(residual_in.sizes() == x_in.sizes() && residual_in.scalar_type() == x_in.scalar_type(),
              "add_rms_norm: residual ", residual_in.sizes(), " ", residual_in.scalar_type(), " must match x ",
              x_in.sizes(), " ", x_in.scalar_type());
  const at::Tensor x = x_in.contiguous(), r = residual_in.contiguous(), w = weight_in.contiguous();
  at::Tensor out = at::empty_like(x), res_out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) run<float>(x, &r, w, eps, out, &res_out);
  else run<c10::BFloat16>(x, &r, w, eps, out, &res_out);
  return {out, res_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
