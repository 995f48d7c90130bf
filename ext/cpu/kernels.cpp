// vkv's CPU kernels, registered as torch.ops.vkv.*; each has a pure-torch reference in
// engine/ops.py that the tests hold it to.
//
//   attention            one call per layer for the whole batch (prefill chunks and decode
//                        tokens mixed): each sequence's K/V rows are read where they lie,
//                        through a block table (a virtual slot is one block as long as the
//                        slot), never past the sequence's context length
//   rope_store           rotary embedding of q and k in the activation dtype, and k, v stored
//                        at their positions
//   add_rms_norm         residual += x; x = rmsnorm(residual) * weight (the first layer's
//                        norm has no residual)
//   silu_and_mul         silu(gate) * up over a fused [gate | up] projection
//   linear_panels        x W^T: register tiles over W packed in column panels; at a few rows
//                        (decode) each thread streams its panels once, at memory bandwidth
//   decode_layers        every decoder layer of a few-row step, the kernels above in one call,
//                        then (given `logits`) last_logits, and (given `tokens`) several greedy
//                        steps in a row
//   last_logits          the model's last norm and the LM head over the rows that sample
//   row_max              each row's maximum and its first index, as torch.max(x, -1) (greedy)
//   greedy_pick          row_max of h's logits under fp32 panels, from their bf16 copy and a bound
//   lora_segments        out[rows] += (x[rows] A^T) B for each LoRA adapter's segment of rows
//
// Compiled once per machine by ext/__init__.py with -O3 -march=native -ffp-contract=off
// -fopenmp-simd (the elementwise kernels round like torch's ops; the dot products ask for fma
// or a simd reduction explicitly); VKV_CPU_ISA=avx2|scalar adds -mno-avx512f|-mno-avx, and the
// vector layer below (`Vec`) follows what the compiler was allowed.
// Floats are fp32 or bf16 (activations, cache); a cache may be narrower than the activations
// (bf16 KV where the CPU computes in fp32; fp8 KV, e4m3 or e5m2, under either: kv_cache_dtype).
// Every accumulation is fp32.

#include <ATen/Parallel.h>
#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

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

namespace {

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
// The attention op alone on the bundled model's shape (9 query heads over 3 KV heads, one decode
// row), hot caches, 3 alternations of builds on the 2-vCPU Xeon: 1 row a pass against 3, fp32
// 9.8-10.6 -> 9.3-9.5 us at 130 keys and 15.9-17.1 -> 14.4-15.0 at 250; bf16 13.0-14.5 -> 11.1-11.8
// and 21.4-22.7 -> 18.4-19.2.
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

// One work item: query positions [q_lo, q_hi) of one sequence, every query head, keys [k_lo,
// k_hi), in tiles of keys that lie in one block. A tile's rows hold every KV head side by side,
// so the heads are taken in turn while the tile is in cache. Per tile and KV head: scores of
// its G query heads, causal mask, an online softmax that folds the tile into each row's running
// (max, sum, weighted V). Writes normalized output, or (m, l, acc) for a later merge.
template <typename T, typename C>
void attend_item(const Item& it, const T* q, int64_t sq_t, int64_t sq_h, const Rows<C>& K, const Rows<C>& V,
                 const int32_t* q_start, const int32_t* q_len, const int32_t* ctx_len, int64_t Hkv, int64_t G,
                 int64_t D, float scale, T* out, int64_t so_t, int64_t so_h, float* partials,
                 std::vector<float>& buf, std::vector<float>& wide) {
  const int64_t b = it.seq, nq = it.q_hi - it.q_lo, R = nq * G, rows = Hkv * R;  // row = (head, query, group)
  const int64_t first_pos = ctx_len[b] - q_len[b];  // absolute position of query 0
  const int64_t t_floats = (sizeof(T) * (rows * D + R * kKeyBlock) + sizeof(float) - 1) / sizeof(float);
  buf.resize(2 * rows * D + 2 * R * kKeyBlock + 2 * rows + t_floats);
  float* acc = buf.data();
  float* Qf = acc + rows * D;  // the query rows in fp32, for the few-rows path
  float* S = Qf + rows * D;
  // One head's probabilities, each rounded to T as a store to T would, held as fp32: the few-rows
  // path weighs from these (a broadcast load a key and row, where widening a bf16 one took three
  // instructions), the GEMM path from their copy in T (P; exact). The softmax loop over them
  // vectorizes under -fno-trapping-math (ext/__init__.py).
  float* Pf = S + R * kKeyBlock;
  float* m = Pf + R * kKeyBlock;
  float* l = m + rows;
  T* Q = reinterpret_cast<T*>(l + rows);  // the item's query rows, gathered per KV head
  T* P = Q + rows * D;                    // one head's probabilities, in the GEMM's input type
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(Q + ((h * nq + i) * G + g) * D, q + (q_start[b] + it.q_lo + i) * sq_t + (h * G + g) * sq_h,
                    D * sizeof(T));
  const bool few = R <= kFewRows;
  if (few)
    for (int64_t i = 0; i < rows * D; ++i) Qf[i] = load(Q[i]);
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.0f);
  const int64_t k_end = std::min(it.k_hi, first_pos + it.q_hi);  // the last query sees keys < this
  int64_t block = it.k_lo / K.block_size, row = it.k_lo % K.block_size;
  for (int64_t k0 = it.k_lo; k0 < k_end;) {
    const int64_t n = std::min({kKeyBlock, k_end - k0, K.block_size - row});
    for (int64_t h = 0; h < Hkv; ++h) {
      const C* kp = K.row(b, block, row, h);
      if (!(few && scores_few(kp, K.s_row, n, Qf + h * R * D, R, D, S)))
        scores<T, C>(kp, K.s_row, n, Q + h * R * D, R, D, S, wide);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t visible = std::clamp<int64_t>(first_pos + it.q_lo + r / G + 1 - k0, 0, n);  // causal
        const float* s = S + r * kKeyBlock;
        float* p = Pf + r * kKeyBlock;
        float& mr = m[h * R + r];
        float mx = mr;
#pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j < visible; ++j) mx = std::max(mx, s[j] * scale);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < visible; ++j) {
          const float e = exp_approx(s[j] * scale - mx);
          const float t = round_to<T>(e);  // (as a store to T rounds it; NaN stays NaN)
          p[j] = e == e ? t : e;
          sum += p[j];
        }
        for (int64_t j = visible; j < n; ++j) p[j] = 0.0f;
        if (visible) {
          const float correction = exp_approx(mr - mx);
          mr = mx;
          l[h * R + r] = l[h * R + r] * correction + sum;
          float* a = acc + (h * R + r) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] *= correction;
        }
      }
      const C* vp = V.row(b, block, row, h);
      if (!(few && weigh_few(vp, V.s_row, n, Pf, R, D, acc + h * R * D))) {
        for (int64_t r = 0; r < R; ++r)  // (exact: Pf holds values of T)
          for (int64_t j = 0; j < n; ++j) store(P + r * kKeyBlock + j, Pf[r * kKeyBlock + j]);
        weigh<T, C>(vp, V.s_row, n, P, R, D, acc + h * R * D, wide);
      }
    }
    k0 += n;
    row += n;
    if (row == K.block_size) {
      row = 0;
      ++block;
    }
  }
  if (it.part >= 0) {  // partial: (m, l, acc) per row, merged by the caller
    float* dst = partials + it.part * rows * (D + 2);
    for (int64_t r = 0; r < rows; ++r) {
      dst[r * (D + 2)] = m[r];
      dst[r * (D + 2) + 1] = l[r];
      std::memcpy(dst + r * (D + 2) + 2, acc + r * D, D * sizeof(float));
    }
    return;
  }
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t r = 0; r < R; ++r) {
      T* o = out + (q_start[b] + it.q_lo + r / G) * so_t + (h * G + r % G) * so_h;
      const float* a = acc + (h * R + r) * D;
      const float inv = l[h * R + r] > 0 ? 1.0f / l[h * R + r] : 0.0f;
      for (int64_t d = 0; d < D; ++d) store(o + d, a[d] * inv);
    }
}

constexpr int64_t kItemsPerThread = 4;  // attention's work items a thread, fewer and decodes split

// The parts a decode item of `keys` keys splits into (merged after), when `items` items are too
// few for the threads (under 2: it stays whole, on one thread).
int64_t decode_parts(int64_t keys, int64_t items, int64_t threads) {
  return std::min<int64_t>(kItemsPerThread * threads / items + 1, keys / 128);
}

template <typename T, typename C>
void attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_table, int64_t block_size, const at::Tensor& q_start,
                    const at::Tensor& q_len, const at::Tensor& ctx_len, double scale, at::Tensor& out) {
  const int64_t B = q_start.size(0), Hq = q.size(1), Hkv = k_cache.size(2), D = q.size(2), G = Hq / Hkv;
  const int32_t* qs = q_start.data_ptr<int32_t>();
  const int32_t* ql = q_len.data_ptr<int32_t>();
  const int32_t* cl = ctx_len.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const Rows<C> K{cache_ptr<C>(k_cache), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), table,
                  block_table.stride(0), block_size};
  const Rows<C> V{cache_ptr<C>(v_cache), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), table,
                  block_table.stride(0), block_size};
  // Work: every (sequence, block of query positions). When that is too little to keep the
  // threads busy (a few long decodes), decode items split their keys and merge after.
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t lo = 0; lo < ql[b]; lo += kQueryBlock)
      items.push_back({b, lo, std::min<int64_t>(ql[b], lo + kQueryBlock), 0, cl[b], -1});
  const int64_t threads = at::get_num_threads(), want = kItemsPerThread * threads;
  struct Merge {
    Item item;
    int64_t first, parts;
  };
  std::vector<Merge> merges;
  if (static_cast<int64_t>(items.size()) < want) {
    std::vector<Item> split;
    int64_t parts = 0;
    for (const auto& it : items) {
      const int64_t keys = cl[it.seq];
      const int64_t n = decode_parts(keys, static_cast<int64_t>(items.size()), threads);
      if (ql[it.seq] != 1 || n < 2) {
        split.push_back(it);
        continue;
      }
      merges.push_back({it, parts, n});
      for (int64_t c = 0; c < n; ++c)
        split.push_back({it.seq, it.q_lo, it.q_hi, keys * c / n, keys * (c + 1) / n, parts++});
    }
    items.swap(split);
  }
  std::vector<float> partials((merges.empty() ? 0 : merges.back().first + merges.back().parts) * Hq * (D + 2));
  // Longest first, handed out one at a time: prefill chunks and decodes mix unevenly.
  auto cost = [&](const Item& it) {
    return (it.q_hi - it.q_lo) * (std::min<int64_t>(it.k_hi, cl[it.seq] - ql[it.seq] + it.q_hi) - it.k_lo);
  };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t sq_t = q.stride(0), sq_h = q.stride(1), so_t = out.stride(0), so_h = out.stride(1);
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min(threads, total), 1, [&](int64_t, int64_t) {
    std::vector<float> buf, wide;
    const int previous = blas().local_threads ? blas().local_threads(1) : 0;  // the pool is ours
    for (int64_t i = next++; i < total; i = next++)
      attend_item<T, C>(items[i], qp, sq_t, sq_h, K, V, qs, ql, cl, Hkv, G, D, static_cast<float>(scale), op,
                        so_t, so_h, partials.data(), buf, wide);
    if (blas().local_threads) blas().local_threads(previous);
  });
  // Split decodes: out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c, per query head.
  std::vector<float> acc(D);
  for (const auto& [it, first, n] : merges)
    for (int64_t qh = 0; qh < Hq; ++qh) {  // rows of a decode item are (KV head, group): the query head
      float M = -std::numeric_limits<float>::infinity(), L = 0.0f;
      for (int64_t c = 0; c < n; ++c) M = std::max(M, partials[((first + c) * Hq + qh) * (D + 2)]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = 0; c < n; ++c) {
        const float* p = partials.data() + ((first + c) * Hq + qh) * (D + 2);
        if (p[1] == 0.0f) continue;
        const float w = exp_approx(p[0] - M);
        L += w * p[1];
        for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(w, p[2 + d], acc[d]);
      }
      T* o = op + (qs[it.seq] + it.q_lo) * so_t + qh * so_h;
      for (int64_t d = 0; d < D; ++d) store(o + d, L > 0 ? acc[d] / L : 0.0f);
    }
}

