// The vector layer and the primitives every kernel family shares: the ISA the build may use
// (`Vec`: AVX-512, AVX2 + FMA, or none), loads and rounding of bf16 and fp8, a few rows' dot
// products against cache rows. Every family's file includes this first.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <dlfcn.h>
#include <immintrin.h>

// The vector layer's ISA (`Vec` below): AVX-512 where the compiler may use it, else AVX2 + FMA,
// else none. VKV_EMULATE_AVX512 (tests only, ext/__init__.py: VKV_CPU_ISA=avx512-emulated)
// builds the AVX-512 layer on a CPU without it: SIMDe implements each AVX-512 intrinsic with
// the ISA the CPU has, so the AVX-512 tiles, tails and lane counts run, and are tested, anywhere.
#if defined(VKV_EMULATE_AVX512)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define VKV_AVX512 1
// The four intrinsics used below that SIMDe 0.8 lacks, from ones it has (same results).
#define _mm512_cvtepu8_epi32(a) _mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(a))
#define _mm512_cvtepi8_epi32(a) _mm512_cvtepi16_epi32(_mm256_cvtepi8_epi16(a))
#define _mm512_cmplt_epi32_mask(a, b) _mm512_cmpgt_epi32_mask((b), (a))
#define _mm512_reduce_add_ps(x) vkv_reduce_add_ps(x)
inline float vkv_reduce_add_ps(__m512 x) {  // halves added pairwise, as the native one does
  alignas(64) float t[16];
  _mm512_store_ps(t, x);
  for (int w = 8; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}
#elif defined(__AVX512F__)
#define VKV_AVX512 1
#endif
#if defined(VKV_AVX512) || (defined(__AVX2__) && defined(__FMA__))
#define VKV_VEC 1
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace vkv {

#define VKV_INLINE inline __attribute__((always_inline))  // the vectorized loops need these inlined

// linear_panels_impl's `then`: run by each thread once its share of the panels is done (none: nothing)
template <typename Then>
VKV_INLINE void run_then(Then* then) {
  if constexpr (!std::is_same_v<Then, std::nullptr_t>)
    if (then) then->run();
}

VKV_INLINE float load(float x) { return x; }
VKV_INLINE float load(int8_t x) { return x; }  // (the greedy pick's int8 copy of a bf16 LM head)
VKV_INLINE float load(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
VKV_INLINE void store(float* p, float x) { *p = x; }
VKV_INLINE void store(c10::BFloat16* p, float x) { *p = c10::BFloat16(x); }  // round to nearest even

// fp8 caches, unscaled (vLLM's default scale of 1): decoded by moving the exponent and mantissa
// bits into an fp32's and rebiasing; the subnormals (a zero exponent) are the magnitude's integer
// times the smallest step. Stores round to nearest even and saturate at the format's largest
// finite value (e5m2 would overflow to infinity, e4m3fn to NaN).
template <typename F>
struct Fp8;
template <>
struct Fp8<c10::Float8_e4m3fn> {  // 4 exponent bits (bias 7), 3 mantissa bits; 0x7f is NaN, no infinity
  static constexpr int kShift = 20, kBias = 127 - 7, kSubBelow = 8, kNanFrom = 0x7f, kInf = 0x100;
  static constexpr float kStep = 1.0f / 512, kMax = 448.0f;
};
template <>
struct Fp8<c10::Float8_e5m2> {  // 5 exponent bits (bias 15), 2 mantissa bits; 0x7c is infinity, above NaN
  static constexpr int kShift = 21, kBias = 127 - 15, kSubBelow = 4, kNanFrom = 0x7d, kInf = 0x7c;
  static constexpr float kStep = 1.0f / 65536, kMax = 57344.0f;
};
template <typename F>
VKV_INLINE float fp8_load(uint8_t b) {
  const uint32_t mag = b & 0x7fu, bits = (mag << Fp8<F>::kShift) + (static_cast<uint32_t>(Fp8<F>::kBias) << 23);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  f = mag < Fp8<F>::kSubBelow ? static_cast<float>(mag) * Fp8<F>::kStep : f;
  // NaN and infinity as themselves (a NaN stored from poisoned activations must not come back
  // as 480 or 114,688 and slip past the sampler's check)
  f = mag >= static_cast<uint32_t>(Fp8<F>::kNanFrom) ? std::numeric_limits<float>::quiet_NaN() : f;
  f = mag == static_cast<uint32_t>(Fp8<F>::kInf) ? std::numeric_limits<float>::infinity() : f;
  return (b & 0x80u) ? -f : f;
}
VKV_INLINE float load(c10::Float8_e4m3fn x) { return fp8_load<c10::Float8_e4m3fn>(x.x); }
VKV_INLINE float load(c10::Float8_e5m2 x) { return fp8_load<c10::Float8_e5m2>(x.x); }
template <typename F>
VKV_INLINE void fp8_store(F* p, float x) {
  *p = F(std::min(std::max(x, -Fp8<F>::kMax), Fp8<F>::kMax));
}
VKV_INLINE void store(c10::Float8_e4m3fn* p, float x) { fp8_store(p, x); }
VKV_INLINE void store(c10::Float8_e5m2* p, float x) { fp8_store(p, x); }
template <typename C>
constexpr bool kIsFp8 = std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>;

// x as T would hold it (what torch's op in dtype T rounds each intermediate to).
template <typename T>
VKV_INLINE float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;  // nearest even, as c10::BFloat16 (finite x)
    float r;
    std::memcpy(&r, &bits, sizeof r);
    return r;
  }
}

// exp(x), vectorizable (no branches, no calls): Cephes' expf, 2^n * p(r) with r = x - n ln2 in
// [-ln2/2, ln2/2]; relative error about 1e-7. x is clamped to [-87, 88].
VKV_INLINE float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = std::fma(n, -1.428606765330187e-06f, std::fma(n, -0.693145751953125f, x));
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r + 1.0f);
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

