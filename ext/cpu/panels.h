// x W^T over weights packed in column panels (`linear_panels_then`, `row_over_panels`), and the
// gate/up projection with silu folded in: register tiles for many rows, streams for one.
#pragma once
#include "common.h"
#include "norms.h"

namespace vkv {


// ---------------------------------------------------------------------------------------------
// linear_panels: x W^T for every step, decode's few rows to prefill's hundreds. A register tile
// reaches the FMA peak's neighbourhood from a few dozen rows (as oneDNN's packed GEMM does from
// more), and reads the weights faster at a few (benchmarks/bench_gemm.py). At one
// row the step only streams W: each thread reads its run of panels front to back (one long
// stream, the next panel fetched ahead), faster than streaming W's plain rows
// (benchmarks/results/cpu/design_choices.json, "panels"). The weight is packed once
// (engine/models/linear.py `Linear.pack_panels`) into panels
// of kPanel output columns, [ceil(N / kPanel), K, kPanel], zero-padded, so for each k a panel's
// weights are adjacent. A tile of MR rows x kPanel columns lives in 2 * MR accumulator
// registers across the whole of K: per k, two weight vectors are loaded and each row's x[m][k]
// is broadcast into two FMAs. A panel (K x kPanel: 36 KiB at K = 576 in fp32) stays in L2 while
// every row block of a chunk of rows passes over it; threads split the panels; chunks of
// kPanelChunk rows keep x in L2 too. bf16 panels are widened on load (half the bytes read).
#if defined(VKV_VEC)
constexpr int64_t kPanel = 2 * Vec::W;
constexpr int kPanelRows = Vec::W == 16 ? 12 : 6;  // 24 of 32 / 12 of 16 registers hold the tile
constexpr int64_t kPanelChunk = 16 * kPanelRows;
// A one-row step reads each thread's panels as two streams (panel_pair), whatever the weights'
// type and the ISA: twice the loads in flight of one stream, and no non-temporal prefetch (on Intel
// CPUs it fills L1 alone, and a panel ahead is gone before it is read). Measured:
// benchmarks/results/cpu/design_choices.json, "panel_pair".

// Row k of a panel, its kPanel weights, as the two vectors a tile multiplies. fp32: columns
// [0, W) and [W, 2W). bf16: one load of all 2W weights (exactly a register), widened with no
// shuffle: each 32-bit lane holds columns 2i (its low half) and 2i + 1 (its high half), so a shift
// gives the even columns as fp32 and a mask the odd ones, 3 instructions against 6 for two
// zero-extending loads and shifts. The products and their order per column are unchanged, so
// the results are too; `panel_store` puts a tile's columns back in order.
template <typename TW>
VKV_INLINE void panel_load(const TW* p, typename Vec::R& w0, typename Vec::R& w1) {
  if constexpr (std::is_same_v<TW, c10::BFloat16>) {
#if defined(VKV_AVX512)
    const __m512i raw = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
    w0 = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    w1 = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
#else
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
#endif
  } else if constexpr (std::is_same_v<TW, int8_t>) {  // int8: widened in column order
#if defined(VKV_AVX512)
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
#else
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
#endif
  } else {
    w0 = Vec::load(p);
    w1 = Vec::load(p + Vec::W);
  }
}

// The tile's accumulators a0, a1 (as panel_load split the columns) into tile[0, kPanel) in order.
template <typename TW>
VKV_INLINE void panel_store(float* tile, typename Vec::R a0, typename Vec::R a1) {
  if constexpr (std::is_same_v<TW, c10::BFloat16>) {
    alignas(64) float even[Vec::W], odd[Vec::W];
    Vec::store(even, a0);
    Vec::store(odd, a1);
    for (int i = 0; i < Vec::W; ++i) {
      tile[2 * i] = even[i];
      tile[2 * i + 1] = odd[i];
    }
  } else {
    Vec::store(tile, a0);
    Vec::store(tile + Vec::W, a1);
  }
}

// `ahead`, if not null: the next panel, asked for line by line while this tile computes (the
// prefetcher alone leaves the first row block of a panel waiting on memory). `once`: this tile is
// the only one to read its panel (a step of at most kPanelRows rows, decode), so on an AMD CPU the
// next panel is asked for non-temporally and, read once, leaves the shared L3 to what is read
// again (the KV cache, the activations, the engine's Python between steps); steps of 2 to
// kPanelRows rows use it (one-row steps read panel_pair's two streams). Intel's non-temporal
// prefetch fills L1 alone, and a panel ahead (36 KiB in bf16, 72 in fp32) is as large as L1: its
// lines are gone before they are read, and read again from memory. So the hint is non-temporal on
// AMD only, into L2 elsewhere (`ahead_hint`). panel_pair's two streams keep the hardware's
// prefetch: either hint on the panels after theirs was slower or even. Measured:
// benchmarks/results/cpu/design_choices.json, "ahead_hint".
static const bool kAheadNonTemporal = [] {
  __builtin_cpu_init();  // (a static initializer may run before libgcc's own has)
  return __builtin_cpu_is("amd") > 0;
}();

std::string ahead_hint_text() {
#if defined(VKV_AVX512)
  constexpr const char* kFar = "";
#else
  constexpr const char* kFar = "; fp32 and bf16 ones 2 KiB past that into L2 too";  // (kStreamFar)
#endif
  return kAheadNonTemporal
             ? "non-temporal (an AMD CPU)"
             : std::string("into L2 (steps of 2-12 rows); one-row streams 1,024 weights ahead into L1 (int8: 4,096)") +
                   kFar;
}

template <typename TW, int MR>
VKV_INLINE void panel_tile(const float* x, int64_t K, const TW* w, const float* bias, float* out, int64_t N,
                           int64_t cols, const TW* ahead, bool once) {
  typename Vec::R acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = Vec::set1(0.f);
  constexpr int64_t kLines = (kPanel * sizeof(TW) + 63) / 64;  // cache lines of one k of a panel
  for (int64_t k = 0; k < K; ++k) {
    if (ahead)
      for (int64_t l = 0; l < kLines; ++l) {
        const char* line = reinterpret_cast<const char*>(ahead + k * kPanel) + 64 * l;
        if (once && kAheadNonTemporal)
          _mm_prefetch(line, _MM_HINT_NTA);
        else
          _mm_prefetch(line, _MM_HINT_T1);
      }
    typename Vec::R w0, w1;
    panel_load(w + k * kPanel, w0, w1);
    for (int m = 0; m < MR; ++m) {
      const typename Vec::R xb = Vec::set1(x[m * K + k]);
      acc[m][0] = Vec::fmadd(xb, w0, acc[m][0]);
      acc[m][1] = Vec::fmadd(xb, w1, acc[m][1]);
    }
  }
  alignas(64) float tile[kPanel];
  for (int m = 0; m < MR; ++m) {
    panel_store<TW>(tile, acc[m][0], acc[m][1]);
    float* o = out + m * N;
    for (int64_t c = 0; c < cols; ++c) o[c] = bias ? tile[c] + bias[c] : tile[c];
  }
}

// Rows [0, rows) of x over one panel, kPanelRows at a time, the last block as wide as is left;
// the first block fetches the next panel (`ahead`).
template <typename TW, int MR = kPanelRows>
VKV_INLINE void panel_rows(const float* x, int64_t rows, int64_t K, const TW* w, const float* bias, float* out,
                           int64_t N, int64_t cols, const TW* ahead, bool once) {
  if constexpr (MR > 1) {
    for (; rows >= MR; rows -= MR, x += MR * K, out += MR * N, ahead = nullptr)
      panel_tile<TW, MR>(x, K, w, bias, out, N, cols, ahead, once);
    if (rows > 0) panel_rows<TW, MR - 1>(x, rows, K, w, bias, out, N, cols, ahead, once);
  } else {
    for (; rows > 0; --rows, x += K, out += N, ahead = nullptr)
      panel_tile<TW, 1>(x, K, w, bias, out, N, cols, ahead, once);
  }
}

// One row over two panels at once: a thread's run of panels read as two streams side by side
// (its first half and its second), twice the loads in flight of one stream. Except on AMD CPUs,
// each stream also asks for its lines kStreamAhead weights ahead (into L1; panels lie one after
// another, so past a panel's end that is the next one's start). On the Intel Xeon a one-row
// `linear_panels` read well under the read probe with the hardware's prefetch alone: each core's
// own reads were the limit. So 1,024 weights ahead: 4 KiB of fp32, 2 KiB of bf16; int8 panels
// (the bf16 model's pick) 4,096 weights, 4 KiB as fp32's. Where a k's row is under a line (bf16
// and int8 on AVX2, int8 on AVX-512) a line is asked for once a k (once a line was no better).
// On AMD CPUs the hardware's prefetch alone reads at the probe's rate: left as it is there.
// Measured: benchmarks/results/cpu/design_choices.json, "stream_ahead".
template <typename TW>
constexpr int64_t kStreamAhead = sizeof(TW) == 1 ? 4096 : 1024;
// The AVX2 kernels' fp32 and bf16 streams also ask for a line into L2 2 KiB past the one they ask
// into L1 (kStreamFar, in bytes; once a line), so more of each stream is on its way from memory than
// L1's own misses allow. Not for the int8 pick's streams (no faster there), nor in the AVX-512
// kernels, whose row of a k is twice as wide (slower in bf16). Measured:
// benchmarks/results/cpu/design_choices.json, "stream_far".
#if defined(VKV_AVX512)
template <typename TW>
constexpr int64_t kStreamFar = 0;
#else
template <typename TW>
constexpr int64_t kStreamFar = sizeof(TW) == 1 ? 0 : kStreamAhead<TW> * static_cast<int64_t>(sizeof(TW)) + 2048;
#endif

template <typename TW>
VKV_INLINE void panel_pair(const float* x, int64_t K, const TW* wa, const TW* wb, const float* bias_a,
                           const float* bias_b, float* out_a, float* out_b, int64_t cols_a, int64_t cols_b) {
  typename Vec::R a0 = Vec::set1(0.f), a1 = Vec::set1(0.f), b0 = Vec::set1(0.f), b1 = Vec::set1(0.f);
  constexpr int64_t kRowBytes = kPanel * sizeof(TW);  // what each stream reads a k
  for (int64_t k = 0; k < K; ++k) {
    if (!kAheadNonTemporal) {
      const char* ahead_a = reinterpret_cast<const char*>(wa + k * kPanel + kStreamAhead<TW>);
      const char* ahead_b = reinterpret_cast<const char*>(wb + k * kPanel + kStreamAhead<TW>);
      for (int64_t o = 0; o < kRowBytes; o += 64) {
        _mm_prefetch(ahead_a + o, _MM_HINT_T0);
        _mm_prefetch(ahead_b + o, _MM_HINT_T0);
      }
      if constexpr (kStreamFar<TW> > 0) {
        const char* far_a = reinterpret_cast<const char*>(wa + k * kPanel) + kStreamFar<TW>;
        const char* far_b = reinterpret_cast<const char*>(wb + k * kPanel) + kStreamFar<TW>;
        // (a row under a line: asked for by the k whose row starts in the line's first kRowBytes)
        const bool line_a = kRowBytes >= 64 || (reinterpret_cast<uintptr_t>(far_a) & 63) < kRowBytes;
        const bool line_b = kRowBytes >= 64 || (reinterpret_cast<uintptr_t>(far_b) & 63) < kRowBytes;
        for (int64_t o = 0; o < kRowBytes; o += 64) {
          if (line_a) _mm_prefetch(far_a + o, _MM_HINT_T1);
          if (line_b) _mm_prefetch(far_b + o, _MM_HINT_T1);
        }
      }
    }
    const typename Vec::R xb = Vec::set1(x[k]);
    typename Vec::R wa0, wa1, wb0, wb1;
    panel_load(wa + k * kPanel, wa0, wa1);
    panel_load(wb + k * kPanel, wb0, wb1);
    a0 = Vec::fmadd(xb, wa0, a0);
    a1 = Vec::fmadd(xb, wa1, a1);
    b0 = Vec::fmadd(xb, wb0, b0);
    b1 = Vec::fmadd(xb, wb1, b1);
  }
  alignas(64) float tile[2 * kPanel];
  panel_store<TW>(tile, a0, a1);
  panel_store<TW>(tile + kPanel, b0, b1);
  for (int64_t c = 0; c < cols_a; ++c) out_a[c] = bias_a ? tile[c] + bias_a[c] : tile[c];
  for (int64_t c = 0; c < cols_b; ++c) out_b[c] = bias_b ? tile[kPanel + c] + bias_b[c] : tile[kPanel + c];
}

// One row over panels [lo, hi) (a thread's run): its first half and its second as panel_pair's two
// streams, an odd panel left alone.
template <typename TW>
void row_over_panels(const float* x, int64_t K, const TW* w, int64_t N, const float* bias, float* out, int64_t lo,
                     int64_t hi) {
  const int64_t half = (hi - lo) / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t pa = lo + i, pb = lo + half + i;
    panel_pair<TW>(x, K, w + pa * K * kPanel, w + pb * K * kPanel, bias ? bias + pa * kPanel : nullptr,
                   bias ? bias + pb * kPanel : nullptr, out + pa * kPanel, out + pb * kPanel,
                   std::min(kPanel, N - pa * kPanel), std::min(kPanel, N - pb * kPanel));
  }
  for (int64_t p = lo + 2 * half; p < hi; ++p)
    panel_tile<TW, 1>(x, K, w + p * K * kPanel, bias ? bias + p * kPanel : nullptr, out + p * kPanel, N,
                      std::min(kPanel, N - p * kPanel), nullptr, true);
}