// Calls fn(T{}, C{}) for activations of type T and a cache of type C: C is T, or narrower (bf16
// under fp32; fp8 e4m3 or e5m2 under fp32 or bf16).
template <typename Fn>
void dispatch(at::ScalarType activations, at::ScalarType cache, const char* op, Fn fn) {
  auto with_cache = [&](auto t) {
    using T = decltype(t);
    switch (cache) {
      case at::kFloat:
        if constexpr (std::is_same_v<T, float>) return fn(t, float{});
        break;
      case at::kBFloat16:
        return fn(t, c10::BFloat16{});
      case at::kFloat8_e4m3fn:
        return fn(t, c10::Float8_e4m3fn{});
      case at::kFloat8_e5m2:
        return fn(t, c10::Float8_e5m2{});
      default:
        break;
    }
    TORCH_CHECK(false, op, ": a ", cache, " KV cache under ", activations, " activations is not supported");
  };
  if (activations == at::kFloat)
    with_cache(float{});
  else if (activations == at::kBFloat16)
    with_cache(c10::BFloat16{});
  else
    TORCH_CHECK(false, op, " runs fp32 and bf16, not ", activations);
}

void check_cache(const at::Tensor& q, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1, name, " must be [blocks, rows, heads, D] with D contiguous");
  TORCH_CHECK(cache.size(3) == q.size(2) && q.size(1) % cache.size(2) == 0, name, ": head shapes do not fit q");
}

// The rows a step addresses lie inside its tensors (a caller's mistake is an error, not a write
// past a cache): O(sequences + blocks used), checked once a call of the two ops below.
// (decode_layers, which runs their bodies for every layer, is handed the engine's own batch.)
// Rows [0, end) of a sequence whose block-table row is `row` (`blocks` entries) lie in the table,
// and their blocks among the cache's `cache_blocks` (raw: decode_layers' plan checks each step so).
void check_row_blocks(const int32_t* row, int64_t blocks, int64_t block_size, int64_t end, int64_t cache_blocks) {
  TORCH_CHECK(end <= blocks * block_size, "row ", end - 1, " is past the block table's ", blocks, " blocks of ",
              block_size);
  for (int64_t b = 0; b * block_size < end; ++b)
    TORCH_CHECK(row[b] >= 0 && row[b] < cache_blocks, "block ", row[b], " is not a block of the cache (",
                cache_blocks, ")");
}

void check_blocks(const at::Tensor& table, int64_t block_size, int64_t seq, int64_t end, const at::Tensor& cache) {
  TORCH_CHECK(seq >= 0 && seq < table.size(0), "sequence ", seq, " has no row in the block table");
  check_row_blocks(table.data_ptr<int32_t>() + seq * table.stride(0), table.size(1), block_size, end, cache.size(0));
}

void check_step(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& block_table, int64_t block_size,
                const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& ctx_len) {
  const int64_t B = q_start.numel();
  TORCH_CHECK(block_table.dim() == 2 && q_len.numel() == B && ctx_len.numel() == B && block_table.size(0) >= B,
              "q_start, q_len and ctx_len need one entry a sequence, the block table a row");
  TORCH_CHECK(block_size >= 1 && block_size <= k_cache.size(1), "block_size ", block_size, " outside the cache's ",
              k_cache.size(1), " rows a block");
  const int32_t *qs = q_start.data_ptr<int32_t>(), *ql = q_len.data_ptr<int32_t>(), *cl = ctx_len.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(qs[b] >= 0 && ql[b] >= 0 && qs[b] + int64_t{ql[b]} <= q.size(0) && ql[b] <= cl[b],
                "sequence ", b, ": its queries [", qs[b], ", ", qs[b] + int64_t{ql[b]}, ") and ", cl[b],
                " keys do not fit ", q.size(0), " query rows");
    check_blocks(block_table, block_size, b, cl[b], k_cache);
  }
}

void attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& block_table, int64_t block_size, const at::Tensor& q_start, const at::Tensor& q_len,
               const at::Tensor& ctx_len, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.sizes() == q.sizes() && out.stride(2) == 1,
              "q and out must be [tokens, heads, D] with D contiguous");
  check_cache(q, k_cache, "k_cache");
  check_cache(q, v_cache, "v_cache");
  for (const auto* t : {&block_table, &q_start, &q_len, &ctx_len})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "index tensors must be contiguous int32");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must share a dtype and a shape");
  check_step(q, k_cache, block_table, block_size, q_start, q_len, ctx_len);
  dispatch(q.scalar_type(), k_cache.scalar_type(), "vkv attention", [&](auto t, auto c) {
    attention_impl<decltype(t), decltype(c)>(q, k_cache, v_cache, block_table, block_size, q_start, q_len, ctx_len,
                                             scale, out);
  });
}

// ---------------------------------------------------------------------------------------------
// D values into a cache row: a copy, or rounded to the cache's narrower type (nearest even).
template <typename C, typename T>
VKV_INLINE void put(C* dst, const T* src, int64_t D) {
  if constexpr (std::is_same_v<C, T>) {
    std::memcpy(dst, src, D * sizeof(T));
  } else {
    for (int64_t d = 0; d < D; ++d) store(dst + d, load(src[d]));
  }
}

// rope_store's arithmetic over raw pointers (strides in elements): rope_store_impl fills it from
// tensors, decode_layers' StepPlan once a call (Note [A step's plan, gathered once a call]).
template <typename T, typename C, typename CS>
struct RopeRows {
  T* q;
  T* k;
  const T* v;
  int64_t sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, Hq, Hkv, D;
  const int64_t* pos;
  const int32_t* seq;
  const int32_t* table;
  int64_t s_table, block_size;
  const CS* cs;  // [positions, D]: cos of the D/2 frequencies, then sin
  int64_t s_cs;
  C* kc;
  C* vc;
  int64_t skc_b, skc_r, skc_h, svc_b, svc_r, svc_h;

  // Row t: q's and k's heads rotated, k's and v's stored at the row's position in the caches.
  void row(int64_t t) const {
    const int64_t half = D / 2;
    const CS* c = cs + pos[t] * s_cs;
    const CS* s = c + half;
    // x * cos + rotate_half(x) * sin, each product rounded to T as torch does
    auto rotate = [c, s, half](T* __restrict x) {
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = load(x[i]), x2 = load(x[i + half]), ci = load(c[i]), si = load(s[i]);
        store(x + i, round_to<T>(x1 * ci) + round_to<T>(-x2 * si));
        store(x + i + half, round_to<T>(x2 * ci) + round_to<T>(x1 * si));
      }
    };
    for (int64_t h = 0; h < Hq; ++h) rotate(q + t * sq_t + h * sq_h);
    const int64_t block = table[seq[t] * s_table + pos[t] / block_size];
    const int64_t row = pos[t] % block_size;
    for (int64_t h = 0; h < Hkv; ++h) {
      T* kr = k + t * sk_t + h * sk_h;
      rotate(kr);
      put(kc + block * skc_b + row * skc_r + h * skc_h, kr, D);
      put(vc + block * svc_b + row * svc_r + h * svc_h, v + t * sv_t + h * sv_h, D);
    }
  }
};

template <typename T, typename C, typename CS>
void rope_store_impl(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                     const at::Tensor& cos_sin, at::Tensor& k_cache, at::Tensor& v_cache,
                     const at::Tensor& block_table, int64_t block_size, const at::Tensor& token_seq) {
  const RopeRows<T, C, CS> rows{q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), q.stride(0), q.stride(1),
                                k.stride(0), k.stride(1), v.stride(0), v.stride(1), q.size(1), k.size(1), q.size(2),
                                positions.data_ptr<int64_t>(), token_seq.data_ptr<int32_t>(),
                                block_table.data_ptr<int32_t>(), block_table.stride(0), block_size,
                                cos_sin.data_ptr<CS>(), cos_sin.stride(0), cache_ptr<C>(k_cache),
                                cache_ptr<C>(v_cache), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  at::parallel_for(0, q.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rows.row(t);
  });
}

void rope_store(at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& positions,
                const at::Tensor& cos_sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& block_table,
                int64_t block_size, const at::Tensor& token_seq) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k, v need D contiguous");
  TORCH_CHECK(q.size(2) % 2 == 0 && cos_sin.size(1) == q.size(2), "cos_sin must be [positions, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && token_seq.scalar_type() == at::kInt, "index dtypes");
  // the table in q's dtype, or a bf16 one under fp32 q (decode_layers: widened as it is read, exactly)
  const bool bf16_table = q.scalar_type() == at::kFloat && cos_sin.scalar_type() == at::kBFloat16;
  TORCH_CHECK((cos_sin.scalar_type() == q.scalar_type() || bf16_table) && k.scalar_type() == q.scalar_type(),
              "dtypes must match (cos_sin may be bf16 under fp32 q)");
  check_cache(q, k_cache, "k_cache");
  check_cache(q, v_cache, "v_cache");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must share a dtype and a shape");
  const int64_t Tn = q.size(0);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(0) == Tn && v.size(0) == Tn && positions.numel() == Tn &&
                  token_seq.numel() == Tn && positions.is_contiguous() && token_seq.is_contiguous(),
              "k, v, positions and token_seq need one contiguous entry a row of q");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) == k_cache.size(2) && k.size(2) == q.size(2),
              "k and v must be [tokens, the cache's heads, D]");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt && block_table.stride(1) == 1 &&
                  block_size >= 1 && block_size <= k_cache.size(1),
              "the block table must be int32 [sequences, blocks], block_size within the cache's rows");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int32_t* seq = token_seq.data_ptr<int32_t>();
  for (int64_t t = 0; t < Tn; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin.size(0), "position ", pos[t], " is past the rotary table's ",
                cos_sin.size(0), " rows");
    TORCH_CHECK(seq[t] >= 0 && seq[t] < block_table.size(0) && pos[t] / block_size < block_table.size(1),
                "row ", t, ": sequence ", seq[t], " position ", pos[t], " is outside the block table");
    const int32_t block = block_table.data_ptr<int32_t>()[seq[t] * block_table.stride(0) + pos[t] / block_size];
    TORCH_CHECK(block >= 0 && block < k_cache.size(0), "block ", block, " is not a block of the cache");
  }
  dispatch(q.scalar_type(), k_cache.scalar_type(), "rope_store", [&](auto t, auto c) {
    using T = decltype(t);
    if constexpr (std::is_same_v<T, float>)
      if (bf16_table)
        return rope_store_impl<T, decltype(c), c10::BFloat16>(q, k, v, positions, cos_sin, k_cache, v_cache,
                                                              block_table, block_size, token_seq);
    rope_store_impl<T, decltype(c), T>(q, k, v, positions, cos_sin, k_cache, v_cache, block_table, block_size,
                                       token_seq);
  });
}

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

