// torch.ops.vkv.row_max and greedy_pick: the greedy token of each row, exactly, from the logits
// or from half the LM head's bytes.
#include "ops.h"
#include "panels.h"

namespace vkv {


// Each row's maximum and the index of its first occurrence, as torch.max(x, -1) gives them (a
// row holding NaN gives NaN, at its first NaN). torch's reduction with an index is scalar; here
// a vector pass finds the maximum and a second finds where it first is.
void row_max(const at::Tensor& x, at::Tensor values, at::Tensor indices) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "x must be [rows, n > 0] fp32 contiguous");
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.numel() == x.size(0) && values.is_contiguous() &&
              indices.scalar_type() == at::kLong && indices.numel() == x.size(0) && indices.is_contiguous(),
              "values: [rows] fp32, indices: [rows] int64");
  const int64_t n = x.size(1);
  const float* p = x.data_ptr<float>();
  float* v = values.data_ptr<float>();
  int64_t* ix = indices.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), 4, [&](int64_t begin, int64_t end) {
    constexpr int64_t kLanes = 16, kStride = 64;  // running maxima side by side; the second pass's test width
    for (int64_t i = begin; i < end; ++i) {
      const float* row = p + i * n;
      float lane[kLanes];
      int lane_nan[kLanes];
      std::fill(lane, lane + kLanes, -std::numeric_limits<float>::infinity());
      std::fill(lane_nan, lane_nan + kLanes, 0);
      const int64_t whole = n - n % kLanes;
      for (int64_t j = 0; j < whole; j += kLanes)
#pragma omp simd
        for (int64_t k = 0; k < kLanes; ++k) {
          const float a = row[j + k];
          lane[k] = a > lane[k] ? a : lane[k];
          lane_nan[k] |= a != a;
        }
      float mx = -std::numeric_limits<float>::infinity();
      int nan = 0;
      for (int64_t k = 0; k < kLanes; ++k) {
        mx = lane[k] > mx ? lane[k] : mx;
        nan |= lane_nan[k];
      }
      for (int64_t j = whole; j < n; ++j) {
        mx = row[j] > mx ? row[j] : mx;
        nan |= row[j] != row[j];
      }
      int64_t at = 0;
      if (nan) {
        while (row[at] == row[at]) ++at;
      } else {
        for (; at + kStride <= n; at += kStride) {
          int hit = 0;
#pragma omp simd reduction(| : hit)
          for (int64_t j = at; j < at + kStride; ++j) hit |= row[j] == mx;
          if (hit) break;
        }
        while (row[at] != mx) ++at;
      }
      v[i] = row[at];
      ix[i] = at;
    }
  });
}

// Note [An exact greedy pick from half the LM head's bytes]
// Rationale: the LM head (49,152 x 576 for the bundled model: 113 MB in fp32, 57 MB in bf16) is a
// fifth of what a decode step streams, and a greedy step needs only its argmax. Approach: the logits
// are first computed from a copy of the panels in half the bytes (`pick`: bf16 beside fp32 panels;
// int8 beside bf16 ones, with a scale a row, its largest |weight| / 127), and each token's distance
// to its full-pass logit is bounded: |approx_j - exact_j| <= |h| * bound_j, where bound_j =
// |w_j - near_j| + gamma * (|w_j| + |near_j|) (Euclidean norms of the LM head's row j and of what the
// copy holds for it, bf16(w_j) or scale_j * q_j; gamma = (2K + 2) u / (1 - (2K + 2) u), u = 2^-24,
// covers both dot products' fp32 rounding, an FMA or a multiply and an add per term, and the
// scale's product; engine/models/linear.py `pick_bounds` computes it in fp64). With `bf16` the
// model's logits are rounded to bf16 (ties are common there), so the rule is taken over rounded
// values, R being that rounding, monotone: every token with R(approx_j + |h| bound_j) reaching
// max_i R(approx_i - |h| bound_i) may be the (first) argmax. Only their panels are computed again
// from the full panels, by the same function, in the same order, so their logits are the full
// pass's to the bit, and the pick among them (the largest, the first on a tie) is row_max's over
// the full logits. Any other token's logit is below that maximum. On the bundled model in fp32,
// 1-3 tokens (median 1) qualify a step, and the step reads 57 MB less (28 MB less in bf16).
// Limitations: a row whose approximate logits or norm are not finite is computed whole; the copy
// costs half the LM head's memory again.
// One panel's exact logits (the full pass's function, so the same bits), bf16-rounded with `bf16`.
void exact_panel(const float* x, int64_t K, const at::Tensor& panels, int64_t p, int64_t cols, bool bf16, float* out) {
  if (panels.scalar_type() == at::kFloat)
    linear_panels_impl<float>(x, 1, K, panels.data_ptr<float>() + p * K * kPanel, cols, nullptr, out);
  else
    linear_panels_impl<c10::BFloat16>(x, 1, K, panels.data_ptr<c10::BFloat16>() + p * K * kPanel, cols, nullptr, out);
  if (bf16)
    for (int64_t c = 0; c < cols; ++c) out[c] = static_cast<float>(c10::BFloat16(out[c]));
}