template <typename TW, typename Then = std::nullptr_t>
void linear_panels_impl(const float* x, int64_t M, int64_t K, const TW* w, int64_t N, const float* bias, float* out,
                        Then* then = nullptr) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  if (M == 1) {
    at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
      row_over_panels<TW>(x, K, w, N, bias, out, lo, hi);
      run_then(then);
    });
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kPanelChunk) {
    const int64_t rows = std::min(kPanelChunk, M - m0);
    at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t n0 = p * kPanel;
        panel_rows<TW>(x + m0 * K, rows, K, w + p * K * kPanel, bias ? bias + n0 : nullptr, out + m0 * N + n0, N,
                       std::min(kPanel, N - n0), p + 1 < hi ? w + (p + 1) * K * kPanel : nullptr, rows <= kPanelRows);
      }
      if (m0 + kPanelChunk >= M) run_then(then);  // (the last chunk's share)
    });
  }
}

// Note [bf16 steps in bf16 dot products]
// Rationale: where bf16 arithmetic is native, steps of many rows were oneDNN's packed bf16 GEMM's,
// and decode's bf16 panels were kept beside it: two packings of every projection, twice the
// weights' memory, and a weights update (or a wake-up from sleep level 2) that writes both.
// Approach: with AVX512-BF16 (`VKV_BF16_DOT`), bf16 x over the same bf16 panels runs in
// vdpbf16ps: each instruction multiplies two k's of 16 columns (x's pair broadcast, the weights'
// pair interleaved) into fp32 sums, twice an fp32 FMA's products. The panels keep decode's layout
// ([P, K, kPanel]): a pair of k's rows is interleaved in registers (two shifts, two blends) once
// for a whole tile of rows, the accumulators split into even and odd columns as panel_load's
// bf16 widening splits them, and put back in order by two permutes as the tile is stored.
// Implementation: x is first packed by tiles of rows, each tile's pairs of k side by side
// (`pack_pairs`: x's rows lie K apart, 4 KiB and more at 1B shapes, all in the same L1 sets, and
// unpacked a tile's twelve rows thrashed them); K runs in blocks of kDotK (a block of a panel is
// read by every row tile of a chunk while it is in L1 or L2), the sums of a block after the first
// starting from the thread's buffer. Out is fp32, or bf16 rounded to nearest even
// (vcvtneps2bf16: the engine's activations, no second pass). Limitations: the products are
// bf16's (x in bf16, as oneDNN's bf16 GEMM rounds it), each instruction adds its two products
// before the running sum, denormals are flushed; 0.86-1.2x oneDNN's bf16 GEMM on the Zen 4
// from 16 rows (benchmarks/results/cpu/gemm_bf16_zen4.json). Only builds with AVX512-BF16 have it
// (`bf16_dot()`); elsewhere bf16 x is refused, and where the CPU has AMX oneDNN's bf16 GEMM runs on
// its tiles instead (ext.bf16_dot_gemm).
#if defined(VKV_AVX512) && defined(__AVX512BF16__) && !defined(VKV_EMULATE_AVX512)
#define VKV_BF16_DOT 1
constexpr int64_t kDotK = 512;  // (even: a pair of k never straddles two blocks)