void add_rms_norm(at::Tensor x, std::optional<at::Tensor> residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.size(0) == x.size(1),
              "x must be [tokens, hidden] contiguous, weight [hidden]");
  at::Tensor* r = residual ? &*residual : nullptr;
  TORCH_CHECK(!r || (r->is_contiguous() && r->sizes() == x.sizes()), "residual must match x");
  if (x.scalar_type() == at::kFloat)
    add_rms_norm_impl<float>(x, r, weight, eps);
  else if (x.scalar_type() == at::kBFloat16)
    add_rms_norm_impl<c10::BFloat16>(x, r, weight, eps);
  else
    TORCH_CHECK(false, "add_rms_norm runs fp32 and bf16");
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

void silu_and_mul(const at::Tensor& gate_up, at::Tensor out) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "[tokens, 2 * I]");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == gate_up.size(0) && out.size(1) * 2 == gate_up.size(1) &&
              out.scalar_type() == gate_up.scalar_type(), "out must be [tokens, I] of gate_up's dtype");
  if (gate_up.scalar_type() == at::kFloat)
    silu_and_mul_impl<float>(gate_up, out);
  else if (gate_up.scalar_type() == at::kBFloat16)
    silu_and_mul_impl<c10::BFloat16>(gate_up, out);
  else
    TORCH_CHECK(false, "silu_and_mul runs fp32 and bf16");
}


// ---------------------------------------------------------------------------------------------
// linear_panels: x W^T for every step, decode's few rows to prefill's hundreds. oneDNN's packed
// GEMM reaches a third of this CPU's FMA peak at 32 rows; a register tile does better. At one
// row the step only streams W: each thread reads its run of panels front to back (one long
// stream, the next panel fetched ahead), which measured faster than streaming W's plain rows
// (decode of the bundled model, 2 threads: 62 against 49 tok/s in fp32, 102 against 70 with
// bf16 weights on an AVX-512 EPYC; 60 against 52 and 99 against 57 with the AVX2 kernels). The weight is packed once (engine/models/linear.py `Linear.pack_panels`) into panels
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
// type and the ISA. Against one stream that prefetches the next panel non-temporally: fp32 on AVX2
// 21-23 against 18-20 GB/s (alternating runs of a decode step's projections, 2-core AVX2 EPYC);
// bf16 on the 2-core AVX-512 EPYC, switched in one process, 14 alternations, median +9.8% and +7.7%
// tok/s with the AVX-512 kernels and +13.5% with the AVX2 ones; fp32 with AVX-512 there 0.998x
// (even), so it had kept the one stream, until a 2-vCPU Intel Xeon (AVX-512, AMX; KVM) decoded fp32
// at 31.2-31.5 tok/s with it and 58.6-59.2 with two streams (the bundled model, 128 tokens, three
// generations each, one build and then the other): its non-temporal prefetch halved the stream.

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
// again (the KV cache, the activations, the engine's Python between steps). Decode of the bundled
// model on the 2-core AVX-512 EPYC, hint switched in one process, 12-16 alternations: median +4.9%
// tok/s in bf16, +12% in fp32, +7.7% in bf16 with the AVX2 kernels (one-row steps have since moved
// to panel_pair; steps of 2 to kPanelRows rows keep this). On an Intel Xeon (2 vCPUs, AVX-512 and
// AMX) the same hint cost 3-4x: one-call steps of 2-12 rows over panels not in cache read 7-10 GB/s
// with it and 16-41 GB/s with the next panel asked into L2 (fp32 and bf16 weights, the model's
// four shapes; the batch of 32 ShareGPT requests, whose tail runs such steps, at 1.13x vLLM's CPU
// build in fp32). Intel's non-temporal prefetch fills L1 alone, and a panel ahead (36 KiB in bf16,
// 72 in fp32) is as large as L1: its lines are gone before they are read, and read again from
// memory. So the hint is non-temporal on AMD only, into L2 elsewhere (`ahead_hint`). panel_pair's
// two streams measured 10% slower with the non-temporal hint on the panels after theirs (AVX2,
// fp32, the EPYC), and even with L2's on the Xeon: they keep the hardware's prefetch.
static const bool kAheadNonTemporal = [] {
  __builtin_cpu_init();  // (a static initializer may run before libgcc's own has)
  return __builtin_cpu_is("amd") > 0;
}();

std::string ahead_hint() {
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
// another, so past a panel's end that is the next one's start). On the Intel Xeon (2 vCPUs, AMX)
// a one-row `linear_panels` read about 31-33 GB/s with the hardware's prefetch alone, where the
// read probe (a dot product of two arrays) read 37-48: each core's own reads were the limit. The
// model's projections one after another (bench_projection_sequence.py, 3 samples each): fp32
// 30.1-30.5 -> 31.6-31.8 GB/s, bf16 27.8-28.6 -> 31.1-31.7 at 2 KiB; 512 B to 8 KiB all helped
// fp32, bf16 wanted 2-3 KiB. Decode of the bundled model, 8 steps a call, 768 tokens a run, the
// distance switched between processes: with the AVX-512 kernels fp32 60.9-64.8 -> 63.0-66.6 tok/s
// at 2 KiB (3 alternations; 4 KiB even with 2), bf16 113.7-118.4 -> 128.6-134.0 at 2 KiB (4 KiB:
// 128.2-128.7); with the AVX2 ones fp32 60.2-61.2 at 2 KiB, 63.7-66.6 at 4 KiB (2 alternations; 61.0
// with none), bf16 126.2-128.8 at 2 KiB, 125.8-125.9 at 4. So 1,024 weights ahead: 4 KiB of fp32,
// 2 KiB of bf16. Where a k's row is under a line (bf16 and int8 on AVX2, int8 on AVX-512) a line is
// asked for once a k; asking once a line measured no better (AVX2 bf16 decode 0.982x, 3 of 8
// alternations faster; AVX-512 bf16 1.003x, 4 of 8). Not measured on an AMD CPU, where the
// hardware's prefetch alone read at the probe's rate (the EPYC's one projection at 94-100% of it):
// left as it was there. int8 panels (the bf16 model's pick) ask 4,096 weights ahead, 4 KiB as
// fp32's: at 1,024 (1 KiB) the pick read 25-26 GB/s in decode where the projections read 30-35.
// The pick alone (12 copies of the LM head's int8 panels in turn, 6 alternations in one process)
// read 23.7 -> 26.0 GB/s (medians) with the AVX-512 kernels and 22.8 -> 26.3 with the AVX2 ones at
// 4,096 (2,048: 24.0 and 24.1; 8,192: 25.6 and 25.3); in bf16 decode the pick took 1,030 -> 948 us
// a step (AVX-512) and 1,070 -> 982 (AVX2), decode 1.014x and 1.013x (6 alternations, 5 faster).
template <typename TW>
constexpr int64_t kStreamAhead = sizeof(TW) == 1 ? 4096 : 1024;
// The AVX2 kernels' fp32 and bf16 streams also ask for a line into L2 2 KiB past the one they ask
// into L1 (kStreamFar, in bytes; once a line), so more of each stream is on its way from memory than
// L1's own misses allow. On the Intel Xeon with the AVX2 kernels, switched in one process (the
// baseline the same code without it): one one-row `linear_panels` over 300 MB read 88.9% -> 92.0%
// of the read probe in bf16 and 86.1% -> 94.3% in fp32 (6 alternations); decode of the bundled
// model (256 tokens, 8 steps a call, 8 alternations) 1.024x in bf16 (7 faster) and 1.024x in fp32
// (5 faster). The int8 pick's streams with it too: bf16 decode 1.012x, the pick 964 -> 976 us a step
// (without: 957), so not there. Other distances before a clean baseline was kept (so only against
// each other): 3-6 KiB in bf16 even, fp32 6-7 KiB best, 8 KiB and 12 KiB well below. The AVX-512
// kernels, whose row of a k is twice as wide, measured 0.96x in bf16 (3-6 KiB) and 1.01-1.02x in
// fp32 against that first baseline (the one that favoured the change): they do without.
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
#else
constexpr int64_t kPanel = 16;

std::string ahead_hint() { return "none (the scalar build)"; }

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
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be [rows, K] fp32 contiguous");
  TORCH_CHECK(out.dim() == 2, "out must be [rows, N]");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel && panels.size(1) == K &&
              panels.size(0) == (N + kPanel - 1) / kPanel,
              "panels must be [ceil(N / panel_width()), K, panel_width()] contiguous");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == M,
              "out must be [rows, N] fp32 contiguous");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == N),
              "bias must be [N] fp32");
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if (panels.scalar_type() == at::kFloat)
    linear_panels_impl(x.data_ptr<float>(), M, K, panels.data_ptr<float>(), N, b, out.data_ptr<float>(), then);
  else if (panels.scalar_type() == at::kBFloat16)
    linear_panels_impl(x.data_ptr<float>(), M, K, panels.data_ptr<c10::BFloat16>(), N, b, out.data_ptr<float>(),
                       then);
  else if (panels.scalar_type() == at::kChar)
    linear_panels_impl(x.data_ptr<float>(), M, K, panels.data_ptr<int8_t>(), N, b, out.data_ptr<float>(), then);
  else
    TORCH_CHECK(false, "linear_panels reads fp32 or bf16 panels");
}

void linear_panels(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias, at::Tensor out) {
  linear_panels_then(x, panels, bias, out);
}

int64_t panel_width() { return kPanel; }

// The gate/up projection of a one-row step with silu(gate) * up folded in (decode_layer): the fused
// weight's gate panel p and up panel P + p are read side by side as panel_pair's two streams, and
// the thread that computed those kPanel columns writes their activations at once. silu_and_mul after
// the projection read the whole [gate | up] row back on one thread, half of it from the other
// core's cache, while the other core waited: 3 us a layer at this EPYC's fast bandwidth level. The
// same products in the same order, and the same silu (silu_times): the same bits. Single-stream
// decode of the bundled model, switched in one process, `decode_layers` timed (2 threads, the
// 2-core AVX-512 EPYC): bf16 1.019x and 1.020x at the fast level (12 and 10 alternations, 7 and 8
// faster), 0.987x and 1.002x at the slow one; fp32 1.023x (16, 10 faster, both levels); with the
// AVX2 kernels, bf16 1.021x at the slow level (12, 9 faster) and fp32 1.039x (12, 10 faster).
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

