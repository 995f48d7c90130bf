// torch.ops.vkv.linear_panels, panel_width, ahead_hint (panels.h) and write_panels.
#include "ops.h"
#include "panels.h"

namespace vkv {

void linear_panels(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias, at::Tensor out) {
  linear_panels_then(x, panels, bias, out);
}

int64_t panel_width() { return kPanel; }

std::string ahead_hint() { return ahead_hint_text(); }

// Rows [row, row + n) of a weight w [n, K] written into its panels [P, K, kPanel] (`write_panels`):
// new weights in place (engine/models/weights.py). Row r is column r % kPanel of panel r / kPanel, so
// each panel is a transpose of kPanel rows, the panels shared out between threads. Whole panels go
// 8 x 8 tiles at a time (`transpose8`: eight rows' eight values widened to fp32, transposed in
// registers, each column rounded to the panel's type), from fp32, bf16 or fp16 into fp32 or bf16
// panels, eight of a panel's rows down the whole of K, then the next eight: eight read streams (all
// kPanel rows side by side were 32 streams, more than the prefetcher follows), each line of the
// panel finished in cache by the later rows (plain stores: streaming stores of a line's quarters
// leave write-combining buffers half full). Measured against a plain copy into bf16, cold weights
// into fresh memory, the bundled model's shapes, 10 rounds: 1.50x its time (k by k, streaming
// stores) became 1.30x. A panel's
// first or last rows (an update that starts or ends inside it) and the k past a multiple of 8 go a
// value at a time. Each value becomes float, then the panel's type (bf16: to nearest even, NaN as
// 0x7fc0: c10::BFloat16's conversion), in the same pass: no rounded copy of the weight is made first.
#if defined(__AVX2__)
VKV_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
VKV_INLINE __m256 load8(const c10::BFloat16* p) {  // exact: a bf16's bits are an fp32's top half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
VKV_INLINE __m256 load8(const c10::Half* p) {  // exact
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_loadu_ps(f);
#endif
}
VKV_INLINE void store8(float* p, __m256 x) { _mm256_store_ps(p, x); }  // (p 32-byte aligned)
VKV_INLINE void store8(c10::BFloat16* p, __m256 x) {  // (p 16-byte aligned)
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  // each lane < 2^16, so packing with unsigned saturation keeps it as it is
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  _mm_store_si128(reinterpret_cast<__m128i*>(p), packed);
}

// out[j * ldo + i] = in[i * ldi + j] for i, j in [0, 8): eight rows of eight values, transposed.
template <typename TS, typename TD>
VKV_INLINE void transpose8(const TS* in, int64_t ldi, TD* out, int64_t ldo) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = load8(in + i * ldi);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    store8(out + i * ldo, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    store8(out + (i + 4) * ldo, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#endif

template <typename TS, typename TD>
void write_panels_impl(TD* panels, int64_t K, const TS* w, int64_t n, int64_t row) {
  const int64_t first = row / kPanel, last = (row + n - 1) / kPanel;
  at::parallel_for(first, last + 1, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t c0 = std::max<int64_t>(0, row - p * kPanel), c1 = std::min(kPanel, row + n - p * kPanel);
      TD* dst = panels + p * K * kPanel;
      const TS* src = w + (p * kPanel + c0 - row) * K;  // (the row of column c0)
      int64_t k_done = 0;
#if defined(__AVX2__)
      if (c0 == 0 && c1 == kPanel && reinterpret_cast<uintptr_t>(dst) % 32 == 0) {  // a whole panel
        for (int64_t c = 0; c < kPanel; c += 8)
          for (k_done = 0; k_done + 8 <= K; k_done += 8) transpose8(src + c * K + k_done, K, dst + k_done * kPanel + c, kPanel);
      }
#endif
      for (int64_t k = k_done; k < K; ++k)
        for (int64_t c = c0; c < c1; ++c) store(dst + k * kPanel + c, static_cast<float>(src[(c - c0) * K + k]));
    }
  });
}

void write_panels(at::Tensor panels, const at::Tensor& w, int64_t row) {
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel,
              "panels must be [P, K, panel_width()] contiguous");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == panels.size(1), "w must be [n, K] contiguous");
  const int64_t n = w.size(0), K = w.size(1);
  TORCH_CHECK(row >= 0 && row + n <= panels.size(0) * kPanel, "rows [", row, ", ", row + n, ") past the panels' ",
              panels.size(0) * kPanel);
  if (n == 0) return;
  auto to = [&](auto* dst) {
    using TD = std::remove_pointer_t<decltype(dst)>;
    switch (w.scalar_type()) {
      case at::kFloat: return write_panels_impl<float, TD>(dst, K, w.data_ptr<float>(), n, row);
      case at::kBFloat16: return write_panels_impl<c10::BFloat16, TD>(dst, K, w.data_ptr<c10::BFloat16>(), n, row);
      case at::kHalf: return write_panels_impl<c10::Half, TD>(dst, K, w.data_ptr<c10::Half>(), n, row);
      default: TORCH_CHECK(false, "write_panels reads fp32, bf16 or fp16 weights");
    }
  };
  if (panels.scalar_type() == at::kFloat)
    to(panels.data_ptr<float>());
  else if (panels.scalar_type() == at::kBFloat16)
    to(panels.data_ptr<c10::BFloat16>());
  else
    TORCH_CHECK(false, "write_panels writes fp32 or bf16 panels");
}

}  // namespace vkv
