// torch.ops.vkv.lora_segments: each LoRA adapter's deltas over its segment of rows.
#include "common.h"
#include "ops.h"

namespace vkv {


// LoRA deltas of a step (engine/lora.py): segment i is rows [bounds[2i], bounds[2i+1]) of x and
// out, with A_i [R, K] and B_i [R, N] (the adapter's scaling folded in). A segment of a few rows
// (decode) runs row by row here: h = A_i x (R dot products), then out += h B_i, all in registers
// and L1; each call of torch's GEMM would cost more than that work. Longer segments (prefill)
// go to torch's GEMM. Rows are spread over the threads.
constexpr int64_t kLoraRowsMax = 8;

void lora_row(const float* x, const float* a, const float* b, float* out, int64_t K, int64_t R, int64_t N,
              float* h) {
  for (int64_t r = 0; r < R; ++r) {
    const float* ar = a + r * K;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < K; ++k) acc += x[k] * ar[k];
    h[r] = acc;
  }
  for (int64_t r = 0; r < R; ++r) {
    const float* br = b + r * N;
    const float hr = h[r];
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) out[n] += hr * br[n];
  }
}

void lora_segments(const at::Tensor& x, at::Tensor out, at::TensorList a, at::TensorList b, at::IntArrayRef bounds) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat, "x must be [rows, K] fp32, rows contiguous");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.scalar_type() == at::kFloat && out.size(0) == x.size(0),
              "out must be [rows, N] fp32, rows contiguous");
  TORCH_CHECK(a.size() == b.size() && bounds.size() == 2 * a.size(), "one (A, B, first, end) per segment");
  const int64_t K = x.size(1), N = out.size(1);
  std::vector<std::pair<int64_t, int64_t>> rows;  // (segment, row) of the short segments
  for (size_t i = 0; i < a.size(); ++i) {
    const int64_t lo = bounds[2 * i], hi = bounds[2 * i + 1];
    TORCH_CHECK(0 <= lo && lo <= hi && hi <= x.size(0), "segment rows out of range");
    TORCH_CHECK(a[i].dim() == 2 && a[i].is_contiguous() && a[i].scalar_type() == at::kFloat && a[i].size(1) == K,
                "A must be [R, K] fp32 contiguous");
    TORCH_CHECK(b[i].dim() == 2 && b[i].is_contiguous() && b[i].scalar_type() == at::kFloat && b[i].size(1) == N &&
                b[i].size(0) == a[i].size(0), "B must be [R, N] fp32 contiguous, R as A's");
    if (hi - lo > kLoraRowsMax) {
      out.narrow(0, lo, hi - lo).addmm_(x.narrow(0, lo, hi - lo).mm(a[i].t()), b[i]);
    } else {
      for (int64_t m = lo; m < hi; ++m) rows.emplace_back(static_cast<int64_t>(i), m);
    }
  }
  const int64_t n_rows = static_cast<int64_t>(rows.size());
  if (n_rows == 0) return;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, n_rows, n_rows >= 8 ? 1 : n_rows, [&](int64_t lo, int64_t hi) {
    std::vector<float> h;
    for (int64_t j = lo; j < hi; ++j) {
      const auto [i, m] = rows[j];
      const int64_t R = a[i].size(0);
      h.resize(R);
      lora_row(xp + m * xs, a[i].data_ptr<float>(), b[i].data_ptr<float>(), op + m * os, K, R, N, h.data());
    }
  });
}

}  // namespace vkv