// ---------------------------------------------------------------------------------------------
// Every decoder layer of a decode step of a few rows, in one call: at one row the Python between
// a layer's nine kernels (and a dispatch for each) cost as much as some of the kernels, and a
// call per layer still cost the step a Python loop and 30 dispatches of 25 arguments. The same
// kernels as the layer-by-layer path, in the same order, so the arithmetic is identical. Per layer:
//
//   x, residual = add_rms_norm(x, residual)   (layer 0: residual = x, no add)
//   q, k, v = x W_qkv^T (+ b)   rope_store    attention    x = attn W_o^T
//   x, residual = add_rms_norm(x, residual)   x = silu_and_mul(x W_gu^T) W_down^T
//
// x and residual are [rows, hidden] fp32, updated in place: x ends as the last layer's output.
// The weights are the projections' panels (linear_panels), a list entry per layer, as are the
// caches; the step's intermediates are allocated once and reused by every layer. Given `logits`
// (and rows, the final norm's weight, the LM head's panels), the call ends with last_logits, the
// final norm under the layers' eps (one rms_norm_eps in a Llama config): each return from a call
// that streamed the weights costs the Python after it about 0.1 ms of cold caches, so one call
// a step instead of two measured 1.025x in bf16 (21 of 30 alternations) and 1.009x in fp32 (15 of 24).
struct DecodeStep {  // what every layer of the step reads, and its intermediates
  const at::Tensor &positions, &cos_sin, &block_table, &token_seq, &q_start, &q_len, &ctx_len;
  int64_t block_size;
  double eps, scale;
  at::Tensor qkv, q, k, v, attended, h, gate_up, act;
};

// Where a decode step's time goes (benchmarks/bench_decode_stages.py): with the clock on
// (`time_decode_stages(true)`), decode_layers adds each stage's microseconds to its sum, read (and
// cleared) by `decode_stage_times`; off, a stage costs the test of one flag. The sums are atomic:
// engines of several models in one process step on threads of their own.
enum Stage { kContext, kNorms, kQkv, kRope, kAttention, kO, kGateUp, kDown, kPick, kEmbed, kStages };
constexpr const char* kStageNames[kStages] = {"context prefetch", "norms", "qkv", "rope", "attention", "o",
                                              "gate_up", "down", "pick", "next embedding"};
std::atomic<bool> stage_clock_on{false};
std::atomic<double> stage_us[kStages];
std::atomic<int64_t> stage_steps{0};

struct StageClock {
  bool on = stage_clock_on.load(std::memory_order_relaxed);
  std::chrono::steady_clock::time_point last = on ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  void lap(Stage stage) {  // the time since the last lap (or the start) was `stage`'s
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    stage_us[stage].fetch_add(std::chrono::duration<double, std::micro>(now - last).count(), std::memory_order_relaxed);
    last = now;
  }
};

void time_decode_stages(bool on) { stage_clock_on.store(on); }

c10::Dict<std::string, double> decode_stage_times(bool reset) {
  c10::Dict<std::string, double> out;
  for (int i = 0; i < kStages; ++i)
    out.insert(kStageNames[i], reset ? stage_us[i].exchange(0.0) : stage_us[i].load());
  out.insert("steps", static_cast<double>(reset ? stage_steps.exchange(0) : stage_steps.load()));
  return out;
}

// The first keys and values the layer's attention will read, asked into L2 before the layer's
// attention (at most kContextPrefetch bytes of each cache): the step's first layer's as it starts,
// a later layer's in the down projection of the layer before (Note [The next layer's context ...]).
// The step's weights have streamed through the caches since the last step wrote them, so attention
// waited on memory for them, a miss at a time: about a third of its time in decode. Prefetched here
// they arrive while the norm and the qkv projection run. (Each key's heads must lie side by side, as in every layout; else no prefetch.) Measured on
// a 2-core EPYC (AVX-512), one sequence of 4 to 260 tokens, the switch alternated in one process:
// attention 0.86 -> 0.56 ms a step in fp32, 0.56 -> 0.39 in bf16; decode_layers 1.017x (18 of 20
// pairs faster) and 1.013x (14 of 20). The threads split the keys: a thread's prefetches wait on
// its own line-fill buffers once they are full, and on the Intel Xeon (2 vCPUs) the prefetch on one
// thread took 0.35-0.38 ms of a 16 ms fp32 step (stages timed inside decode_layers; K on one thread
// and V on the other: 0.22-0.25 ms), 0.24-0.26 ms of an 8 ms bf16 one (0.13-0.18). Decode with the
// keys split, against one thread, 8 alternations in one process: 1.009x fp32 (5 faster) and 1.012x
// bf16 (7) with the AVX2 kernels; 1.001x (4) and 1.007x (6) with the AVX-512 ones. Small; kept.
constexpr int64_t kContextPrefetch = 128 << 10;
constexpr int64_t kContextGrain = 64;  // keys a thread prefetches at least

// The step's sequences as prefetch_keys walks them (raw: gathered once a call by StepPlan).
struct StepKeys {
  const int32_t* ctx;  // each sequence's keys
  const int32_t* table;
  int64_t table_stride, block_size, seqs;
};
StepKeys step_keys(const DecodeStep& s) {
  return {s.ctx_len.data_ptr<int32_t>(), s.block_table.data_ptr<int32_t>(), s.block_table.stride(0), s.block_size,
          s.q_start.size(0)};
}

// A layer's two caches as prefetch_keys reads them (strides in bytes); `row`, a key's heads in
// bytes, is 0 where the layout does not allow the prefetch (a key's heads not side by side).
struct ContextRef {
  const char* base[2];
  int64_t s_block[2], s_row[2], row;
};
ContextRef context_ref(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  ContextRef c{};
  const at::Tensor* caches[2] = {&k_cache, &v_cache};
  for (const at::Tensor* t : caches)
    if (t->stride(2) != t->size(3) || t->stride(3) != 1 || t->sizes() != k_cache.sizes()) return c;
  const int64_t bytes = k_cache.element_size();
  for (int i = 0; i < 2; ++i) {
    c.base[i] = static_cast<const char*>(caches[i]->data_ptr());
    c.s_block[i] = caches[i]->stride(0) * bytes;
    c.s_row[i] = caches[i]->stride(1) * bytes;
  }
  c.row = k_cache.size(2) * k_cache.size(3) * bytes;
  return c;
}

// The keys prefetch_context asks for: the step's, sequence after sequence, as far as the cap.
int64_t context_keys(const StepKeys& k, const ContextRef& c) {
  if (c.row == 0) return 0;
  int64_t keys = 0;
  for (int64_t b = 0; b < k.seqs; ++b) keys += k.ctx[b];
  return std::min(keys, kContextPrefetch / c.row);
}