// Rows [0, MR) of x times k's [0, kc) of a panel (w at its block's first k), x as `pack_pairs`
// packed them (xp at the block's first pair). The sums so far are `sums` ([MR][2][16], the
// accumulators' own layout), read unless `first`; the last block writes out's columns [0, cols)
// (bias added, given), the others the sums.
template <int MR, typename TO>
VKV_INLINE void dot_tile(const uint32_t* xp, int64_t kc, const c10::BFloat16* w, float* sums, bool first, bool last,
                         const float* bias, TO* out, int64_t N, int64_t cols) {
  static_assert(kPanel == 32, "two vectors of 16 fp32 sums a panel");
  constexpr __mmask32 kHigh = 0xAAAAAAAAu;  // the high bf16 of each 32-bit lane
  auto bh = [](__m512i v) { return (__m512bh)v; };  // (the same bits, as vdpbf16ps takes them)
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) acc[m][h] = first ? _mm512_setzero_ps() : _mm512_load_ps(sums + (2 * m + h) * 16);
  auto step = [&](const uint32_t* pairs, __m512bh even, __m512bh odd) {
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = bh(_mm512_set1_epi32(static_cast<int>(pairs[m])));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], even, xb);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], odd, xb);
    }
  };
  int64_t k = 0;
  for (; k + 2 <= kc; k += 2) {
    const __m512i r0 = _mm512_loadu_si512(reinterpret_cast<const void*>(w + k * kPanel));
    const __m512i r1 = _mm512_loadu_si512(reinterpret_cast<const void*>(w + (k + 1) * kPanel));
    // lane i: column 2i at k and k + 1 (even); column 2i + 1 at k and k + 1 (odd)
    step(xp + k / 2 * MR, bh(_mm512_mask_blend_epi16(kHigh, r0, _mm512_slli_epi32(r1, 16))),
         bh(_mm512_mask_blend_epi16(kHigh, _mm512_srli_epi32(r0, 16), r1)));
  }
  if (k < kc) {  // an odd K's last k (x's pair: its other half zero)
    const __m512i r0 = _mm512_loadu_si512(reinterpret_cast<const void*>(w + k * kPanel));
    step(xp + k / 2 * MR, bh(_mm512_maskz_mov_epi16(~kHigh, r0)), bh(_mm512_srli_epi32(r0, 16)));
  }
  if (!last) {
    for (int m = 0; m < MR; ++m)
      for (int h = 0; h < 2; ++h) _mm512_store_ps(sums + (2 * m + h) * 16, acc[m][h]);
    return;
  }
  // columns back in order (even and odd lanes interleaved: [0, 16) and [16, 32)), bias added
  const __m512i first_half = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second_half = _mm512_add_epi32(first_half, _mm512_set1_epi32(8));
  const __mmask16 keep0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 keep1 = cols >= 32 ? 0xffff : cols > 16 ? static_cast<__mmask16>((1u << (cols - 16)) - 1) : 0;
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(keep0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(keep1, bias + 16) : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) {
      const __m512 c = _mm512_add_ps(_mm512_permutex2var_ps(acc[m][0], h ? second_half : first_half, acc[m][1]),
                                     h ? b1 : b0);
      if constexpr (std::is_same_v<TO, float>)
        _mm512_mask_storeu_ps(out + m * N + 16 * h, h ? keep1 : keep0, c);
      else  // (rounded to nearest even, as torch rounds; NaN stays NaN)
        _mm256_mask_storeu_epi16(out + m * N + 16 * h, h ? keep1 : keep0, (__m256i)_mm512_cvtneps_pbh(c));
    }
}

