// Rotary position embedding for the CPU, one pass: out = x * cos + roll(x, D/2) * sin_signed, per token
// and head, where sin_signed already carries rotate-half's sign (runner/layers/rotary.py). Bitwise the
// same as that torch expression: each product is rounded to the dtype, then the sum (explicit mul and
// add, no fused multiply-add; a bf16 product of bf16 factors is exact in fp32 before its rounding).
// It reads x through its token and head strides (a q|k view out of the fused qkv projection needs no
// copy) and writes a contiguous [num_tokens, heads, head_dim]. Loaded with the other kernels
// (runner/cpu_kernels.py); AVX-512 or AVX2 (lanes.h).
// The Tensor class and the two factory ops used, not all of ATen.h: ~5 s less compile per file.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <omp.h>
#include <torch/library.h>

#include "lanes.h"

#include <cstdint>

namespace {

using namespace rollout_lanes;

// One head row of length d: the first half pairs with the second (roll by d/2), 16 lanes at a time.
template <typename T>
inline void rotate_row(const T* x, const T* c, const T* s, T* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const Mask m = lanes(half - i);
    const V16 lo = load16(x + i, m), hi = load16(x + half + i, m);
    // out[i] = x[i] * c[i] + x[i + half] * s[i]; out[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half]
    const V16 a = round_like(vmul(lo, load16(c + i, m)), T());
    const V16 b = round_like(vmul(hi, load16(s + i, m)), T());
    store16(out + i, vadd(a, b), m);
    const V16 e = round_like(vmul(hi, load16(c + half + i, m)), T());
    const V16 f = round_like(vmul(lo, load16(s + half + i, m)), T());
    store16(out + half + i, vadd(e, f), m);
  }
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t n = x.size(0), h = x.size(1), d = x.size(2);
  const int64_t sx0 = x.stride(0), sx1 = x.stride(1), sc = cos.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
#pragma omp parallel for if (n * h * d >= (1 << 16)) schedule(static)
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < h; ++j) rotate_row<T>(xp + t * sx0 + j * sx1, cp + t * sc, sp + t * sc, op + (t * h + j) * d, d);
}

// x: [num_tokens, heads, head_dim] (last dim contiguous, any token/head strides); cos, sin_signed:
// [num_tokens, 1, head_dim] contiguous rows, x's dtype -> [num_tokens, heads, head_dim] contiguous.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "rotary: x must be a CPU [num_tokens, heads, ",
              "head_dim] tensor with a contiguous last dimension");
  const int64_t n = x.size(0), d = x.size(2);
  TORCH_CHECK(d % 2 == 0, "rotary: head_dim ", d, " must be even");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rotary: dtype ", x.scalar_type(),
              " not supported (float32, bfloat16)");
  for (const at::Tensor* t : {&cos_in, &sin_in})
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->numel() == n * d && t->size(0) == n, "rotary: cos and sin ",
                "must be [num_tokens, 1, head_dim] = [", n, ", 1, ", d, "] in x's dtype, got ", t->sizes(), " ",
                t->scalar_type());
  const at::Tensor cos = cos_in.reshape({n, d}).contiguous(), sin = sin_in.reshape({n, d}).contiguous();
  at::Tensor out = at::empty({n, x.size(1), d}, x.options());
  if (x.scalar_type() == at::kFloat) run<float>(x, cos, sin, out);
  else run<c10::BFloat16>(x, cos, sin, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) { m.def("rotary(Tensor x, Tensor cos, Tensor sin_signed) -> Tensor"); }

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) { m.impl("rotary", &rotary); }