// A prefetch into L2 that the compiler keeps: a loop of nothing but _mm_prefetch (a builtin without
// side effects) may be deleted whole, and GCC deleted prefetch_keys' once its addresses came from raw
// pointers instead of calls (attention 0.30 -> 0.51-0.56 ms a bf16 step on the Intel Xeon, the keys
// never asked for; found by its disassembly: the claims' loop left with no prefetch in it).
VKV_INLINE void prefetch_kept_t1(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

// Keys [lo, hi) of them, into L2.
void prefetch_keys(const StepKeys& k, const ContextRef& c, int64_t lo, int64_t hi) {
  int64_t first = 0, b = 0;  // key i is sequence b's key i - first
  for (int64_t i = lo; i < hi; ++i) {
    while (i - first >= k.ctx[b]) first += k.ctx[b++];
    const int64_t key = i - first, block = k.table[b * k.table_stride + key / k.block_size];
    for (int j = 0; j < 2; ++j) {
      const char* at = c.base[j] + block * c.s_block[j] + key % k.block_size * c.s_row[j];
      for (int64_t o = 0; o < c.row; o += 64) prefetch_kept_t1(at + o);
    }
  }
}

void prefetch_context(const StepKeys& k, const ContextRef& c) {
  at::parallel_for(0, context_keys(k, c), kContextGrain, [&](int64_t lo, int64_t hi) { prefetch_keys(k, c, lo, hi); });
}

// Note [The next layer's context, asked for in this layer's down projection]
// Rationale: prefetch_context at a layer's start was a stage of its own, both threads waiting on
// their line-fill buffers while no weights streamed: 0.13-0.21 ms of a decode step on the Intel
// Xeon (the stage clock, bf16 and fp32). The threads of a one-row projection end apart (a few
// microseconds; the first waits for the other at the region's end).
// Approach: the next layer's keys are asked for inside this layer's down projection's region, in
// claims of kContextGrain keys taken by each thread once its share of the panels is done (so the
// thread done first takes most). The keys are the same: the next layer's cache rows below the step's
// new one, which that layer's rope_store writes. Only the first layer asks at its start.
// Implementation: NextContext (the claims), run by linear_panels_then; decode_layer.
// Measured (in one process, the prefetch's place switched between generations of 256 tokens, 8
// steps a call): the context stage 132-211 -> 6-8 us a step (the first layer's), down +50-90 us,
// attention as before (the keys stay in cache through the norm and the qkv projection); decode with
// the AVX2 kernels 1.013x and 1.005x in bf16 (8 alternations each; 8 and 6 faster), 1.005x in fp32
// (6; 5 faster); with the AVX-512 ones 1.009x in bf16 (6; 6 faster), 0.996x in fp32 (6; 3 faster).
// Asked for in the gate/up projection's region as well, the keys were evicted by the down stream
// (attention 369 -> 430 us a step). Limitations: the scalar build and steps of several rows were not
// measured; they ask the same way (each thread after its share).
struct NextContext {
  NextContext(const StepKeys& step, const ContextRef& caches)
      : step(step), caches(caches), keys(context_keys(step, caches)) {}
  StepKeys step;
  ContextRef caches;
  int64_t keys;
  std::atomic<int64_t> next{0};
  void run() {
    for (int64_t lo; (lo = next.fetch_add(kContextGrain, std::memory_order_relaxed)) < keys;)
      prefetch_keys(step, caches, lo, std::min(keys, lo + kContextGrain));
  }
};

// Note [The o projection's weights asked for while attention runs]
// Rationale: a one-sequence decode step's attention is one work item (decode_parts: under 256
// keys) on one thread, 13-20 us a layer, while the other thread waits and the memory bus idles;
// then the o projection, the smallest (0.65 MB a layer in bf16, 1.3 in fp32), starts cold on both
// threads and read 23-27 GB/s where the larger projections read 30-36 (bench_decode_stages.py).
// Approach: one parallel region for both. Thread 0 runs attention; thread 1 asks for the o weight's
// panels into its L2, from the last panel down, until attention is done (at most all but
// 1 / kWarmShare of them); then the two split the panels so that thread 1 takes the warm ones and
// half of the cold ones less 1 / kWarmGiven of the warm count, which thread 0 takes instead
// (thread 1 still reads the warm ones, at L2's rate). Each column is computed as linear_panels computes it, whatever the
// split: the same bits. One region instead of attention inline and o's own also saves a fork and
// a join. Measured on the 2-vCPU Xeon, switched in one process, 6 alternations of 256-token decodes
// (stage clock on): the o stage 0.90-0.92 -> 0.60-0.61 ms a step in bf16 and 1.61-1.70 -> 1.26-1.27
// in fp32 (both ISAs' kernels), attention +15-52 us; decode 1.035x bf16 (AVX-512 kernels; every
// alternation faster), 1.038x fp32, and with the AVX2 kernels 1.044x bf16, 1.009x fp32 (medians of
// the alternations' ratios, in a noisy hour).
// Limitations: two threads only (more were not measured; they take the path before), one row;
// not measured on an AMD CPU, where it runs as here.
// If attention throws, thread 1 still sees `done` and both skip the projection; the error rethrows.
constexpr int64_t kWarmShare = 4;  // thread 1 asks for at most (kWarmShare - 1) / kWarmShare of the panels
constexpr int64_t kWarmGiven = 4;  // thread 0 takes 1 / kWarmGiven of the warm count in cold panels

// Waits until ready() is true: spinning (a pause an iteration) for kSpinMicros, longer than a stage
// waits when each thread has a core of its own, then giving the core away between tests, so that
// a thread sharing its core (more threads than cores: other processes, several engines on one
// host) lets the thread it waits for run instead of spinning out its time slice.
constexpr int64_t kSpinMicros = 50;
template <typename Ready>
void wait_until(Ready ready) {
  std::chrono::steady_clock::time_point until;  // (the clock read only once a wait is not short)
  for (int64_t i = 1; !ready(); ++i) {
    _mm_pause();
    if (i % 256 == 0) {
      const auto now = std::chrono::steady_clock::now();
      if (i == 256) {
        until = now + std::chrono::microseconds(kSpinMicros);
      } else if (now > until) {
        while (!ready()) std::this_thread::yield();
        return;
      }
    }
  }
}

#if defined(VKV_VEC)
// One row over panels [lo, hi) of fp32 or bf16 panels, on the calling thread (row_over_panels).
void panels_range(const float* x, const PanelsRef& panels, int64_t N, const float* bias, float* out, int64_t lo,
                  int64_t hi) {
  if (panels.bf16)
    row_over_panels(x, panels.K, static_cast<const c10::BFloat16*>(panels.w), N, bias, out, lo, hi);
  else
    row_over_panels(x, panels.K, static_cast<const float*>(panels.w), N, bias, out, lo, hi);
}
#endif

// Thread t's share (of 2) of P panels: the ones at::parallel_for gives it.
std::pair<int64_t, int64_t> share_of(int64_t t, int64_t P) {
  const int64_t chunk = (P + 1) / 2, lo = std::min(P, t * chunk);
  return {lo, std::min(P, lo + chunk)};
}

// attention_then_o's state, shared by its two threads.
struct AttendThenO {
  std::atomic<bool> done{false};
  std::atomic<int64_t> warm{-1};  // the panels thread 1 asked for, once it stops
  std::exception_ptr failed;      // attention's error (thread 0's), rethrown by the caller
};

#if defined(VKV_VEC)
// Thread t's part of it, in a region of two threads (`solo`: one thread runs both parts): thread 0
// runs attend() (attention, after rope_store in the one region), while thread 1 asks for o's
// panels; then each its share of o, attended [K] into h [N] (fp32).
template <typename Attend>
void attend_then_o_part(int64_t t, bool solo, AttendThenO& st, Attend attend, const PanelsRef& o,
                        const float* attended, float* h, int64_t N) {
  const int64_t P = o.P, panel_bytes = o.K * kPanel * (o.bf16 ? 2 : 4);
  const char* weights = static_cast<const char*>(o.w);
  if (t == 0) {
    try {
      attend();
    } catch (...) {
      st.failed = std::current_exception();
    }
    st.done.store(true, std::memory_order_release);
    if (solo) st.warm.store(0, std::memory_order_release);
  } else {
    int64_t n = 0;
    for (int64_t p = P - 1; p >= P / kWarmShare && !st.done.load(std::memory_order_acquire); --p, ++n)
      for (int64_t b = 0; b < panel_bytes && !st.done.load(std::memory_order_relaxed); b += 64)
        _mm_prefetch(weights + p * panel_bytes + b, _MM_HINT_T1);
    wait_until([&] { return st.done.load(std::memory_order_acquire); });
    st.warm.store(n, std::memory_order_release);
  }
  int64_t n;
  wait_until([&] { return (n = st.warm.load(std::memory_order_acquire)) >= 0; });
  if (st.failed) return;
  const int64_t split = std::min(P, (P - n + 1) / 2 + n / kWarmGiven);
  const int64_t a = t == 0 ? 0 : split, b = t == 0 ? (solo ? P : split) : P;
  panels_range(attended, o, N, nullptr, h, a, b);
}

#endif

// Whether attention_then_o applies: one row of one sequence whose attention is one work item, two
// threads, fp32 or bf16 panels, the vector build.
bool attend_then_o_applies(const DecodeStep& s, const at::Tensor& o_weight) {
#if !defined(VKV_VEC)
  return false;  // (the scalar build's panels have no row_over_panels)
#else
  return s.h.size(0) == 1 && s.q_start.size(0) == 1 && at::get_num_threads() == 2 && !at::in_parallel_region() &&
         decode_parts(s.ctx_len.data_ptr<int32_t>()[0], 1, 2) < 2 &&
         (o_weight.scalar_type() == at::kFloat || o_weight.scalar_type() == at::kBFloat16);
#endif
}

bool attention_then_o(DecodeStep& s, const at::Tensor& o_weight, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      StageClock& clock) {
  if (!attend_then_o_applies(s, o_weight)) return false;
#if defined(VKV_VEC)
  AttendThenO st;
  const PanelsRef o = panels_ref(o_weight);
  auto attend = [&] {
    attention(s.q, k_cache, v_cache, s.block_table, s.block_size, s.q_start, s.q_len, s.ctx_len, s.scale, s.attended);
    clock.lap(kAttention);
  };
  at::parallel_for(0, 2, 1, [&](int64_t lo, int64_t hi) {
    attend_then_o_part(lo, hi == 2 && lo == 0, st, attend, o, s.attended.data_ptr<float>(), s.h.data_ptr<float>(),
                       s.h.size(1));
  });
  if (st.failed) std::rethrow_exception(st.failed);
  clock.lap(kO);
#endif
  return true;
}

// A layer's input norm of one row: x, residual = add_rms_norm(x, residual); the first layer's has no
// residual (residual = x, written out: as ATen's copy_ it dispatched cold each step, see next_inputs;
// the norms stage 189-193 -> 128-154 us a bf16 step, AVX2 kernels, builds alternated, 3 pairs).
void input_norm_row(float* x, float* residual, int64_t H, bool first, const float* norm, double eps, float* row) {
  if (first) std::copy(x, x + H, residual);
  norm_row<float>(x, first ? nullptr : residual, norm, H, eps, row);
}

// The same over every row of x (as add_rms_norm runs its rows).
void input_norm_of(const DecodeStep& s, at::Tensor& x, at::Tensor& residual, bool first, const at::Tensor& norm) {
  const int64_t H = x.size(1);
  TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.numel() == H,
              "a layer's norm weight must be [hidden] fp32 contiguous");
  float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float* w = norm.data_ptr<float>();
  at::parallel_for(0, x.size(0), 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t r = begin; r < end; ++r) input_norm_row(xp + r * H, rp + r * H, H, first, w, s.eps, row.data());
  });
}

void decode_layer(DecodeStep& s, at::Tensor& x, at::Tensor& residual, bool first, const at::Tensor& input_norm,
                  const at::Tensor& post_norm, const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias,
                  const at::Tensor& o_weight, const at::Tensor& gate_up_weight, const at::Tensor& down_weight,
                  const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor* next_k_cache,
                  const at::Tensor* next_v_cache) {
  StageClock clock;
  if (first) prefetch_context(step_keys(s), context_ref(k_cache, v_cache));  // (a later layer's: in the down before)
  clock.lap(kContext);
  input_norm_of(s, x, residual, first, input_norm);
  clock.lap(kNorms);
  linear_panels(x, qkv_weight, qkv_bias, s.qkv);
  clock.lap(kQkv);
  rope_store(s.q, s.k, s.v, s.positions, s.cos_sin, k_cache, v_cache, s.block_table, s.block_size, s.token_seq);
  clock.lap(kRope);
  if (!attention_then_o(s, o_weight, k_cache, v_cache, clock)) {
    attention(s.q, k_cache, v_cache, s.block_table, s.block_size, s.q_start, s.q_len, s.ctx_len, s.scale, s.attended);
    clock.lap(kAttention);
    linear_panels(s.attended.view({x.size(0), -1}), o_weight, std::nullopt, s.h);
    clock.lap(kO);
  }
  add_rms_norm(s.h, residual, post_norm, s.eps);
  clock.lap(kNorms);
  if (!gate_up_silu(s.h, gate_up_weight, s.act)) {
    linear_panels(s.h, gate_up_weight, std::nullopt, s.gate_up);
    silu_and_mul(s.gate_up, s.act);
  }
  clock.lap(kGateUp);
  if (next_k_cache) {
    NextContext next(step_keys(s), context_ref(*next_k_cache, *next_v_cache));
    linear_panels_then(s.act, down_weight, std::nullopt, x, &next);
  } else {
    linear_panels(s.act, down_weight, std::nullopt, x);
  }
  clock.lap(kDown);
}