// x [M, K] bf16 as dot_tile reads it: each tile of kPanelRows rows (the last of what is left), at
// the tile's first row times K, its rows' pairs of k side by side: pair j of row m at j * rows + m
// (x[m][2j] low, x[m][2j + 1] high; an odd K's last pair zero above). A tile's x for a block is one
// stream, and its rows, K apart in x (4 KiB and more: the same L1 sets), are not read apart.
inline int64_t tile_rows(int64_t M, int64_t t) { return std::min<int64_t>(kPanelRows, M - t * kPanelRows); }

void pack_pairs(const c10::BFloat16* x, int64_t M, int64_t K, uint32_t* xp) {
  const int64_t pairs = (K + 1) / 2;
  at::parallel_for(0, (M + kPanelRows - 1) / kPanelRows, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t mr = tile_rows(M, t);
      uint32_t* dst = xp + t * kPanelRows * pairs;
      for (int64_t m = 0; m < mr; ++m) {
        const uint16_t* row = reinterpret_cast<const uint16_t*>(x + (t * kPanelRows + m) * K);
        for (int64_t j = 0; j < pairs; ++j)
          dst[j * mr + m] = row[2 * j] | (2 * j + 1 < K ? static_cast<uint32_t>(row[2 * j + 1]) << 16 : 0u);
      }
    }
  });
}