constexpr int64_t kKeyBlock = 256;   // keys per tile
constexpr int64_t kQueryBlock = 32;  // query positions per work item

// MKL as linked into libtorch_cpu (x86 builds), found at run time: scores and weighted values
// are two small GEMMs per tile, read straight from the cache (its row stride is the leading
// dimension). Without it (other builds) the loops below do the same arithmetic.
extern "C" {
using sgemm_t = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                         const int*, const float*, const int*, const float*, float*, const int*);
using bgemm_t = void (*)(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*, int, float,
                         float*, int);
using threads_t = int (*)(int);
}
struct Blas {
  sgemm_t sgemm = reinterpret_cast<sgemm_t>(dlsym(RTLD_DEFAULT, "sgemm_"));
  bgemm_t bgemm = reinterpret_cast<bgemm_t>(dlsym(RTLD_DEFAULT, "cblas_gemm_bf16bf16f32"));
  threads_t local_threads = reinterpret_cast<threads_t>(dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local"));
};
const Blas& blas() {
  static const Blas b;
  return b;
}
constexpr int kColMajor = 102, kNoTrans = 111, kTrans = 112;  // CBLAS enums

struct Item {
  int64_t seq, q_lo, q_hi, k_lo, k_hi;
  int64_t part;  // -1: writes the output; else index of its partial result
};

template <typename C>  // a cache tensor's data as C (fp8 included)
C* cache_ptr(const at::Tensor& t) {
  return reinterpret_cast<C*>(t.data_ptr());
}

template <typename T>
struct Rows {  // where sequence b's positions live in a cache tensor [blocks, rows, heads, D]
  const T* base;
  int64_t s_block, s_row, s_head;
  const int32_t* table;
  int64_t table_stride, block_size;
  inline const T* row(int64_t b, int64_t block, int64_t row, int64_t h) const {  // position block * size + row
    return base + table[b * table_stride + block] * s_block + row * s_row + h * s_head;
  }
};

// n rows of D values from x (row stride lda) into `wide` as T, D apart: a narrower cache's tile
// for the activations' GEMM (bf16 or fp8 under fp32, fp8 under bf16; every such widening is exact).
template <typename T, typename C>
const T* widen(const C* x, int64_t lda, int64_t n, int64_t D, std::vector<float>& wide) {
  wide.resize(n * D);
  for (int64_t j = 0; j < n; ++j) {
    T* dst = reinterpret_cast<T*>(wide.data()) + j * D;
    const C* src = x + j * lda;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) store(dst + d, load(src[d]));
  }
  return reinterpret_cast<const T*>(wide.data());
}