// Note [A one-row step's layers in one parallel region]
// Rationale: a one-row decode step of a 30-layer model opened 120 parallel regions (qkv, attention
// with o, gate/up, down, per layer), the norms and rope between them on one thread. On the 2-vCPU
// Intel Xeon an empty at::parallel_for of two threads took 1.0 us, and in decode the threads of a
// qkv or down projection began 1.3-3.3 us after the region was asked for, and it returned 2.5-3 us
// after its last thread ended (timed per thread, AVX2 kernels, bf16): about 5 us of a 60 us
// projection with the bus idle.
// Approach: one region for all the layers of a step, its two threads stepping through the stages
// together and meeting at a spinning barrier (Pair: a counter a thread; each waits for the other's
// to reach its own) where a fork and a join were. The norms stay on thread 0; rope moves into
// thread 0's part of the attention stage, so thread 1 asks for o's panels from that stage's start.
// Each projection's thread takes the panels at::parallel_for gave it and computes each column as
// before: the same bits (tests/test_cpu_paths.py holds the step to the layer-by-layer path).
// Measured on the Xeon, the region switched in one process, 256-token decodes alternated (8 steps a
// call): bf16 1.047x with the AVX2 kernels (8 pairs, 7 faster), 1.051x with the AVX-512 ones (6, 6);
// fp32 1.030x (6, 6) and 1.038x (6, 5). The same tokens in every pair. (On a 2-core AMD EPYC the
// same structure, with prefetches at the barriers, measured 0.97-1.04x: benchmarks/README.md.)
// A wait spins for 50 us, then gives the core away between tests (wait_until): two engine processes
// of two threads each on the Xeon's two cores, a bf16 decode of 128 tokens in each at once, ran
// 5.1-24.4 tok/s each with barriers that only spun (the other thread's time slice spun out) and
// 44.1-53.1 with the yield, against 10.6-13.2 before this change (OpenMP's own barriers spin on, not
// knowing of the other process); alone, the yield measured 1.012x (in one process, 8 pairs: the
// waits in a step are microseconds and never reach it).
// Implementation: layers_in_one_region, called by decode_layers each step; attend_then_o_part and
// gate_up_silu_share are per-thread bodies that the region-a-stage path runs too, panels_range runs
// a thread's share of the other projections (share_of). A thread that throws marks the pair broken,
// so the other leaves at its next barrier; at::parallel_for rethrows.
// Limitations: exactly two threads, one row of one sequence whose attention is one work item (under
// 256 keys: decode_parts), fp32 or bf16 panels, the vector build; elsewhere decode_layer's path. Not
// measured on more threads or on an AMD CPU, where it runs as here when the conditions hold.
struct Pair {
  struct alignas(64) Count {
    std::atomic<int64_t> n{0};
  };
  Count count[2];
  std::atomic<bool> broken{false};
  bool meet(int64_t t) {  // false once the other thread has failed
    const int64_t mine = count[t].n.load(std::memory_order_relaxed) + 1;
    count[t].n.store(mine, std::memory_order_release);
    wait_until([&] {
      return count[1 - t].n.load(std::memory_order_acquire) >= mine || broken.load(std::memory_order_relaxed);
    });
    return !broken.load(std::memory_order_acquire);
  }
};


// Note [A step's plan, gathered once a call]
// Rationale: between two stages of the one region a step's weights stream through every cache, so
// each stage began by reading cold what it reads of its tensors (a TensorImpl, its storage, the
// sizes and strides its op's checks compare) and ran its op's own code around the kernel (checks,
// dtype dispatch, vectors, a nested parallel_for). On the Intel Xeon (AVX2 kernels, bf16 decode),
// rope_store took 2.3 us a layer where a second call at once took 0.5 us, and attention() 13.4-14.8
// us a layer of which its arithmetic (attend_item) was 11.5-12.2 us.
// Approach: decode_layers gathers once a call what the region's stages read (each layer's panels,
// norms, bias and caches; the step's buffers, positions, block table and rotary table) into one
// plan of raw pointers, strides and sizes, and each stage calls its kernel's own body on it:
// norm_row, RopeRows::row, attend_item, row_over_panels, gate_up_silu_share, prefetch_keys. So the
// same bits (tests/test_cpu_paths.py holds the step to the layer-by-layer path). What the ops
// checked every layer is checked once a call (shapes, dtypes, KV heads, block size: plan_of, which
// leaves a step that fails them to decode_layer's path and its ops' errors) and once a step (the
// blocks its keys lie in, before the region: check_keys; its row, inside it: check_row).
// Measured on the Xeon, builds alternated in processes (PYTHONPATH per worktree; 256-token decodes,
// 8 steps a call, same tokens): with the AVX2 kernels in bf16 146.5-150.5 -> 148.1-155.6 tok/s (4
// pairs: 1.050x, 1.009x, 1.034x, 1.009x), the stages a step: norms 72-94 -> 45-52 us, rope 37-43 ->
// 16-18, attention 328-333 -> 290-318, qkv 897-906 -> 846-891, down 1363-1416 -> 1320-1391; with the
// AVX-512 ones bf16 1.034x and 0.990x, fp32 1.032x and 1.020x (2 pairs each).
// Implementation: plan_of builds it (nullopt where the one region cannot run); layers_in_one_region
// reads it; rope and attend are the plan's cache-type instances (rope_of, attend_of).
// Limitations: the one region only (one row of one sequence, two threads, fp32 activations); the
// layer-by-layer path and steps of several rows still call the ops on tensors.
struct LayerPlan {
  const float *input_norm, *post_norm, *qkv_bias;
  PanelsRef qkv, o, gate_up, down;
  void *k, *v;           // the caches' data
  int64_t sk[3], sv[3];  // their strides (block, row, head), in elements
  ContextRef context;
};

struct StepPlan {
  std::vector<LayerPlan> layers;
  StepKeys keys;  // (keys.ctx: the step's context length, moved on each step, as is pos)
  const int32_t *q_start, *q_len, *token_seq;
  const int64_t* pos;
  const void* cos_sin;
  int64_t s_cs, cs_rows, table_blocks, cache_blocks;
  float *x, *residual, *qkv, *attended, *h, *act;
  int64_t H, heads, kv_heads, D;
  double eps, scale;
  void (*rope)(const StepPlan&, const LayerPlan&);
  void (*attend)(const StepPlan&, const LayerPlan&, std::vector<float>& buf, std::vector<float>& wide);
  std::vector<float> row, buf, wide;  // thread 0's scratch
};

#if defined(VKV_VEC)
template <typename C, typename CS>
void rope_of(const StepPlan& p, const LayerPlan& l) {
  const int64_t nq = p.heads * p.D, nk = p.kv_heads * p.D, w = nq + 2 * nk;  // q, k, v: views of qkv
  const RopeRows<float, C, CS> rows{p.qkv, p.qkv + nq, p.qkv + nq + nk, w, p.D, w, p.D, w, p.D, p.heads, p.kv_heads,
                                    p.D, p.pos, p.token_seq, p.keys.table, p.keys.table_stride, p.keys.block_size,
                                    static_cast<const CS*>(p.cos_sin), p.s_cs, static_cast<C*>(l.k),
                                    static_cast<C*>(l.v), l.sk[0], l.sk[1], l.sk[2], l.sv[0], l.sv[1], l.sv[2]};
  rows.row(0);
}

// attention_impl's one work item (decode_parts: under 256 keys), as it runs it.
template <typename C>
void attend_of(const StepPlan& p, const LayerPlan& l, std::vector<float>& buf, std::vector<float>& wide) {
  const Rows<C> K{static_cast<const C*>(l.k), l.sk[0], l.sk[1], l.sk[2], p.keys.table, p.keys.table_stride,
                  p.keys.block_size};
  const Rows<C> V{static_cast<const C*>(l.v), l.sv[0], l.sv[1], l.sv[2], p.keys.table, p.keys.table_stride,
                  p.keys.block_size};
  const int64_t nq = p.heads * p.D, w = nq + 2 * p.kv_heads * p.D;
  const Item it{0, 0, 1, 0, p.keys.ctx[0], -1};
  const int previous = blas().local_threads ? blas().local_threads(1) : 0;  // (as attention_impl)
  attend_item<float, C>(it, p.qkv, w, p.D, K, V, p.q_start, p.q_len, p.keys.ctx, p.kv_heads, p.heads / p.kv_heads,
                        p.D, static_cast<float>(p.scale), p.attended, nq, p.D, nullptr, buf, wide);
  if (blas().local_threads) blas().local_threads(previous);
}
#endif

// The plan of a step's layers (Note [A step's plan, gathered once a call]), or nullopt where the
// one region does not run: more rows or sequences, other than two threads, panels other than fp32
// or bf16, an intermediate size off the panel width, the scalar build.
std::optional<StepPlan> plan_of(const DecodeStep& s, at::Tensor& x, at::Tensor& residual, at::TensorList input_norms,
                                at::TensorList post_norms, at::TensorList qkv_weights,
                                const c10::List<std::optional<at::Tensor>>& qkv_biases, at::TensorList o_weights,
                                at::TensorList gate_up_weights, at::TensorList down_weights,
                                at::TensorList k_caches, at::TensorList v_caches) {
#if !defined(VKV_VEC)
  return std::nullopt;
#else
  const int64_t L = static_cast<int64_t>(input_norms.size()), H = x.size(1);
  // one row of one sequence (its index tensors one entry each, read through raw pointers below)
  if (x.size(0) != 1 || s.q_start.numel() != 1 || s.q_len.numel() != 1 || s.ctx_len.numel() != 1 ||
      s.positions.numel() != 1 || s.token_seq.numel() != 1 || s.token_seq.data_ptr<int32_t>()[0] != 0 ||
      at::get_num_threads() != 2 || at::in_parallel_region())
    return std::nullopt;
  auto panels_ok = [](const at::Tensor& w) { return w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16; };
  auto norm_ok = [&](const at::Tensor& w) {
    return w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == H;
  };
  const at::ScalarType cache = k_caches[0].scalar_type();
  for (int64_t i = 0; i < L; ++i) {
    const std::optional<at::Tensor> bias = qkv_biases.get(i);
    if (!panels_ok(qkv_weights[i]) || !panels_ok(o_weights[i]) || !panels_ok(down_weights[i]) ||
        !gate_up_silu_applies(s.h, gate_up_weights[i], s.act) || !norm_ok(input_norms[i]) || !norm_ok(post_norms[i]) ||
        (bias && (bias->scalar_type() != at::kFloat || !bias->is_contiguous())) ||
        k_caches[i].scalar_type() != cache || v_caches[i].scalar_type() != cache ||
        k_caches[i].sizes() != v_caches[i].sizes() || k_caches[i].size(0) != k_caches[0].size(0) ||
        k_caches[i].size(2) != s.k.size(1) || s.block_size < 1 || s.block_size > k_caches[i].size(1))
      return std::nullopt;  // (kv heads and block size as rope_store and check_step held them)
    check_cache(s.q, k_caches[i], "k_cache");
    check_cache(s.q, v_caches[i], "v_cache");
  }
  if (!(s.cos_sin.scalar_type() == at::kFloat || s.cos_sin.scalar_type() == at::kBFloat16) || s.k.size(1) < 1 ||
      s.q.size(2) % 2 != 0 || s.cos_sin.size(1) != s.q.size(2) || s.block_table.dim() != 2 || s.block_table.size(0) < 1 ||
      s.block_table.stride(1) != 1)
    return std::nullopt;
  StepPlan p;
  p.layers.reserve(L);
  for (int64_t i = 0; i < L; ++i) {
    const std::optional<at::Tensor> bias = qkv_biases.get(i);
    const at::Tensor &k = k_caches[i], &v = v_caches[i];
    p.layers.push_back({input_norms[i].data_ptr<float>(), post_norms[i].data_ptr<float>(),
                        bias ? bias->data_ptr<float>() : nullptr, panels_ref(qkv_weights[i]), panels_ref(o_weights[i]),
                        panels_ref(gate_up_weights[i]), panels_ref(down_weights[i]), k.data_ptr(), v.data_ptr(),
                        {k.stride(0), k.stride(1), k.stride(2)}, {v.stride(0), v.stride(1), v.stride(2)},
                        context_ref(k, v)});
  }
  p.keys = step_keys(s);
  p.q_start = s.q_start.data_ptr<int32_t>();
  p.q_len = s.q_len.data_ptr<int32_t>();
  p.token_seq = s.token_seq.data_ptr<int32_t>();
  p.pos = s.positions.data_ptr<int64_t>();
  p.cos_sin = s.cos_sin.data_ptr();
  p.s_cs = s.cos_sin.stride(0);
  p.cs_rows = s.cos_sin.size(0);
  p.table_blocks = s.block_table.size(1);
  p.cache_blocks = k_caches[0].size(0);
  p.x = x.data_ptr<float>();
  p.residual = residual.data_ptr<float>();
  p.qkv = s.qkv.data_ptr<float>();
  p.attended = s.attended.data_ptr<float>();
  p.h = s.h.data_ptr<float>();
  p.act = s.act.data_ptr<float>();
  p.H = H;
  p.heads = s.q.size(1);
  p.kv_heads = s.k.size(1);
  p.D = s.q.size(2);
  p.eps = s.eps;
  p.scale = s.scale;
  const bool bf16_table = s.cos_sin.scalar_type() == at::kBFloat16;
  dispatch(at::kFloat, cache, "decode_layers", [&](auto, auto c) {
    using C = decltype(c);
    p.rope = bf16_table ? &rope_of<C, c10::BFloat16> : &rope_of<C, float>;
    p.attend = &attend_of<C>;
  });
  p.row.resize(H);
  return p;
#endif
}