template <int MR = kPanelRows, typename TO>
VKV_INLINE void dot_rows(const uint32_t* xp, int64_t rows, int64_t pairs, int64_t j0, int64_t kc,
                         const c10::BFloat16* w, float* sums, bool first, bool last, const float* bias, TO* out,
                         int64_t N, int64_t cols) {
  for (; rows >= MR; rows -= MR, xp += MR * pairs, out += MR * N, sums += MR * kPanel)
    dot_tile<MR, TO>(xp + j0 * MR, kc, w, sums, first, last, bias, out, N, cols);
  if constexpr (MR > 1)
    if (rows > 0) dot_rows<MR - 1, TO>(xp, rows, pairs, j0, kc, w, sums, first, last, bias, out, N, cols);
}

// out = x W^T + bias, x [M, K] bf16 (packed first), W's bf16 panels, in chunks of kPanelChunk rows;
// a thread takes its panels one by one, each K block of a panel over every row tile of the chunk,
// the chunk's sums for the panel kept between blocks in the thread's own buffer (24 KiB).
template <typename TO>
void linear_panels_dot(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* w, int64_t N,
                       const float* bias, TO* out) {
  const int64_t P = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2;
  std::vector<uint32_t> xp(M * pairs);
  pack_pairs(x, M, K, xp.data());
  for (int64_t m0 = 0; m0 < M; m0 += kPanelChunk) {
    const int64_t rows = std::min(kPanelChunk, M - m0);
    at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
      alignas(64) float sums[kPanelChunk * kPanel];
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t n0 = p * kPanel;
        for (int64_t k0 = 0; k0 < K; k0 += kDotK) {
          const int64_t kc = std::min(kDotK, K - k0);
          dot_rows(xp.data() + m0 * pairs, rows, pairs, k0 / 2, kc, w + (p * K + k0) * kPanel, sums, k0 == 0,
                   k0 + kc == K, bias ? bias + n0 : nullptr, out + m0 * N + n0, N, std::min(kPanel, N - n0));
        }
      }
    });
  }
}
#endif
#else
constexpr int64_t kPanel = 16;