// S[r][j] = q_r . k_j for the n keys from k0 (rows of one block), R query rows (unscaled).
// T: the queries' type; C: the cache's (T, or narrower: see `dispatch`).
template <typename T, typename C>
void scores(const C* k0, int64_t lda, int64_t n, const T* Q, int64_t R, int64_t D, float* S, std::vector<float>& wide) {
  if constexpr (!std::is_same_v<T, C>) {
    return scores<T, T>(widen<T>(k0, lda, n, D, wide), D, n, Q, R, D, S, wide);
  } else if constexpr (std::is_same_v<T, float>) {
    if (blas().sgemm) {
      const int m = n, nr = R, kd = D, ld = lda, ldq = D, lds = kKeyBlock;
      const float one = 1.0f, zero = 0.0f;
      blas().sgemm("T", "N", &m, &nr, &kd, &one, k0, &ld, Q, &ldq, &zero, S, &lds);
      return;
    }
  } else {
    if (blas().bgemm) {
      blas().bgemm(kColMajor, kTrans, kNoTrans, n, R, D, 1.0f, reinterpret_cast<const uint16_t*>(k0), lda,
                   reinterpret_cast<const uint16_t*>(Q), D, 0.0f, S, kKeyBlock);
      return;
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) {
      const C* kr = k0 + j * lda;
      const T* qr = Q + r * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += load(qr[d]) * load(kr[d]);
      S[r * kKeyBlock + j] = dot;
    }
}

// acc[r] += sum_j P[r][j] v_j over the n keys from v0.
template <typename T, typename C>
void weigh(const C* v0, int64_t lda, int64_t n, const T* P, int64_t R, int64_t D, float* acc, std::vector<float>& wide) {
  if constexpr (!std::is_same_v<T, C>) {
    return weigh<T, T>(widen<T>(v0, lda, n, D, wide), D, n, P, R, D, acc, wide);
  } else if constexpr (std::is_same_v<T, float>) {
    if (blas().sgemm) {
      const int md = D, nr = R, kn = n, ld = lda, ldp = kKeyBlock, ldc = D;
      const float one = 1.0f;
      blas().sgemm("N", "N", &md, &nr, &kn, &one, v0, &ld, P, &ldp, &one, acc, &ldc);
      return;
    }
  } else {
    if (blas().bgemm) {
      blas().bgemm(kColMajor, kNoTrans, kNoTrans, D, R, n, 1.0f, reinterpret_cast<const uint16_t*>(v0), lda,
                   reinterpret_cast<const uint16_t*>(P), kKeyBlock, 1.0f, acc, D);
      return;
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) {
      const float p = load(P[r * kKeyBlock + j]);
      const C* vr = v0 + j * lda;
      float* a = acc + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] = std::fma(p, load(vr[d]), a[d]);
    }
}

// The same two products for a few query rows (decode): per key, its row is loaded once and
// dotted with every query row in vector registers; no GEMM call (whose per-call cost dominates
// at three rows). Q is fp32 here. Returns false where the vector path does not apply.
constexpr int64_t kFewRows = 8;

// The vector layer: everything the decode rows need from an ISA, in one place. The rows below
// are written once over `Vec`; a build for a narrower ISA (ext/__init__.py: VKV_CPU_ISA) swaps
// this layer alone. kChunk vectors of a row are held at once (D wider than that goes in chunks);
// kScoreRows / kWeighRows: query rows per pass for chunks of 4 and 8 vectors, by register count.
#if defined(VKV_AVX512)
#if defined(VKV_EMULATE_AVX512)
#define VKV_ISA "avx512-emulated"
#else
#define VKV_ISA "avx512"
#endif
struct Vec {
  using R = __m512;
  static constexpr int W = 16;
  static VKV_INLINE R load(const float* p) { return _mm512_loadu_ps(p); }
  static VKV_INLINE R load(const c10::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  template <typename F, typename = std::enable_if_t<kIsFp8<F>>>
  static VKV_INLINE R load(const F* p) {  // fp8_load, 16 lanes
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7f));
    const __m512 normal = _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_slli_epi32(mag, Fp8<F>::kShift), _mm512_set1_epi32(Fp8<F>::kBias << 23)));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(Fp8<F>::kStep));
    const __mmask16 is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(Fp8<F>::kSubBelow));
    const __mmask16 is_nan = _mm512_cmpge_epi32_mask(mag, _mm512_set1_epi32(Fp8<F>::kNanFrom));
    const __mmask16 is_inf = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(Fp8<F>::kInf));
    __m512 f = _mm512_mask_blend_ps(is_sub, normal, sub);
    f = _mm512_mask_blend_ps(is_nan, f, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
    f = _mm512_mask_blend_ps(is_inf, f, _mm512_set1_ps(std::numeric_limits<float>::infinity()));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
  }
  static VKV_INLINE void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  static VKV_INLINE R set1(float x) { return _mm512_set1_ps(x); }
  static VKV_INLINE R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static VKV_INLINE R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static VKV_INLINE float sum(R x) { return _mm512_reduce_add_ps(x); }
};
constexpr int kScoreRows[2] = {3, 2}, kWeighRows[2] = {6, 3};  // 32 registers
#elif defined(__AVX2__) && defined(__FMA__)
#define VKV_ISA "avx2"
struct Vec {
  using R = __m256;
  static constexpr int W = 8;
  static VKV_INLINE R load(const float* p) { return _mm256_loadu_ps(p); }
  static VKV_INLINE R load(const c10::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  template <typename F, typename = std::enable_if_t<kIsFp8<F>>>
  static VKV_INLINE R load(const F* p) {  // fp8_load, 8 lanes
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7f));
    const __m256 normal = _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_slli_epi32(mag, Fp8<F>::kShift), _mm256_set1_epi32(Fp8<F>::kBias << 23)));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(Fp8<F>::kStep));
    const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(Fp8<F>::kSubBelow), mag));
    const __m256 is_nan = _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, _mm256_set1_epi32(Fp8<F>::kNanFrom - 1)));
    const __m256 is_inf = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(Fp8<F>::kInf)));
    __m256 f = _mm256_blendv_ps(normal, sub, is_sub);
    f = _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), is_nan);
    f = _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::infinity()), is_inf);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
    return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
  }
  static VKV_INLINE void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  static VKV_INLINE R set1(float x) { return _mm256_set1_ps(x); }
  static VKV_INLINE R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static VKV_INLINE R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static VKV_INLINE float sum(R x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
// 16 registers. Scores over 8 vectors (a 64-wide head) take 3 query rows a pass, more than the
// registers hold: the queries are read from L1 as the multiplies' operands, and each key is loaded
// (and, from a bf16 cache, widened) once for a KV head's 3 query heads instead of once for each.
// (Measured: benchmarks/results/cpu/design_choices.json, "score_rows".)
constexpr int kScoreRows[2] = {2, 3}, kWeighRows[2] = {3, 1};
#else
#define VKV_ISA "scalar"
#endif

#if defined(VKV_VEC)
constexpr int kChunk = 8;

// Rows far apart (the interleaved layout's stride is a whole token of every layer) defeat the
// hardware prefetcher, which stops at page boundaries: ask for rows a few keys ahead.
constexpr int64_t kPrefetch = 6;
template <typename T, int C>
VKV_INLINE void prefetch_row(const T* row) {
  for (int64_t byte = 0; byte < C * Vec::W * static_cast<int64_t>(sizeof(T)); byte += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + byte, _MM_HINT_T0);
}

// Scores over C vectors of each row: the query rows stay in registers, RB rows at a time; per
// key, C fused multiply-adds per row, then one horizontal sum (added to S after the first chunk).
template <typename T, int C, int RB>
void scores_rows(const T* k0, int64_t lda, int64_t n, const float* Qf, int64_t D, float* S, bool add) {
  typename Vec::R q[RB][C];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < C; ++c) q[r][c] = Vec::load(Qf + r * D + Vec::W * c);
  for (int64_t j = 0; j < n; ++j) {
    const T* kr = k0 + j * lda;
    if (j + kPrefetch < n) prefetch_row<T, C>(kr + kPrefetch * lda);
    typename Vec::R k[C];
    for (int c = 0; c < C; ++c) k[c] = Vec::load(kr + Vec::W * c);
    for (int r = 0; r < RB; ++r) {
      typename Vec::R a = Vec::mul(q[r][0], k[0]);
      for (int c = 1; c < C; ++c) a = Vec::fmadd(q[r][c], k[c], a);
      const float dot = Vec::sum(a);
      S[r * kKeyBlock + j] = add ? S[r * kKeyBlock + j] + dot : dot;
    }
  }
}