// The keys a step reads lie inside the block table and their blocks inside the caches (what
// check_step held for attention): before the region, whose context prefetch reads the table.
void check_keys(const StepPlan& p) {
  check_row_blocks(p.keys.table, p.table_blocks, p.keys.block_size, p.keys.ctx[0], p.cache_blocks);
}

// The step's row lies inside the rotary table and its keys (what rope_store and attention checked
// each layer): checked where the first layer's rope and attention read them, once a step.
void check_row(const StepPlan& p) {
  const int64_t pos = p.pos[0], ctx = p.keys.ctx[0];
  TORCH_CHECK(pos >= 0 && pos < p.cs_rows, "position ", pos, " is past the rotary table's ", p.cs_rows, " rows");
  TORCH_CHECK(p.q_start[0] == 0 && p.q_len[0] == 1 && pos < ctx, "sequence 0: its query at position ", pos, " and ",
              ctx, " keys do not fit one query row");
}

bool layers_in_one_region(StepPlan& p) {
#if !defined(VKV_VEC)
  return false;
#else
  if (decode_parts(p.keys.ctx[0], 1, 2) >= 2) return false;  // (attention past one work item)
  check_keys(p);
  const int64_t L = static_cast<int64_t>(p.layers.size());
  std::deque<NextContext> context;  // layer i's first keys and values: layer 0's asked for as the step starts,
  for (const LayerPlan& l : p.layers)  // layer i's in the down projection of layer i - 1
    context.emplace_back(p.keys, l.context);
  std::deque<AttendThenO> attend(L);
  Pair pair;
  bool solo = false;
  at::parallel_for(0, 2, 1, [&](int64_t lo, int64_t hi) {
    if (hi - lo == 2) {  // one thread ran the whole range: decode_layer's path instead
      solo = true;
      return;
    }
    const int64_t t = lo;
    StageClock clock;  // thread 0's: each stage ends when both threads are done with it
    clock.on &= t == 0;
    try {
      context[0].run();
      clock.lap(kContext);
      for (int64_t i = 0; i < L; ++i) {
        const LayerPlan& l = p.layers[i];
        if (t == 0) input_norm_row(p.x, p.residual, p.H, i == 0, l.input_norm, p.eps, p.row.data());
        if (!pair.meet(t)) return;
        clock.lap(kNorms);
        const auto [qlo, qhi] = share_of(t, l.qkv.P);
        panels_range(p.x, l.qkv, (p.heads + 2 * p.kv_heads) * p.D, l.qkv_bias, p.qkv, qlo, qhi);
        if (!pair.meet(t)) return;
        clock.lap(kQkv);
        auto rope_then_attend = [&] {
          if (i == 0) check_row(p);
          p.rope(p, l);
          clock.lap(kRope);
          p.attend(p, l, p.buf, p.wide);
          clock.lap(kAttention);
        };
        attend_then_o_part(t, false, attend[i], rope_then_attend, l.o, p.attended, p.h, p.H);
        if (t == 0 && attend[i].failed) std::rethrow_exception(attend[i].failed);
        if (!pair.meet(t)) return;
        clock.lap(kO);
        if (t == 0) norm_row<float>(p.h, p.residual, l.post_norm, p.H, p.eps, p.row.data());
        if (!pair.meet(t)) return;
        clock.lap(kNorms);
        const auto [glo, ghi] = share_of(t, l.gate_up.P / 2);
        gate_up_silu_share(p.h, l.gate_up, p.act, glo, ghi);
        if (!pair.meet(t)) return;
        clock.lap(kGateUp);
        const auto [dlo, dhi] = share_of(t, l.down.P);
        panels_range(p.act, l.down, p.H, nullptr, p.x, dlo, dhi);
        if (i + 1 < L) context[i + 1].run();
        if (!pair.meet(t)) return;
        clock.lap(kDown);
      }
    } catch (...) {
      pair.broken.store(true, std::memory_order_release);
      throw;
    }
  });
  return !solo;
#endif
}

// After the layers (decode_layers ends with it): the model's last norm and the LM head over the rows
// that sample (in Python the dozen small operations it replaces cost about 0.3 ms a step, run on
// caches the weights just streamed through). rows: int64 indices into x and residual; out:
// [rows, vocab] fp32. With bf16 (the model computes in bf16) every value is rounded where the
// layer-by-layer path's bf16 tensors round it: x and residual, the norm's output, the logits.
// So both paths give the same logits, to the bit.
// The last norm's output over the rows that sample, fp32 (what the LM head multiplies), into out:
// [rows, hidden]. Row by row with norm_row, add_rms_norm's own body, on copies of the rows (in bf16
// with `bf16`, rounded as .to(bf16) rounds), into a tensor decode_layers allocates once: the five
// ATen index_selects and casts this replaces took about 0.06 ms a token of a bf16 multi-step decode
// (timed inside decode_layers), and the switch measured 1.006x (12 alternations, 8 faster).
template <typename T>
void final_hidden_impl(const at::Tensor& x, const at::Tensor& residual, const int64_t* rows, int64_t R,
                       const at::Tensor& norm, double eps, float* out) {
  const int64_t H = x.size(1);
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const T* w = norm.data_ptr<T>();
  std::vector<T> h(H), r(H);
  std::vector<float> row(H);
  for (int64_t i = 0; i < R; ++i) {
    const float *xr = xp + rows[i] * H, *rr = rp + rows[i] * H;
    for (int64_t j = 0; j < H; ++j) {
      store(h.data() + j, xr[j]);
      store(r.data() + j, rr[j]);
    }
    norm_row<T>(h.data(), r.data(), w, H, eps, row.data());
    for (int64_t j = 0; j < H; ++j) out[i * H + j] = load(h[j]);
  }
}

void final_hidden(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& rows, const at::Tensor& norm,
                  double eps, bool bf16, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && residual.sizes() == x.sizes() &&
              residual.scalar_type() == at::kFloat && residual.is_contiguous(),
              "x and residual: [rows, hidden] fp32 contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(), "rows: [n] int64");
  TORCH_CHECK(norm.dim() == 1 && norm.is_contiguous() && norm.size(0) == x.size(1) &&
              norm.scalar_type() == (bf16 ? at::kBFloat16 : at::kFloat),
              "the final norm: [hidden], bf16 under bf16 and fp32 otherwise");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == rows.size(0) &&
              out.size(1) == x.size(1), "out: [rows, hidden] fp32");
  const int64_t* idx = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(idx[i] >= 0 && idx[i] < x.size(0), "rows: index ", idx[i], " is out of range for ", x.size(0), " rows");
  if (bf16)
    final_hidden_impl<c10::BFloat16>(x, residual, idx, rows.size(0), norm, eps, out.data_ptr<float>());
  else
    final_hidden_impl<float>(x, residual, idx, rows.size(0), norm, eps, out.data_ptr<float>());
}

void last_logits(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& rows, const at::Tensor& norm,
                 double eps, const at::Tensor& panels, bool bf16, at::Tensor out) {
  at::Tensor h = x.new_empty({rows.numel(), x.size(1)});
  final_hidden(x, residual, rows, norm, eps, bf16, h);
  linear_panels(h, panels, std::nullopt, out);
  if (bf16) out.copy_(out.to(at::kBFloat16));
}


// Each row's maximum and the index of its first occurrence, as torch.max(x, -1) gives them (a
// row holding NaN gives NaN, at its first NaN). torch's reduction with an index runs about 1 ns
// an element (45 us a row of a 49,152-token vocabulary, 0.7 ms for 32 rows); here a vector
// pass finds the maximum and a second finds where it first is.
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
// thread, each over its own run of panels, and vectorize (bf16's rounding written out above). In
// one thread, scalar, they cost the pick about 0.2 ms a step in bf16 and 0.1 ms in fp32: the
// bundled model's multi-step decode, 128 tokens a generation, the old and new picks alternated in
// one process on the 2-core EPYC (AVX-512), the pick 1021 -> 819 us a token in bf16 (30 pairs;
// decode_layers 1.017x, 18 of 30 faster) and 1774 -> 1673 us in fp32 (20 pairs; 1.023x, 15 of 20).
// A run's floor is a maximum and its pick the first maximum of its run, so the runs combine to
// the whole row's in any split. The second pass visits only the panels that may win (a panel's
// largest bound reaches the floor exactly when one of its tokens' does: the same panels, the same
// pick), instead of computing every token's bound again: in bf16 decode, timed inside the pick, the
// second pass 44-53 -> 9-10 us a token; decode_layers 1.024x and 1.020x (40 and 30 alternations, 25
// and 22 faster), fp32 1.032x (24, 15 faster). The first pass writes each token's upper bound over
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

// Multi-step decode's next inputs, written out: each row's token embedding into x (a bf16 embedding
// widens exactly, as the first step's did), positions and context lengths one on. As ATen ops
// (index_select, copy_, two add_) they took 50-135 us a step in decode (the stage clock's `next
// embedding`), where the same ops took 3-7 us in a loop of their own: after a step's weights have
// streamed through the caches, each op's dispatch runs cold (index_select alone 2.8 -> 29 us after a
// 16 MB parallel sum; timed inside decode_layers, index_select 79-83 us and the two add_ 67-70 us a
// step with the AVX2 kernels in a slow hour). Builds alternated in processes (3 pairs, AVX2 kernels,
// bf16): the stage 79-131 -> 3-4 us a step.
void next_inputs(const at::Tensor& embed, const int64_t* token, at::Tensor& x, const at::Tensor& pos,
                 const at::Tensor& ctx) {
  const int64_t M = x.size(0), H = x.size(1);
  float* out = x.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    TORCH_CHECK(token[r] >= 0 && token[r] < embed.size(0), "a picked token past the embedding's rows");
    if (embed.scalar_type() == at::kBFloat16) {
      const c10::BFloat16* e = embed.data_ptr<c10::BFloat16>() + token[r] * embed.stride(0);
      for (int64_t h = 0; h < H; ++h) out[r * H + h] = load(e[h]);
    } else {
      const float* e = embed.data_ptr<float>() + token[r] * embed.stride(0);
      std::copy(e, e + H, out + r * H);
    }
  }
  int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < pos.numel(); ++i) ++p[i];
  int32_t* c = ctx.data_ptr<int32_t>();
  for (int64_t i = 0; i < ctx.numel(); ++i) ++c[i];
}