std::string ahead_hint_text() { return "none (the scalar build)"; }

template <typename TW, typename Then = std::nullptr_t>
void linear_panels_impl(const float* x, int64_t M, int64_t K, const TW* w, int64_t N, const float* bias, float* out,
                        Then* then = nullptr) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
    float acc[kPanel];
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      const TW* wp = w + p * K * kPanel;
      for (int64_t m = 0; m < M; ++m) {
        std::fill(acc, acc + kPanel, 0.f);
        // a multiply and an add, not std::fma: a CPU without FMA runs std::fma in software (the
        // scalar build's 32-row step took 54 s on it), and the compiler vectorizes these for SSE2
        for (int64_t k = 0; k < K; ++k)
          for (int64_t c = 0; c < kPanel; ++c) acc[c] += x[m * K + k] * load(wp[k * kPanel + c]);
        for (int64_t c = 0; c < cols; ++c) out[m * N + n0 + c] = bias ? acc[c] + bias[n0 + c] : acc[c];
      }
    }
    run_then(then);
  });
}
#endif

// out = x W^T, and `then` (given) run by each thread once its share of the panels is done: the
// op linear_panels, and decode_layer's down projection with the next layer's NextContext. N (the
// weight's rows before padding) is out's width.
template <typename Then = std::nullptr_t>
void linear_panels_then(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        at::Tensor out, Then* then = nullptr) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be [rows, K] fp32 or bf16 contiguous");
  TORCH_CHECK(out.dim() == 2, "out must be [rows, N]");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel && panels.size(1) == K &&
              panels.size(0) == (N + kPanel - 1) / kPanel,
              "panels must be [ceil(N / panel_width()), K, panel_width()] contiguous");
  const bool bf16_out = x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16;
  TORCH_CHECK(out.is_contiguous() && (out.scalar_type() == at::kFloat || bf16_out) && out.size(0) == M,
              "out must be [rows, N] fp32 (or bf16, x being bf16) contiguous");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == N),
              "bias must be [N] fp32");
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kBFloat16) {  // Note [bf16 steps in bf16 dot products]
    TORCH_CHECK(panels.scalar_type() == at::kBFloat16, "bf16 x needs bf16 panels");
#if defined(VKV_BF16_DOT)
    TORCH_CHECK((std::is_same_v<Then, std::nullptr_t>), "bf16 x: linear_panels alone");
    if (bf16_out)
      linear_panels_dot(x.data_ptr<c10::BFloat16>(), M, K, panels.data_ptr<c10::BFloat16>(), N, b,
                        out.data_ptr<c10::BFloat16>());
    else
      linear_panels_dot(x.data_ptr<c10::BFloat16>(), M, K, panels.data_ptr<c10::BFloat16>(), N, b,
                        out.data_ptr<float>());
#else
    TORCH_CHECK(false, "bf16 x needs AVX512-BF16 in the kernels' build (bf16_dot() is false)");
#endif
  } else if (panels.scalar_type() == at::kFloat)
    linear_panels_impl(x.data_ptr<float>(), M, K, panels.data_ptr<float>(), N, b, out.data_ptr<float>(), then);
  else if (panels.scalar_type() == at::kBFloat16)
    linear_panels_impl(x.data_ptr<float>(), M, K, panels.data_ptr<c10::BFloat16>(), N, b, out.data_ptr<float>(),
                       then);
  else if (panels.scalar_type() == at::kChar)
    linear_panels_impl(x.data_ptr<float>(), M, K, panels.data_ptr<int8_t>(), N, b, out.data_ptr<float>(), then);
  else
    TORCH_CHECK(false, "linear_panels reads fp32 or bf16 panels");
}