// Weighted values over C vectors of each row: the accumulators stay in registers, RB rows at a
// time, across the tile.
template <typename T, typename TP, int C, int RB>
void weigh_rows(const T* v0, int64_t lda, int64_t n, const TP* P, int64_t D, float* acc) {
  typename Vec::R a[RB][C];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = Vec::load(acc + r * D + Vec::W * c);
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = v0 + j * lda;
    if (j + kPrefetch < n) prefetch_row<T, C>(vr + kPrefetch * lda);
    typename Vec::R v[C];
    for (int c = 0; c < C; ++c) v[c] = Vec::load(vr + Vec::W * c);
    for (int r = 0; r < RB; ++r) {
      const typename Vec::R p = Vec::set1(load(P[r * kKeyBlock + j]));
      for (int c = 0; c < C; ++c) a[r][c] = Vec::fmadd(p, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < C; ++c) Vec::store(acc + r * D + Vec::W * c, a[r][c]);
}

// All R rows, RB at a time, then what is left as one block of fewer: fn(first row, block size as a
// std::integral_constant). A decode item's rows are its query heads per KV head (3 on the bundled
// model, 4 on Llama-3-8B): before, fewer than RB of them went one by one, each pass reading the
// tile's values again. Each row's sums are the same in any block, so the results are too.
template <int RB, typename Fn>
void by_rows(int64_t r, int64_t R, Fn fn) {
  for (; r + RB <= R; r += RB) fn(r, std::integral_constant<int, RB>{});
  if constexpr (RB > 1)
    if (r < R) by_rows<RB - 1>(r, R, fn);
}

// Head sizes of 4 vectors, or of whole chunks of 8: calls fn(C-tag, column offset) per chunk.
template <typename Fn>
bool by_chunks(int64_t D, Fn fn) {
  if (D == 4 * Vec::W) {
    fn(std::integral_constant<int, 4>{}, 0);
    return true;
  }
  if (D % (kChunk * Vec::W) != 0) return false;
  for (int64_t col = 0; col < D; col += kChunk * Vec::W) fn(std::integral_constant<int, kChunk>{}, col);
  return true;
}

template <typename T>
bool scores_few(const T* k0, int64_t lda, int64_t n, const float* Qf, int64_t R, int64_t D, float* S) {
  return by_chunks(D, [&](auto c_tag, int64_t col) {
    constexpr int C = decltype(c_tag)::value, RB = kScoreRows[C == kChunk];
    const bool add = col > 0;
    by_rows<RB>(0, R, [&](int64_t r, auto rows) {
      scores_rows<T, C, decltype(rows)::value>(k0 + col, lda, n, Qf + r * D + col, D, S + r * kKeyBlock, add);
    });
  });
}

template <typename T, typename TP>
bool weigh_few(const T* v0, int64_t lda, int64_t n, const TP* P, int64_t R, int64_t D, float* acc) {
  return by_chunks(D, [&](auto c_tag, int64_t col) {
    constexpr int C = decltype(c_tag)::value, RB = kWeighRows[C == kChunk];
    by_rows<RB>(0, R, [&](int64_t r, auto rows) {
      weigh_rows<T, TP, C, decltype(rows)::value>(v0 + col, lda, n, P + r * kKeyBlock, D, acc + r * D + col);
    });
  });
}
#else
template <typename T>
bool scores_few(const T*, int64_t, int64_t, const float*, int64_t, int64_t, float*) { return false; }
template <typename T, typename TP>
bool weigh_few(const T*, int64_t, int64_t, const TP*, int64_t, int64_t, float*) { return false; }
#endif
}  // namespace vkv