// Multi-step greedy decode (decode_layers given `tokens`, [steps, rows] int64, and the embedding):
// after each step's logits, every row takes its greedy token (row_max: torch.max's first maximal
// index) and, while steps remain, the next step runs on those tokens' embeddings one position on,
// with no return to Python between steps. Each step is the one-step call's arithmetic, so the tokens
// are the ones steps single calls pick. The rows' pages must be mapped for every step's position.
// The loop ends early once every row has picked one of `stop_ids`, or a row's logits are not
// finite (that row's token is then -2); the rows of `tokens` past the last step run are -1. Given
// `pick` and `pick_bounds` (fp32 arithmetic), each pick reads a bf16 copy of the LM head instead of
// the logits (greedy_pick: the same token, from half the bytes); `logits` then holds no logits.
void decode_layers(at::Tensor x, at::Tensor residual, at::TensorList input_norms, at::TensorList post_norms,
                   double eps, at::TensorList qkv_weights, const c10::List<std::optional<at::Tensor>>& qkv_biases,
                   at::TensorList o_weights, at::TensorList gate_up_weights, at::TensorList down_weights,
                   int64_t num_heads, int64_t num_kv_heads, const at::Tensor& positions, const at::Tensor& cos_sin,
                   at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& block_table,
                   int64_t block_size, const at::Tensor& token_seq, const at::Tensor& q_start, const at::Tensor& q_len,
                   const at::Tensor& ctx_len, double scale, const std::optional<at::Tensor>& rows,
                   const std::optional<at::Tensor>& final_norm, const std::optional<at::Tensor>& lm_head, bool bf16,
                   std::optional<at::Tensor> logits, const std::optional<at::Tensor>& embed,
                   std::optional<at::Tensor> tokens, const std::optional<at::Tensor>& stop_ids,
                   const std::optional<at::Tensor>& pick, const std::optional<at::Tensor>& pick_bounds,
                   const std::optional<at::Tensor>& pick_scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == at::kFloat && x.is_contiguous() && residual.is_contiguous(),
              "x and residual: [rows, hidden] fp32 contiguous");  // (decode_layer copies and norms them in place)
  const size_t L = input_norms.size();
  TORCH_CHECK(L > 0 && post_norms.size() == L && qkv_weights.size() == L && qkv_biases.size() == L &&
              o_weights.size() == L && gate_up_weights.size() == L && down_weights.size() == L &&
              k_caches.size() == L && v_caches.size() == L, "one entry per layer in every list");
  const int64_t M = x.size(0), D = k_caches[0].size(3), nq = num_heads * D, nk = num_kv_heads * D;
  const int64_t inter = down_weights[0].size(1);
  const int64_t steps = tokens ? tokens->size(0) : 1;
  if (tokens) {
    TORCH_CHECK(logits && rows && rows->numel() == M && embed && embed->dim() == 2 && embed->size(1) == x.size(1),
                "steps need logits for every row and the embedding");
    TORCH_CHECK(tokens->dim() == 2 && tokens->size(1) == M && tokens->scalar_type() == at::kLong &&
                tokens->is_contiguous(), "tokens: [steps, rows] int64 contiguous");
    TORCH_CHECK(!stop_ids || stop_ids->scalar_type() == at::kLong, "stop_ids: int64");
    TORCH_CHECK(!pick == !pick_bounds, "the pick's bf16 panels come with their bounds");
    TORCH_CHECK((embed->scalar_type() == at::kFloat || embed->scalar_type() == at::kBFloat16) &&
                    embed->stride(1) == 1 && positions.scalar_type() == at::kLong && ctx_len.scalar_type() == at::kInt,
                "steps: an fp32 or bf16 embedding with contiguous rows, int64 positions, int32 context lengths");
    tokens->fill_(-1);
  }
  // the positions and context lengths move on each step: a copy, so the caller's stay as given
  const at::Tensor pos = steps > 1 ? positions.clone() : positions, ctx = steps > 1 ? ctx_len.clone() : ctx_len;
  DecodeStep s{pos, cos_sin, block_table, token_seq, q_start, q_len, ctx, block_size, eps, scale};
  s.qkv = x.new_empty({M, nq + 2 * nk});
  s.q = s.qkv.narrow(1, 0, nq).view({M, num_heads, D});
  s.k = s.qkv.narrow(1, nq, nk).view({M, num_kv_heads, D});
  s.v = s.qkv.narrow(1, nq + nk, nk).view({M, num_kv_heads, D});
  s.attended = x.new_empty({M, num_heads, D});
  s.h = x.new_empty({M, x.size(1)});
  s.gate_up = x.new_empty({M, 2 * inter});
  s.act = x.new_empty({M, inter});
  at::Tensor best = x.new_empty({M}), picked = x.new_empty({M}, x.options().dtype(at::kLong));
  at::Tensor hidden = x.new_empty({rows ? rows->numel() : 0, x.size(1)});  // the last norm's rows
  std::vector<char> stopped(M, 0);
  for (size_t i = 0; i < L; ++i)
    TORCH_CHECK(down_weights[i].size(1) == inter && k_caches[i].size(3) == D, "every layer has the same shapes");
  const int64_t* stop = stop_ids ? stop_ids->data_ptr<int64_t>() : nullptr;
  const int64_t num_stops = stop_ids ? stop_ids->numel() : 0;
  std::optional<StepPlan> plan = plan_of(s, x, residual, input_norms, post_norms, qkv_weights, qkv_biases, o_weights,
                                         gate_up_weights, down_weights, k_caches, v_caches);
  for (int64_t step = 0; step < steps; ++step) {
    if (!(plan && layers_in_one_region(*plan)))
      for (size_t i = 0; i < L; ++i) {
        const bool last = i + 1 == L;
        decode_layer(s, x, residual, i == 0, input_norms[i], post_norms[i], qkv_weights[i], qkv_biases.get(i),
                     o_weights[i], gate_up_weights[i], down_weights[i], k_caches[i], v_caches[i],
                     last ? nullptr : &k_caches[i + 1], last ? nullptr : &v_caches[i + 1]);
      }
    StageClock clock;
    if (clock.on) stage_steps.fetch_add(1, std::memory_order_relaxed);
    if (!logits) return;
    TORCH_CHECK(rows && final_norm && lm_head, "logits need rows, the final norm and the LM head");
    if (tokens && pick) {  // only the pick is wanted: from half the LM head's bytes, exactly
      final_hidden(x, residual, *rows, *final_norm, eps, bf16, hidden);
      greedy_pick(hidden, *lm_head, *pick, *pick_bounds, pick_scales, bf16, *logits, best, picked);
    } else {
      last_logits(x, residual, *rows, *final_norm, eps, *lm_head, bf16, *logits);
      if (!tokens) return;
      row_max(*logits, best, picked);
    }
    const float* value = best.data_ptr<float>();
    int64_t* token = picked.data_ptr<int64_t>();
    bool finite = true, all_stopped = true;
    for (int64_t r = 0; r < M; ++r) {
      if (!std::isfinite(value[r])) {
        token[r] = -2;
        finite = false;
      }
      for (int64_t j = 0; j < num_stops && !stopped[r]; ++j) stopped[r] = token[r] == stop[j];
      all_stopped &= stopped[r] != 0;
    }
    std::copy(token, token + M, tokens->data_ptr<int64_t>() + step * M);
    clock.lap(kPick);
    if (!finite || all_stopped || step + 1 == steps) break;
    next_inputs(*embed, token, x, pos, ctx);
    clock.lap(kEmbed);
  }
}


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

}  // namespace

std::string isa() { return VKV_ISA; }

TORCH_LIBRARY(vkv, m) {
  m.def("isa() -> str", &isa);  // which vector layer this build has
  m.def("attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int block_size, "
        "Tensor q_start, Tensor q_len, Tensor ctx_len, float scale, Tensor(a!) out) -> ()");
  m.def("rope_store(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, Tensor cos_sin, Tensor(c!) k_cache, "
        "Tensor(d!) v_cache, Tensor block_table, int block_size, Tensor token_seq) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("decode_layers(Tensor(a!) x, Tensor(b!) residual, Tensor[] input_norms, Tensor[] post_norms, float eps, "
        "Tensor[] qkv_weights, Tensor?[] qkv_biases, Tensor[] o_weights, Tensor[] gate_up_weights, "
        "Tensor[] down_weights, int num_heads, int num_kv_heads, Tensor positions, Tensor cos_sin, "
        "Tensor(c!)[] k_caches, Tensor(d!)[] v_caches, Tensor block_table, int block_size, Tensor token_seq, "
        "Tensor q_start, Tensor q_len, Tensor ctx_len, float scale, Tensor? rows=None, Tensor? final_norm=None, "
        "Tensor? lm_head=None, bool bf16=False, Tensor(e!)? logits=None, Tensor? embed=None, Tensor(f!)? tokens=None, "
        "Tensor? stop_ids=None, Tensor? pick=None, Tensor? pick_bounds=None, Tensor? pick_scales=None) -> ()");
  m.def("last_logits(Tensor x, Tensor residual, Tensor rows, Tensor norm, float eps, Tensor panels, bool bf16, "
        "Tensor(a!) out) -> ()");
  m.def("row_max(Tensor x, Tensor(a!) values, Tensor(b!) indices) -> ()");
  m.def("greedy_pick(Tensor h, Tensor panels, Tensor pick, Tensor pick_bounds, Tensor? pick_scales, bool bf16, "
        "Tensor(a!) logits, Tensor(b!) best, Tensor(c!) picked) -> ()");
  m.def("lora_segments(Tensor x, Tensor(a!) out, Tensor[] a, Tensor[] b, int[] bounds) -> ()");
  m.def("panel_width() -> int", &panel_width);  // output columns per panel of linear_panels' weights
  m.def("ahead_hint() -> str", &ahead_hint);  // how steps ask for the weights they read next
  m.def("time_decode_stages(bool on) -> ()", &time_decode_stages);  // decode_layers' stage clock
  m.def("decode_stage_times(bool reset) -> Dict(str, float)", &decode_stage_times);  // its sums (us), "steps"
  m.def("linear_panels(Tensor x, Tensor panels, Tensor? bias, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(vkv, CPU, m) {
  m.impl("attention", &attention);
  m.impl("rope_store", &rope_store);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("decode_layers", &decode_layers);
  m.impl("last_logits", &last_logits);
  m.impl("row_max", &row_max);
  m.impl("greedy_pick", &greedy_pick);
  m.impl("lora_segments", &lora_segments);
  m.impl("linear_panels", &linear_panels);
}