// The gate/up projection of a one-row step with silu(gate) * up folded in (decode_layer): the fused
// weight's gate panel p and up panel P + p are read side by side as panel_pair's two streams, and
// the thread that computed those kPanel columns writes their activations at once. silu_and_mul after
// the projection read the whole [gate | up] row back on one thread, half of it from the other
// core's cache, while the other core waited. The same products in the same order, and the same
// silu (silu_times): the same bits. Measured: benchmarks/results/cpu/design_choices.json,
// "gate_up_silu".
// False where it does not apply (more rows, an intermediate size off the panel width, the scalar
// build): the caller runs both steps.
// A projection's panels as the one-row kernels read them (raw: StepPlan gathers them once a call).
struct PanelsRef {
  const void* w;
  int64_t P, K;  // panels, and rows a panel
  bool bf16;     // else fp32
};
PanelsRef panels_ref(const at::Tensor& panels) {
  return {panels.data_ptr(), panels.size(0), panels.size(1), panels.scalar_type() == at::kBFloat16};
}

#if defined(VKV_VEC)
// Its columns of panels [lo, hi) of the gate (and the same of the up), on the calling thread: x
// [K] fp32, act [panels.P / 2 * kPanel] fp32.
void gate_up_silu_share(const float* x, const PanelsRef& panels, float* act, int64_t lo, int64_t hi) {
  const int64_t K = panels.K, P = panels.P / 2;
  auto run = [&](auto* w) {
    alignas(64) float gate[kPanel], up[kPanel];
    for (int64_t p = lo; p < hi; ++p) {
      panel_pair(x, K, w + p * K * kPanel, w + (P + p) * K * kPanel, nullptr, nullptr, gate, up, kPanel, kPanel);
      float* dst = act + p * kPanel;
#pragma omp simd
      for (int64_t j = 0; j < kPanel; ++j) dst[j] = silu_times<float>(gate[j], up[j]);
    }
  };
  if (panels.bf16)
    run(static_cast<const c10::BFloat16*>(panels.w));
  else
    run(static_cast<const float*>(panels.w));
}
#endif

// Whether linear_panels takes bf16 x (Note [bf16 steps in bf16 dot products]).
bool bf16_dot() {
#if defined(VKV_BF16_DOT)
  return true;
#else
  return false;
#endif
}

bool gate_up_silu_applies(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& act) {
#if defined(VKV_VEC)
  const int64_t K = x.size(1), I = act.size(1), P = I / kPanel;
  return x.size(0) == 1 && I % kPanel == 0 && panels.size(0) == 2 * P && panels.size(1) == K &&
         (panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kBFloat16);
#else
  return false;
#endif
}

bool gate_up_silu(const at::Tensor& x, const at::Tensor& panels, at::Tensor& act) {
  if (!gate_up_silu_applies(x, panels, act)) return false;
#if defined(VKV_VEC)
  const PanelsRef ref = panels_ref(panels);
  at::parallel_for(0, act.size(1) / kPanel, 1, [&](int64_t lo, int64_t hi) {
    gate_up_silu_share(x.data_ptr<float>(), ref, act.data_ptr<float>(), lo, hi);
  });
#endif
  return true;
}
}  // namespace vkv