VKV_INLINE float rounded(double v, bool bf16) {  // monotone: a bound on v stays a bound on its rounding
  const float f = static_cast<float>(v);
  // c10::BFloat16's rounding (nearest even; NaN stays NaN), written out and chosen without a
  // branch so the loops over the vocabulary vectorize
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  float r;
  std::memcpy(&r, &bits, sizeof r);
  return bf16 && f == f ? r : f;
}

// One row's pick over panels [lo, hi): the largest exact logit among the tokens that may win
// (the first on a tie), or nan set where one of them is NaN.
struct Pick {
  float top = -std::numeric_limits<float>::infinity();
  int64_t at = -1;
  bool nan = false;
};

// The passes over the vocabulary (the scales, the floor, the candidates' panels) run on every
// thread, each over its own run of panels, and vectorize (bf16's rounding written out above)
// (benchmarks/results/cpu/design_choices.json, "pick_passes_threaded").
// A run's floor is a maximum and its pick the first maximum of its run, so the runs combine to
// the whole row's in any split. The second pass visits only the panels that may win (a panel's
// largest bound reaches the floor exactly when one of its tokens' does: the same panels, the same
// pick), instead of computing every token's bound again ("pick_second_pass" in
// benchmarks/results/cpu/design_choices.json). The first pass writes each token's upper bound over
// its approximate logit in one flat loop (the second takes a panel's largest from there). It had
// compiled to scalar code (perf on the Intel Xeon, AVX2 kernels: a vcvtss2sd and a NaN test a
// token), for a branch in `rounded`, a loop a panel and the closure's references; timed inside the
// pick in bf16 decode (3 generations of 256 tokens, AVX2 kernels), the first pass 94 -> 79 us a
// step (fp32: 90 -> 70; AVX-512 kernels, bf16: 56), against 840-860 us for the int8 GEMV: it reads
// the bounds, scales and approximate logits (0.8 MB a step) after the step's weights evicted them.
// `logits` [rows, N] is scratch: on return a row holds its tokens' upper bounds, or its logits where
// it was computed whole.
void greedy_pick(const at::Tensor& h, const at::Tensor& panels, const at::Tensor& pick, const at::Tensor& bounds,
                 const std::optional<at::Tensor>& scales, bool bf16, at::Tensor logits, at::Tensor best,
                 at::Tensor picked) {
  const int64_t M = h.size(0), K = h.size(1), N = logits.size(1), P = (N + kPanel - 1) / kPanel;
  const bool int8 = pick.scalar_type() == at::kChar;
  TORCH_CHECK(pick.sizes() == panels.sizes() && bounds.scalar_type() == at::kDouble && bounds.numel() == N &&
              ((panels.scalar_type() == at::kFloat && pick.scalar_type() == at::kBFloat16 && !scales) ||
               (panels.scalar_type() == at::kBFloat16 && int8 && scales && scales->scalar_type() == at::kFloat &&
                scales->numel() == N)),
              "pick: bf16 panels beside fp32 ones, or int8 ones and their [N] fp32 scales beside bf16 ones; "
              "bounds: [N] fp64");
  TORCH_CHECK(best.scalar_type() == at::kFloat && best.numel() == M && best.is_contiguous() &&
              picked.scalar_type() == at::kLong && picked.numel() == M && picked.is_contiguous(),
              "best: [rows] fp32, picked: [rows] int64");
  linear_panels(h, pick, std::nullopt, logits);  // the approximate logits
  const double* bound = bounds.data_ptr<double>();
  const float* scale = int8 ? scales->data_ptr<float>() : nullptr;
  float* v = best.data_ptr<float>();
  int64_t* ix = picked.data_ptr<int64_t>();
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), P));  // (N = 0: one empty run)
  std::vector<float> floors(threads);
  std::vector<char> finites(threads);
  std::vector<Pick> picks(threads);
  for (int64_t r = 0; r < M; ++r) {
    const float* x = h.data_ptr<float>() + r * K;
    float* a = logits.data_ptr<float>() + r * N;
    double norm = 0;
    for (int64_t k = 0; k < K; ++k) norm += static_cast<double>(x[k]) * x[k];
    norm = std::sqrt(norm) * (1 + 1e-12);  // (and the bound's own fp64 rounding)
    // pass 1: the scales, the largest lower bound of a (rounded) logit, and each token's upper bound
    // written over its approximate logit
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t lo = P * t / threads * kPanel, hi = std::min(N, P * (t + 1) / threads * kPanel);
        if (scale)
          for (int64_t j = lo; j < hi; ++j) a[j] *= scale[j];
        float floor = -std::numeric_limits<float>::infinity(), bad = 0;  // bad: not 0 once a logit is not finite
        // token j's (rounded) logit lies between rounded(a[j] -+ norm * bound[j]); the loop reads copies
        // of what the closure holds by reference (read through it, the loop would not vectorize: the
        // stores to a[] might change them)
        const double n = norm, *bd = bound;
        const bool to_bf16 = bf16;
        float* av = a;
#pragma omp simd reduction(max : floor) reduction(+ : bad)
        for (int64_t j = lo; j < hi; ++j) {
          const double slack = n * bd[j];
          bad += av[j] - av[j];
          floor = std::max(floor, rounded(av[j] - slack, to_bf16));
          av[j] = rounded(av[j] + slack, to_bf16);
        }
        floors[t] = floor;
        finites[t] = std::isfinite(norm) && bad == 0;
      }
    });
    const float floor = *std::max_element(floors.begin(), floors.end());
    bool whole = !std::all_of(finites.begin(), finites.end(), [](char f) { return f; });
    // pass 2: the panels holding a token that may win, computed again in full
    if (!whole)
      at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
        alignas(64) float exact[kPanel];
        for (int64_t t = t0; t < t1; ++t) {
          Pick& got = picks[t] = Pick{};
          for (int64_t p = P * t / threads; p < P * (t + 1) / threads && !got.nan; ++p) {
            const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
            float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
            for (int64_t c = 0; c < cols; ++c) top = std::max(top, a[n0 + c]);
            if (!(top >= floor)) continue;  // no token of the panel may win
            exact_panel(x, K, panels, p, cols, bf16, exact);
            for (int64_t c = 0; c < cols; ++c) {
              if (!(a[n0 + c] >= floor)) continue;
              if (exact[c] != exact[c]) got.nan = true;  // NaN: row_max's rule, from the whole row
              if (exact[c] > got.top || got.at < 0) got.top = exact[c], got.at = n0 + c;
            }
          }
        }
      });
    Pick won;
    for (int64_t t = 0; t < threads && !whole; ++t) {
      whole = picks[t].nan;
      if (picks[t].at >= 0 && (won.at < 0 || picks[t].top > won.top)) won = picks[t];  // runs in order: the first
    }
    if (whole) {  // every logit, as last_logits computes them, and row_max's pick
      at::Tensor row = logits.select(0, r).unsqueeze(0);
      linear_panels(h.select(0, r).unsqueeze(0), panels, std::nullopt, row);
      if (bf16) row.copy_(row.to(at::kBFloat16));
      row_max(row, best.narrow(0, r, 1), picked.narrow(0, r, 1));
      continue;
    }
    v[r] = won.top;
    ix[r] = won.at;
  }
}

}  // namespace vkv
