// RMSNorm with the residual added (`norm_row`) and silu(gate) * up, bit for bit as the model's
// torch references compute them.
#pragma once
#include "common.h"

namespace vkv {

// ---------------------------------------------------------------------------------------------
// Hugging Face's RMSNorm: in fp32, x * rsqrt(mean(x^2) + eps), cast back, times the weight.
// One row: rr += xr (without rr: xr is the residual), then xr = rmsnorm(rr) * w; row: H floats of
// scratch. Not inlined: add_rms_norm and final_hidden run this one body, so the sum's order (and
// every bit of the result) is the same in both.
template <typename T>
__attribute__((noinline)) void norm_row(T* xr, T* rr, const T* w, int64_t H, double eps, float* row) {
  if (rr) {
    for (int64_t j = 0; j < H; ++j) store(rr + j, load(rr[j]) + load(xr[j]));
    for (int64_t j = 0; j < H; ++j) row[j] = load(rr[j]);
  } else {
    for (int64_t j = 0; j < H; ++j) row[j] = load(xr[j]);
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < H; ++j) sum += row[j] * row[j];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) store(xr + j, load(w[j]) * round_to<T>(row[j] * inv));
}

template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps) {
  const int64_t N = x.size(0), H = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* w = weight.data_ptr<T>();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t i = begin; i < end; ++i) norm_row<T>(xp + i * H, rp ? rp + i * H : nullptr, w, H, eps, row.data());
  });
}

// silu(g) * u, silu rounded to T as torch's F.silu(g) * u in dtype T rounds it (the caller stores
// the product as T): silu_and_mul, and gate_up_silu in decode.
template <typename T>
VKV_INLINE float silu_times(float g, float u) {
  return round_to<T>(g / (1.0f + exp_approx(-g))) * u;
}

// silu(gate) * up, each step rounded to T as torch's F.silu(g) * u is.
template <typename T>
void silu_and_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t N = gate_up.size(0), I = out.size(1);
  const T* g = gate_up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* __restrict gate = g + i * 2 * I;
      const T* __restrict up = gate + I;
      T* __restrict dst = o + i * I;
#pragma omp simd
      for (int64_t j = 0; j < I; ++j) store(dst + j, silu_times<T>(load(gate[j]), load(up[j])));
    }
  });
}
}  // namespace vkv
