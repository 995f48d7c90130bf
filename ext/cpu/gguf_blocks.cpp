// torch.ops.vkv.linear_gguf and dequantize_gguf: x W^T and W's rows, W as a GGUF file stores it.
#include "common.h"
#include "ops.h"

#include <c10/util/Half.h>

#include <limits>
#include <type_traits>
#include <vector>

namespace vkv {

// Note [GGUF weights as they are stored]
// Rationale: a GGUF at Q8_0 or Q4_1 holds 1.06 or 0.625 bytes a weight; dequantized to fp32 it is
// 4, so a model served from it took 4-6x its file's memory, and a decode step, bound by the
// weights' bytes, read 4-6x what llama.cpp reads.
// Approach: the weight stays in the file's blocks, row after row ([N, K / 32 blocks]), and each
// block is unpacked in registers where it is used. A row's 32 weights of a block are
//   Q8_0  {fp16 d; int8 q[32]}          w = d * q
//   Q4_0  {fp16 d; uint8 q[16]}         w = d * (q - 8), q's low nibbles then its high ones
//   Q4_1  {fp16 d, m; uint8 q[16]}      w = d * q + m
// (ggml's block_q8_0, block_q4_0, block_q4_1; gguf-py's `dequantize` is the tests' oracle), each
// weight rounded once (d * q is exact; d * q + c one FMA) where it is unpacked to fp32; served,
// these three meet x rounded to int8 and sum in integers (below), as llama.cpp computes. Q4_K
// and Q6_K (what a Q4_K_M file holds) pack 256 weights a super-block (unpack_super below); served,
// their rows are interleaved by eight and meet x the same way (Note [K-quants interleaved by
// eight]).
// Implementation: linear_gguf splits W's rows among the threads. With quantize_x (what Linear asks
// for Q8_0, Q4_0 and Q4_1 weights, and for interleaved Q4_K and Q6_K), each row of x is first
// rounded to int8 blocks of 32 with a scale (XBlocks: ggml's Q8_1, as llama.cpp's CPU backend
// quantizes activations), and each block's products are summed in integers (maddubs: 32 products
// in two instructions instead of a fp32 unpack and four FMAs); four weight rows at a time share
// each block of x (rows4_q8), or, where the loader interleaved the rows by eight (a model's
// weights), eight rows share each of its loads (group_q8, group_k). The error this adds is
// rounding x, half its block's step times |w|: the tests' bound. Every row of x is computed alone,
// so a sequence's output does not depend on its batch. Without quantize_x (k-quant rows not
// interleaved, and the fp32 reference): for one row of x, each weight row's blocks are unpacked
// in registers and multiplied with x there (row_dot); for more rows, each thread takes 4 weight
// rows at a time, unpacks them into fp32 in its own buffer (4 x K floats), and multiplies every
// row of x with them. dequantize_gguf writes whole rows (the token embedding's lookups). The AVX2
// paths are the fast ones; the scalar ones are their reference (x rounded alike: nearest, ties to
// even).
// Measured in benchmarks/results/cpu/design_choices.json ("gguf_row_dot") and gguf_blocks.json.
// Limitations: the other k-quants (Q2_K, Q3_K, Q5_K) are not here (the loader dequantizes them);
// Q4_K / Q6_K rows not interleaved (N not a multiple of 8) unpack with plain loops and multiply in
// fp32; the integer sums take VNNI's dpbusd where the build has it (dot4 below), the same ymm
// width and the same integers as AVX2's maddubs (no zmm or AMX int8 path yet); decode_layers
// (decode_step.cpp) takes the blocks (linear_blocks, blocks_range, blocks_row) in each of its paths,
// but its greedy steps pick from the full logits (no half-bytes copy of a blocks LM head).

enum GgufType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };  // ggml's type ids
constexpr int64_t kBlock = 32, kSuper = 256;  // weights a block holds; a k-quant's super-block

// Bytes of one block of `block_weights(type)` weights.
int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ6_K: return 210;
    default: TORCH_CHECK(false, "GGUF type ", type, " is not one vkv reads as stored (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)");
  }
  return 0;
}

int64_t block_weights(int64_t type) { return type == kQ4_K || type == kQ6_K ? kSuper : kBlock; }

VKV_INLINE float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // (exact, as the conversion below: fp16 widens to fp32 without rounding)
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// A Q4 block's parts: its 16 bytes of nibbles u, and c of w = d * u + c (Q4_1's m, Q4_0's -8 d).
VKV_INLINE const uint8_t* q4_nibbles(const uint8_t* block, int64_t type) { return block + (type == kQ4_1 ? 4 : 2); }
VKV_INLINE float q4_offset(const uint8_t* block, int64_t type, float d) {
  return type == kQ4_1 ? half_at(block + 2) : -8.0f * d;
}

// One k-quant super-block of 256 weights as fp32 into out, in gguf-py's order of operations.
// Every product here is exact in fp32 (an fp16 scale times a 6- or 8-bit one times a 4- or 6-bit
// quant needs at most 24 bits), so Q4_K's one subtraction is its only rounding, as in gguf-py.
//   Q4_K {fp16 d, dmin; uint8 scales[12]; uint8 q[128]}: 8 groups of 32, group g's 6-bit scale
//        s_g and min m_g packed in `scales`; w = (d s_g) q - dmin m_g, q the low nibbles of 32
//        bytes for an even group, their high nibbles for the odd one after it
//   Q6_K {uint8 ql[128], qh[64]; int8 scales[16]; fp16 d}: 16 groups of 16, w = (d scale) (q - 32),
//        q's low 4 bits from ql and high 2 from qh
void unpack_super(const uint8_t* block, int64_t type, float* out) {
  if (type == kQ4_K) {
    const float d = half_at(block), dmin = half_at(block + 2);
    const uint8_t* s = block + 4;
    const uint8_t* q = block + 16;
    for (int j = 0; j < 8; j += 2, q += 32, out += 64) {
      float scale[2], low[2];
      for (int h = 0; h < 2; ++h) {
        const int g = j + h;
        const int sc = g < 4 ? s[g] & 63 : (s[g + 4] & 0x0F) | ((s[g - 4] >> 6) << 4);
        const int m = g < 4 ? s[g + 4] & 63 : (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
        scale[h] = d * static_cast<float>(sc);
        low[h] = dmin * static_cast<float>(m);
      }
      for (int l = 0; l < 32; ++l) {
        out[l] = scale[0] * static_cast<float>(q[l] & 0x0F) - low[0];
        out[l + 32] = scale[1] * static_cast<float>(q[l] >> 4) - low[1];
      }
    }
    return;
  }
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half_at(block + 208);
  for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, out += 128) {
    float scale[8];
    for (int i = 0; i < 8; ++i) scale[i] = d * static_cast<float>(sc[i]);
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      out[l] = scale[is] * static_cast<float>(((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32);
      out[l + 32] = scale[is + 2] * static_cast<float>(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
      out[l + 64] = scale[is + 4] * static_cast<float>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      out[l + 96] = scale[is + 6] * static_cast<float>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
  }
}

template <int64_t kType>
constexpr int64_t kBytes = kType == kQ8_0 ? 34 : kType == kQ4_1 ? 20 : 18;

// f(type as a compile-time constant) for a block of 32 weights: Q8_0, Q4_1, else Q4_0.
template <typename F>
VKV_INLINE void with_block_type(int64_t type, F f) {
  if (type == kQ8_0) return f(std::integral_constant<int64_t, kQ8_0>{});
  if (type == kQ4_1) return f(std::integral_constant<int64_t, kQ4_1>{});
  f(std::integral_constant<int64_t, kQ4_0>{});
}

// Four weight rows from row n on for rows4_q8, the last of the `count` there repeated past it.
VKV_INLINE void four_rows(const uint8_t* w, int64_t n, int64_t count, int64_t row_bytes, const uint8_t* rows[4]) {
  for (int64_t r = 0; r < 4; ++r) rows[r] = w + (n + std::min(r, count - 1)) * row_bytes;
}

#if defined(__AVX2__) && defined(__FMA__)

// A 32-weight block's weights as 4 x 8 lanes: d * q (exact), or d * q + c in one rounding.
template <int64_t kType>
VKV_INLINE void block_lanes(const uint8_t* block, __m256 w[4]) {
  const float d = half_at(block);
  const __m256 vd = _mm256_set1_ps(d);
  if constexpr (kType == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int j = 0; j < 4; ++j) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j));
      w[j] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
    }
  } else {  // q's low nibbles are weights 0-15, its high ones 16-31
    const __m256 vc = _mm256_set1_ps(q4_offset(block, kType, d));
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q4_nibbles(block, kType)));
    const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), vc);
  }
}

template <int64_t kType>
void unpack_blocks(const uint8_t* row, int64_t K, float* out) {
  __m256 w[4];
  for (int64_t b = 0; b < K / kBlock; ++b, row += kBytes<kType>, out += kBlock) {
    block_lanes<kType>(row, w);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + 8 * j, w[j]);
  }
}

// The sum of 8 lanes: halves, then pairs, then the last two.
VKV_INLINE float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// One row of K weights from `row` (K / 32 blocks, or K / 256 super-blocks), as fp32 into out.
void unpack_row(const uint8_t* row, int64_t type, int64_t K, float* out) {
  const int64_t bytes = block_bytes(type);
  if (block_weights(type) == kSuper) {
    for (int64_t b = 0; b < K / kSuper; ++b) unpack_super(row + b * bytes, type, out + b * kSuper);
    return;
  }
#if defined(__AVX2__) && defined(__FMA__)
  if (type == kQ8_0) return unpack_blocks<kQ8_0>(row, K, out);
  if (type == kQ4_1) return unpack_blocks<kQ4_1>(row, K, out);
  return unpack_blocks<kQ4_0>(row, K, out);
#else
  for (int64_t b = 0; b < K / kBlock; ++b, row += bytes, out += kBlock) {
    const float d = half_at(row);
    if (type == kQ8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(row + 2);
      for (int j = 0; j < kBlock; ++j) out[j] = d * static_cast<float>(q[j]);
      continue;
    }
    const float c = q4_offset(row, type, d);  // w = d * q + c
    const uint8_t* q = q4_nibbles(row, type);
    for (int j = 0; j < 16; ++j) {
      out[j] = std::fma(d, static_cast<float>(q[j] & 0x0F), c);
      out[j + 16] = std::fma(d, static_cast<float>(q[j] >> 4), c);
    }
  }
#endif
}

// sum over k of a[k] b[k], in fp32 (8 lanes, then their sum, on AVX2).
VKV_INLINE float dot(const float* a, const float* b, int64_t K) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), acc1);
  }
  float total = sum8(_mm256_add_ps(acc0, acc1));
  for (; k < K; ++k) total = std::fma(a[k], b[k], total);
  return total;
#else
  float total = 0.0f;
  for (int64_t k = 0; k < K; ++k) total = std::fma(a[k], b[k], total);
  return total;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
// One row's dot product with one row of x, each block unpacked in registers where it is used:
// decode's one row of x reads each weight once, so nothing is gained by unpacking it to memory
// first. The weights are the values unpack_row writes (d * q, exact; d * q + c in one rounding),
// each 8-lane group of a block summed in its own accumulator (four independent chains).
template <int64_t kType>
float row_dot(const uint8_t* row, int64_t K, const float* x) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 w[4];
  for (int64_t b = 0; b < K / kBlock; ++b, row += kBytes<kType>, x += kBlock) {
    block_lanes<kType>(row, w);
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + 8 * j), acc[j]);
  }
  return sum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

template <int64_t kType>
void rows_dot(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const float* x, const float* bias, float* out) {
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) out[n] = row_dot<kType>(w + n * row_bytes, K, x) + (bias ? bias[n] : 0.0f);
  });
}
#endif

// Rows of x as int8 blocks of 32, ggml's Q8_1 for activations: d = max|x| / 127, q = x / d rounded
// to the nearest (ties to even), s = d * sum(q). A block with a NaN or an infinity gets d = NaN, so
// every output it touches is NaN, as the fp32 path's would be non-finite. The AVX2 and scalar
// paths compute the same q, d and s bit for bit (max and the one product x * (1 / d) are exact or
// rounded once alike).
// Each block's two halves of 16 also keep sum(q) as integers (h: Q6_K's groups of 16 subtract 32
// from every quant, so they need x's sums per half, as llama.cpp's Q8_K keeps bsums).
struct XBlocks {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int16_t> h;
};

void quantize_rows(const float* x, int64_t M, int64_t K, XBlocks& out) {
  const int64_t blocks = K / kBlock;
  out.q.resize(M * K);
  out.d.resize(M * blocks);
  out.s.resize(M * blocks);
  out.h.resize(2 * M * blocks);
  at::parallel_for(0, M * blocks, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const float* v = x + b * kBlock;
      int8_t* q = out.q.data() + b * kBlock;
      float amax = 0.0f;
      bool finite = true;
      for (int j = 0; j < kBlock; ++j) {
        finite &= std::isfinite(v[j]);
        amax = std::max(amax, std::fabs(v[j]));
      }
      if (!finite) {
        std::fill(q, q + kBlock, 0);
        out.d[b] = out.s[b] = std::numeric_limits<float>::quiet_NaN();
        out.h[2 * b] = out.h[2 * b + 1] = 0;
        continue;
      }
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
#if defined(__AVX2__)
      const __m256 vid = _mm256_set1_ps(id);
      __m256i i32[4];
      for (int j = 0; j < 4; ++j) i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), vid));
      const __m256i i16 = _mm256_packs_epi32(i32[0], i32[1]), i16b = _mm256_packs_epi32(i32[2], i32[3]);
      const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16, i16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), i8);
#else
      for (int j = 0; j < kBlock; ++j) q[j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
#endif
      int32_t half[2] = {0, 0};
      for (int j = 0; j < kBlock; ++j) half[j / 16] += q[j];
      out.d[b] = d;
      out.s[b] = d * static_cast<float>(half[0] + half[1]);
      out.h[2 * b] = static_cast<int16_t>(half[0]);
      out.h[2 * b + 1] = static_cast<int16_t>(half[1]);
    }
  });
}

// C rows of x from row m of xq, as the interleaved kernels read them: each row's quants, and its
// blocks' scales d, sums s and half sums h.
template <int C>
struct XRows {
  const int8_t* q[C];
  const float *d[C], *s[C];
  const int16_t* h[C];
  XRows(const XBlocks& xq, int64_t m, int64_t K) {
    const int64_t blocks = K / kBlock;
    for (int c = 0; c < C; ++c) {
      q[c] = xq.q.data() + (m + c) * K;
      d[c] = xq.d.data() + (m + c) * blocks;
      s[c] = xq.s.data() + (m + c) * blocks;
      h[c] = xq.h.data() + 2 * (m + c) * blocks;
    }
  }
};

#if defined(__AVX2__) && defined(__FMA__)
// x's four bytes at p, in every lane (the interleaved kernels' operand: one row per lane).
VKV_INLINE __m256i four(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Whether the build has VNNI's dpbusd (AVX512-VNNI with VL: Intel since Cascade Lake, AMD since
// Zen 4; or AVX-VNNI: Intel since Alder Lake): four u8 x s8 products summed into each int32 lane in
// one instruction. Without it, maddubs sums pairs into int16 and madd widens them (three
// instructions); the sums are the same integers either way (no pair can saturate int16: the
// callers' bounds), so a row's output is the same bits on either path. The emulated AVX-512 build
// (VKV_EMULATE_AVX512) takes dpbusd through SIMDe, so this path builds and is tested on any CPU.
VKV_INLINE __m256i dot4_maddubs(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(VKV_EMULATE_AVX512)
constexpr bool kVnni = true;
VKV_INLINE __m256i dot4(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
constexpr bool kVnni = true;
VKV_INLINE __m256i dot4(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
constexpr bool kVnni = false;
VKV_INLINE __m256i dot4(__m256i acc, __m256i u, __m256i s) { return dot4_maddubs(acc, u, s); }
#endif

// A block's 32 weights as bytes in x's order: Q4's nibbles u (w = d * u + c), Q8_0's q (w = d * q).
template <int64_t kType>
VKV_INLINE __m256i block_bytes_of(const uint8_t* block) {
  if constexpr (kType == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q4_nibbles(block, kType)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), _mm_and_si128(packed, mask));
  }
}

// sum_j w_j q_j over a block, as 8 int32 lanes: u8 x s8 pairs (maddubs; at most 2 x 15 x 127, or
// 2 x 128 x 127 for Q8_0 through |w| and q's sign, no saturation), then pairs of those.
template <int64_t kType>
VKV_INLINE __m256i block_isums(const uint8_t* block, __m256i x) {
  const __m256i w = block_bytes_of<kType>(block);
  const __m256i pairs = kType == kQ8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                                       : _mm256_maddubs_epi16(w, x);
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
#endif

// Bytes of a weight row asked for into L1 ahead of the block being summed: a decode step streams
// every row from memory once (design_choices.json, "gguf_rows_ahead": 512 against 256 and 1024).
constexpr int64_t kAhead = 512;

#if defined(__AVX2__) && defined(__FMA__)
// An interleaved group's eight fp16 scales d (its first 16 bytes) as fp32; `stride` bytes from
// kAhead past g asked for into L1 first (a step streams every group once).
VKV_INLINE __m256 group_scales(const uint8_t* g, int64_t stride) {
  for (int64_t ahead = 0; ahead < stride; ahead += 64)
    _mm_prefetch(reinterpret_cast<const char*>(g) + kAhead + ahead, _MM_HINT_T0);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
}
#endif

// Four weight rows' dot products with one row of x in XBlocks: per block, d_w d_x sum(u q) + c_w s_x
// (c_w = m for Q4_1, -8 d_w for Q4_0, 0 for Q8_0). The integer sums are exact, each block's scale
// product rounded once, the terms summed in fp32. Four rows at a time load each block of x once
// and keep eight independent chains of sums (a row alone would wait on its sums' latency).
template <int64_t kType>
void rows4_q8(const uint8_t* const row[4], int64_t K, const int8_t* q, const float* d, const float* s, float out[4]) {
  const int64_t blocks = K / kBlock;
  float c_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < blocks; ++b, q += kBlock) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    for (int r = 0; r < 4; ++r) {
      const uint8_t* block = row[r] + b * kBytes<kType>;
      _mm_prefetch(reinterpret_cast<const char*>(block) + kAhead, _MM_HINT_T0);
      const float dw = half_at(block);
      const __m256 sums = _mm256_cvtepi32_ps(block_isums<kType>(block, x));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * d[b]), sums, acc[r]);
      if constexpr (kType != kQ8_0)
        c_sum[r] = std::fma(q4_offset(block, kType, dw), s[b], c_sum[r]);
    }
  }
  for (int r = 0; r < 4; ++r) out[r] = sum8(acc[r]) + c_sum[r];
#else
  const int64_t bytes = block_bytes(kType);
  for (int r = 0; r < 4; ++r) {
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row[r] + b * bytes;
      const int8_t* x = q + b * kBlock;
      const float dw = half_at(block);
      int32_t isum = 0;
      if (kType == kQ8_0) {
        const int8_t* w = reinterpret_cast<const int8_t*>(block + 2);
        for (int j = 0; j < kBlock; ++j) isum += w[j] * x[j];
      } else {
        const uint8_t* u = q4_nibbles(block, kType);
        for (int j = 0; j < 16; ++j) isum += (u[j] & 0x0F) * x[j] + (u[j] >> 4) * x[j + 16];
      }
      total = std::fma(dw * d[b], static_cast<float>(isum), total);
      if (kType != kQ8_0) c_sum[r] = std::fma(q4_offset(block, kType, dw), s[b], c_sum[r]);
    }
    out[r] = total + c_sum[r];
  }
#endif
}

template <int64_t kType>
void rows_dot_q8(const XBlocks& xq, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N,
                 const float* bias, float* out) {
  constexpr int64_t kRows = 4;  // weight rows a task takes, read from L1 for every row of x after the first
  const int64_t blocks = K / kBlock;
  at::parallel_for(0, (N + kRows - 1) / kRows, M == 1 ? 4 : 1, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo * kRows; n < std::min(N, hi * kRows); n += kRows) {
      const int64_t count = std::min(kRows, N - n);
      const uint8_t* rows[kRows];
      four_rows(w, n, count, row_bytes, rows);
      for (int64_t m = 0; m < M; ++m) {
        float dots[kRows];
        rows4_q8<kType>(rows, K, xq.q.data() + m * K, xq.d.data() + m * blocks, xq.s.data() + m * blocks, dots);
        for (int64_t r = 0; r < count; ++r) out[m * N + n + r] = dots[r] + (bias ? bias[n + r] : 0.0f);
      }
    }
  });
}

// Note [GGUF rows interleaved by eight]
// Rationale: summing one weight row against x block by block (rows4_q8) spends most of a block's
// instructions around its 32 products: the row's fp16 scale and offset converted one at a time, a
// scale product broadcast, the eight lanes of the integer sums turned to floats and, once a row,
// summed across. A one-row decode of the bundled Q4_1 model streamed its projections at 6-8 GB/s
// of a machine that reads 29: bound by those instructions, not by memory.
// Approach: at load, each group of eight rows of a Q8_0, Q4_0 or Q4_1 weight is rearranged, block
// by block, so that the eight rows' values for the same block lie side by side: their eight fp16
// scales (and Q4_1's eight offsets) together, then their quants four bytes a row at a time. One
// 32-byte load then holds four weights of each of the eight rows; x's matching four bytes are
// broadcast to all eight, and maddubs + madd leave each row's sum in its own lane. So the scales
// convert eight at a time, every lane is a row (no sums across lanes), and a block of eight rows
// costs about what one row's did. The bytes are the file's, moved: the same size, exactly
// reversible (GgufWeight.interleaved and .plain in engine/models/gguf_weights.py), as llama.cpp's CPU
// backend repacks some types (its block_q4_0x8). Measured: design_choices.json, "gguf_rows_by_eight".
// Implementation: a group's block b, for rows r = 0..7 (fp16 halves, then quants):
//   Q8_0  d[8] | for k = 0..7: for r: q_r[4k .. 4k+3]             16 + 256 = 8 x 34 bytes
//   Q4_0  d[8] | for j = 0..3: for r: nibbles_r[4j .. 4j+3]        16 + 128 = 8 x 18
//   Q4_1  d[8] | m[8] | nibbles as Q4_0                             32 + 128 = 8 x 20
// A Q4 byte's low nibble is weight 4j + i, its high one 16 + 4j + i. Per block and row, the sum is
// the integer sum(u q) (exact; Q4's eight maddubs pairs summed in int16 first: at most 8 x 2 x 15 x
// 127 = 30480), then acc = fma(sum, d_w d_x, acc) and off = fma(c_w, s_x, off) in block order,
// the row's output acc + off: the same operations on every path (AVX2 lanes, the scalar build's
// loop, one row of x or a batch), so a row's output is the same bits alone or batched, and the
// AVX2 and scalar builds agree to the bit. Weights held this way are [N / 8, K / 32, 8 x block
// bytes] uint8, the last size naming the type.
// Limitations: N must be a multiple of 8 (the loader keeps other weights as the file has them);
// the k-quants' super-blocks have a layout of their own (Note [K-quants interleaved by eight]).
constexpr int64_t kGroup = 8;

// The eight rows' sums of one group against C rows of x (xq's rows m .. m + C - 1), in block order
// (see the note): out[c][r]. Each row of x meets the weights through the same operations whatever
// C is; C > 1 shares each load and unpacking of the weights among the rows (a batch, a prompt).
template <int64_t kType, int C>
void group_q8(const uint8_t* g, int64_t blocks, const XBlocks& xq, int64_t m, int64_t K, float out[][kGroup]) {
  constexpr int64_t kHalves = kType == kQ4_1 ? 2 : 1, kQuants = kType == kQ8_0 ? 32 : 16;
  constexpr int64_t kStride = kGroup * (2 * kHalves + kQuants);
  const XRows<C> rows(xq, m, K);
  auto &q = rows.q, &d = rows.d, &s = rows.s;
#if defined(__AVX2__) && defined(__FMA__)
  constexpr bool vnni = kVnni && C > 1;  // (one row of x, a decode step bound by memory: maddubs)
  const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0F);
  __m256 acc[C], off[C];
  for (int c = 0; c < C; ++c) acc[c] = off[c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, g += kStride) {
    const __m256 dw = group_scales(g, kStride);
    const uint8_t* quants = g + 16 * kHalves;
    __m256i isum[C];
    if constexpr (kType == kQ8_0) {
      for (int c = 0; c < C; ++c) isum[c] = _mm256_setzero_si256();
      for (int k = 0; k < 8; ++k) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * k));
        const __m256i magnitude = _mm256_sign_epi8(w, w);
        for (int c = 0; c < C; ++c) {
          const __m256i x = _mm256_sign_epi8(four(q[c] + b * kBlock + 4 * k), w);
          isum[c] = vnni ? dot4(isum[c], magnitude, x) : dot4_maddubs(isum[c], magnitude, x);
        }
      }
    } else {
      __m256i pairs[C];  // (int16 pairs; with VNNI, int32 sums)
      for (int c = 0; c < C; ++c) pairs[c] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * j));
        const __m256i low = _mm256_and_si256(packed, mask), high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
        for (int c = 0; c < C; ++c) {
          const int8_t* x = q[c] + b * kBlock;
          if constexpr (vnni) {
            pairs[c] = dot4(dot4(pairs[c], low, four(x + 4 * j)), high, four(x + 16 + 4 * j));
          } else {
            pairs[c] = _mm256_add_epi16(pairs[c], _mm256_maddubs_epi16(low, four(x + 4 * j)));
            pairs[c] = _mm256_add_epi16(pairs[c], _mm256_maddubs_epi16(high, four(x + 16 + 4 * j)));
          }
        }
      }
      for (int c = 0; c < C; ++c) isum[c] = vnni ? pairs[c] : _mm256_madd_epi16(pairs[c], ones);
    }
    const __m256 c_w = kType == kQ4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 16)))
                                      : _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));  // (Q8_0: unused)
    for (int c = 0; c < C; ++c) {
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[c]), _mm256_mul_ps(dw, _mm256_set1_ps(d[c][b])), acc[c]);
      if constexpr (kType != kQ8_0) off[c] = _mm256_fmadd_ps(c_w, _mm256_set1_ps(s[c][b]), off[c]);
    }
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(out[c], _mm256_add_ps(acc[c], off[c]));
#else
  for (int c = 0; c < C; ++c) {
    float acc[kGroup] = {}, off[kGroup] = {};
    const uint8_t* block = g;
    for (int64_t b = 0; b < blocks; ++b, block += kStride) {
      const uint8_t* quants = block + 16 * kHalves;
      const int8_t* x = q[c] + b * kBlock;
      for (int64_t r = 0; r < kGroup; ++r) {
        const float dw = half_at(block + 2 * r);
        int32_t isum = 0;
        for (int64_t k = 0; k < kQuants / 4; ++k)
          for (int64_t i = 0; i < 4; ++i) {
            const uint8_t byte = quants[32 * k + 4 * r + i];
            if (kType == kQ8_0)
              isum += static_cast<int8_t>(byte) * x[4 * k + i];
            else
              isum += (byte & 0x0F) * x[4 * k + i] + (byte >> 4) * x[16 + 4 * k + i];
          }
        acc[r] = std::fma(static_cast<float>(isum), dw * d[c][b], acc[r]);
        if (kType == kQ4_1) off[r] = std::fma(half_at(block + 16 + 2 * r), s[c][b], off[r]);
        if (kType == kQ4_0) off[r] = std::fma(dw * -8.0f, s[c][b], off[r]);
      }
    }
    for (int64_t r = 0; r < kGroup; ++r) out[c][r] = acc[r] + off[r];
  }
#endif
}

// Note [K-quants interleaved by eight]
// Rationale: a Q4_K_M file (what most users download) holds Q4_K and Q6_K super-blocks of 256
// weights. Unpacked to fp32 in L1 and multiplied in fp32, a 1B model decoded at 7% of the memory
// bandwidth (vs_llamacpp_1b_q4_k_m.json): bound by the unpacking, not by the bytes.
// Approach: the same as Note [GGUF rows interleaved by eight], a super-block at a time: at load,
// eight rows' super-blocks are rearranged so that one 32-byte load holds four quants of each row,
// and x, rounded to int8 blocks of 32 (XBlocks), meets them in integer sums (maddubs + madd); a
// Q4_K group of 32 then scales as a Q4_1 block with fp32 d = d_s * scale_g and c = -dmin * min_g
// (both exact), a Q6_K block of 32 as two groups of 16 whose integer sums combine in integers.
// Q4_K's 6-bit scales and mins are unpacked to bytes at load (32 bytes more per eight rows and
// super-block, 2.8%); Q6_K's bytes keep their 6 bits (the same size as the file). Both are
// reversible (GgufWeight.plain), so the file's definition is what the tests compare against.
// Implementation: per super-block of eight rows r (fp16 halves side by side, then bytes):
//   Q4_K (1184 = 8 x 148)  d[8] | dmin[8] | scale[g = 0..7][r] | min[g][r] |
//                          for j = 0..3, k = 0..7, r: the file's q[32 j + 4 k .. +3] of row r
//                          (low nibbles: group 2 j's weights 4 k .. 4 k + 3; high: group 2 j + 1's)
//   Q6_K (1680 = 8 x 210)  d[8] | scale[g = 0..15][r] (int8) |
//                          for j = 0..3, k = 0..7, r: 4 bytes of low 4 bits (block 2 j in the low
//                          nibble, 2 j + 1 in the high one) | for i = 0..1, k = 0..7, r: 4 bytes
//                          of high 2 bits (block 4 i + b at bits 2 b)
// q is a Q6_K quant's 6 bits (w = d scale (q - 32)). Per block of 32 and row:
//   Q4_K  acc = fma(sum(q x), d scale_g * d_x, acc); off = fma(-(dmin min_g), s_x, off)
//   Q6_K  t = scale_lo (sum_lo(q x) - 32 h_lo) + scale_hi (sum_hi(q x) - 32 h_hi), exact in int32
//         (|t| <= 2 x 128 x 16 x 32 x 127 < 2^24, so exact in fp32 too); acc = fma(t, d * d_x, acc)
// and the row's output acc + off, the same operations on the AVX2 and scalar paths and for any
// number of rows of x, as for the 32-weight types.
// With VNNI (dot4) and several rows of x (a prompt, a batch), each step's products go straight into
// int32 sums (Q6_K's in two chains a sum: a chain of dpbusd waits on its latency); one row of x (a
// decode step, bound by memory) keeps maddubs, the same integers.
// Limitations: N a multiple of 8 (else the rows stay as the file has them, unpacked in fp32);
// Q2_K, Q3_K and Q5_K are dequantized by the loader.
constexpr int64_t kQ4KGroup = 1184, kQ6KGroup = 1680;  // bytes of eight rows' super-block

// Bytes of eight rows' block (32 weights) or super-block (256), interleaved.
int64_t group_bytes(int64_t type) {
  return type == kQ4_K ? kQ4KGroup : type == kQ6_K ? kQ6KGroup : kGroup * block_bytes(type);
}

// Quant i of block `block` (of 8) of row `lane` in eight rows' super-block g (the note's layout):
// Q4_K's 4 bits, or Q6_K's 6 (w = d scale (q - 32)).
VKV_INLINE int32_t k_quant(const uint8_t* g, int64_t type, int64_t block, int64_t i, int64_t lane) {
  const int64_t at = 256 * (block / 2) + 32 * (i / 4) + 4 * lane + i % 4;  // (pair of blocks, step k, row, byte)
  if (type == kQ4_K) return block % 2 ? g[160 + at] >> 4 : g[160 + at] & 0x0F;
  const uint8_t bits = g[1168 + 256 * (block / 4) + 32 * (i / 4) + 4 * lane + i % 4];
  return (block % 2 ? g[144 + at] >> 4 : g[144 + at] & 0x0F) | (((bits >> (2 * (block % 4))) & 3) << 4);
}

// The eight rows' sums of super-blocks (Note [K-quants interleaved by eight]) against C rows of x
// from row m of xq: out[c][r].
template <int64_t kType, int C>
void group_k(const uint8_t* g, int64_t supers, const XBlocks& xq, int64_t m, int64_t K, float out[][kGroup]) {
  constexpr int64_t kStride = kType == kQ4_K ? kQ4KGroup : kQ6KGroup;
  const XRows<C> rows(xq, m, K);
  auto &q = rows.q, &d = rows.d, &s = rows.s;
  auto& h = rows.h;
#if defined(__AVX2__) && defined(__FMA__)
  constexpr bool vnni = kVnni && C > 1;  // (one row of x, a decode step bound by memory: maddubs)
  const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  __m256 acc[C], off[C];
  for (int c = 0; c < C; ++c) acc[c] = off[c] = _mm256_setzero_ps();
  auto bytes8 = [](const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); };
  for (int64_t sb = 0; sb < supers; ++sb, g += kStride) {
    const __m256 dw = group_scales(g, kStride);
    const int64_t b0 = sb * (kSuper / kBlock);  // x's first block here
    if constexpr (kType == kQ4_K) {
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 16)));
      for (int j = 0; j < 4; ++j) {
        __m256i low_pairs[C], high_pairs[C];  // (with VNNI, int32 sums)
        for (int c = 0; c < C; ++c) low_pairs[c] = high_pairs[c] = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 160 + 256 * j + 32 * k));
          const __m256i low = _mm256_and_si256(packed, mask), high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
          for (int c = 0; c < C; ++c) {
            const int8_t* x = q[c] + (b0 + 2 * j) * kBlock + 4 * k;
            if constexpr (vnni) {
              low_pairs[c] = dot4(low_pairs[c], low, four(x));
              high_pairs[c] = dot4(high_pairs[c], high, four(x + kBlock));
            } else {
              low_pairs[c] = _mm256_add_epi16(low_pairs[c], _mm256_maddubs_epi16(low, four(x)));
              high_pairs[c] = _mm256_add_epi16(high_pairs[c], _mm256_maddubs_epi16(high, four(x + kBlock)));
            }
          }
        }
        #pragma GCC unroll 8
        for (int half = 0; half < 2; ++half) {
          const int64_t group = 2 * j + half, b = b0 + group;
          const __m256 scale = _mm256_mul_ps(dw, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(g + 32 + 8 * group))));
          const __m256 low_c = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(g + 96 + 8 * group))));
          for (int c = 0; c < C; ++c) {
            const __m256i pairs = half ? high_pairs[c] : low_pairs[c];
            const __m256i isum = vnni ? pairs : _mm256_madd_epi16(pairs, ones);
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(scale, _mm256_set1_ps(d[c][b])), acc[c]);
            off[c] = _mm256_fnmadd_ps(low_c, _mm256_set1_ps(s[c][b]), off[c]);
          }
        }
      }
    } else {
      #pragma GCC unroll 8
      for (int j = 0; j < 4; ++j) {  // blocks 2 j (low nibbles) and 2 j + 1 (high)
        __m256i sums[2][2][C];  // [block][half of 16][row of x]
        #pragma GCC unroll 8
        for (int half = 0; half < 2; ++half) {
          __m256i pairs[2][C];
          for (int c = 0; c < C; ++c) sums[0][half][c] = sums[1][half][c] = _mm256_setzero_si256();
          #pragma GCC unroll 8
          for (int k = 4 * half; k < 4 * half + 4; ++k) {
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 144 + 256 * j + 32 * k));
            const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 1168 + 256 * (j / 2) + 32 * k));
            // the two high bits of blocks 2 j and 2 j + 1 at bits 4-5 of each byte
            const __m256i hi_a = j % 2 ? bits : _mm256_slli_epi16(bits, 4);
            const __m256i hi_b = j % 2 ? _mm256_srli_epi16(bits, 2) : _mm256_slli_epi16(bits, 2);
            const __m256i qa = _mm256_or_si256(_mm256_and_si256(packed, mask), _mm256_and_si256(hi_a, top));
            const __m256i qb = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), mask),
                                               _mm256_and_si256(hi_b, top));
            for (int c = 0; c < C; ++c) {  // (two steps of pairs at most 2 x 2 x 63 x 127 fit int16)
              const int8_t* x = q[c] + (b0 + 2 * j) * kBlock + 4 * k;
              if constexpr (vnni) {  // (odd k's in pairs: two chains a sum)
                if (k % 2 == 0) {
                  pairs[0][c] = dot4(_mm256_setzero_si256(), qa, four(x));
                  pairs[1][c] = dot4(_mm256_setzero_si256(), qb, four(x + kBlock));
                } else {
                  sums[0][half][c] = _mm256_add_epi32(sums[0][half][c], dot4(pairs[0][c], qa, four(x)));
                  sums[1][half][c] = _mm256_add_epi32(sums[1][half][c], dot4(pairs[1][c], qb, four(x + kBlock)));
                }
                continue;
              }
              const __m256i pa = _mm256_maddubs_epi16(qa, four(x)), pb = _mm256_maddubs_epi16(qb, four(x + kBlock));
              if (k % 2 == 0) {
                pairs[0][c] = pa;
                pairs[1][c] = pb;
              } else {
                sums[0][half][c] = _mm256_add_epi32(sums[0][half][c], _mm256_madd_epi16(_mm256_add_epi16(pairs[0][c], pa), ones));
                sums[1][half][c] = _mm256_add_epi32(sums[1][half][c], _mm256_madd_epi16(_mm256_add_epi16(pairs[1][c], pb), ones));
              }
            }
          }
        }
        #pragma GCC unroll 8
        for (int e = 0; e < 2; ++e) {
          const int64_t block = 2 * j + e, b = b0 + block;
          const __m256i scale_lo = _mm256_cvtepi8_epi32(bytes8(g + 16 + 8 * (2 * block)));
          const __m256i scale_hi = _mm256_cvtepi8_epi32(bytes8(g + 16 + 8 * (2 * block + 1)));
          for (int c = 0; c < C; ++c) {
            const __m256i lo = _mm256_sub_epi32(sums[e][0][c], _mm256_set1_epi32(32 * h[c][2 * b]));
            const __m256i hi = _mm256_sub_epi32(sums[e][1][c], _mm256_set1_epi32(32 * h[c][2 * b + 1]));
            const __m256i t = _mm256_add_epi32(_mm256_mullo_epi32(scale_lo, lo), _mm256_mullo_epi32(scale_hi, hi));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, _mm256_set1_ps(d[c][b])), acc[c]);
          }
        }
      }
    }
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(out[c], _mm256_add_ps(acc[c], off[c]));
#else
  for (int c = 0; c < C; ++c) {
    float acc[kGroup] = {}, off[kGroup] = {};
    const uint8_t* sg = g;
    for (int64_t sb = 0; sb < supers; ++sb, sg += kStride) {
      const int64_t b0 = sb * (kSuper / kBlock);
      for (int64_t r = 0; r < kGroup; ++r) {
        const float dw = half_at(sg + 2 * r);
        for (int64_t block = 0; block < 8; ++block) {
          const int64_t b = b0 + block;
          const int8_t* x = q[c] + b * kBlock;
          int32_t sum[2] = {0, 0};  // the block's halves of 16
          for (int64_t i = 0; i < kBlock; ++i) {
            sum[i / 16] += k_quant(sg, kType, block, i, r) * x[i];
          }
          if (kType == kQ4_K) {
            const float scale = dw * static_cast<float>(sg[32 + 8 * block + r]);
            const float low_c = half_at(sg + 16 + 2 * r) * static_cast<float>(sg[96 + 8 * block + r]);
            acc[r] = std::fma(static_cast<float>(sum[0] + sum[1]), scale * d[c][b], acc[r]);
            off[r] = std::fma(-low_c, s[c][b], off[r]);
          } else {
            const int32_t scale_lo = static_cast<int8_t>(sg[16 + 8 * (2 * block) + r]);
            const int32_t scale_hi = static_cast<int8_t>(sg[16 + 8 * (2 * block + 1) + r]);
            const int32_t t = scale_lo * (sum[0] - 32 * h[c][2 * b]) + scale_hi * (sum[1] - 32 * h[c][2 * b + 1]);
            acc[r] = std::fma(static_cast<float>(t), dw * d[c][b], acc[r]);
          }
        }
      }
    }
    for (int64_t r = 0; r < kGroup; ++r) out[c][r] = acc[r] + off[r];
  }
#endif
}

// Row `lane` of eight rows' super-blocks (the note above) as fp32, in gguf-py's order of operations
// (unpack_super's).
void unpack_group_k(const uint8_t* g, int64_t type, int64_t K, int64_t lane, float* out) {
  const int64_t stride = group_bytes(type);
  for (int64_t sb = 0; sb < K / kSuper; ++sb, g += stride, out += kSuper) {
    const float d = half_at(g + 2 * lane);
    for (int64_t block = 0; block < 8; ++block)
      for (int64_t i = 0; i < kBlock; ++i) {
        const float quant = static_cast<float>(k_quant(g, type, block, i, lane));
        if (type == kQ4_K) {
          const float scale = d * static_cast<float>(g[32 + 8 * block + lane]);
          const float low = half_at(g + 16 + 2 * lane) * static_cast<float>(g[96 + 8 * block + lane]);
          out[block * kBlock + i] = scale * quant - low;
        } else {
          const float scale = d * static_cast<float>(static_cast<int8_t>(g[16 + 8 * (2 * block + i / 16) + lane]));
          out[block * kBlock + i] = scale * (quant - 32.0f);
        }
      }
  }
}

// f(type as a compile-time constant) for any type interleaved by eight.
template <typename F>
VKV_INLINE void with_group_type(int64_t type, F f) {
  if (type == kQ4_K) return f(std::integral_constant<int64_t, kQ4_K>{});
  if (type == kQ6_K) return f(std::integral_constant<int64_t, kQ6_K>{});
  with_block_type(type, f);
}

// The eight rows' sums of one group of any type interleaved by eight against C rows of x.
template <int64_t kType, int C>
VKV_INLINE void group_dots(const uint8_t* g, const XBlocks& xq, int64_t m, int64_t K, float out[][kGroup]) {
  if constexpr (kType == kQ4_K || kType == kQ6_K)
    group_k<kType, C>(g, K / kSuper, xq, m, K, out);
  else
    group_q8<kType, C>(g, K / kBlock, xq, m, K, out);
}

// x W^T over W interleaved by eight (the note above), x rounded to int8 blocks (XBlocks): each task
// a group of eight weight rows against every row of x, up to kTile rows of x at a time (each load
// and unpacking of the weights shared by them).
template <int64_t kType>
void groups_q8(const XBlocks& xq, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias, float* out) {
  const int64_t bytes = K / block_weights(kType) * group_bytes(kType);  // a group of eight rows
  constexpr int64_t kTile = 4;
  at::parallel_for(0, N / kGroup, M == 1 ? 2 : 1, [&](int64_t lo, int64_t hi) {
    float dots[kTile][kGroup];
    for (int64_t g = lo; g < hi; ++g)
      for (int64_t m = 0, C = 0; m < M; m += C) {
        C = M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
        if (C == 4)
          group_dots<kType, 4>(w + g * bytes, xq, m, K, dots);
        else if (C == 2)
          group_dots<kType, 2>(w + g * bytes, xq, m, K, dots);
        else
          group_dots<kType, 1>(w + g * bytes, xq, m, K, dots);
        for (int64_t c = 0; c < C; ++c)
          for (int64_t r = 0; r < kGroup; ++r)
            out[(m + c) * N + g * kGroup + r] = dots[c][r] + (bias ? bias[g * kGroup + r] : 0.0f);
      }
  });
}

// Row `r` of W interleaved by eight, as the file stores it (the note's layout undone for one row).
void deinterleave_row(const uint8_t* w, int64_t type, int64_t K, int64_t r, uint8_t* row) {
  const int64_t bytes = block_bytes(type), halves = type == kQ4_1 ? 2 : 1, quants = bytes - 2 * halves;
  const int64_t blocks = K / kBlock, lane = r % kGroup;
  const uint8_t* g = w + (r / kGroup) * blocks * kGroup * bytes;
  for (int64_t b = 0; b < blocks; ++b, g += kGroup * bytes, row += bytes) {
    for (int64_t h = 0; h < halves; ++h) std::memcpy(row + 2 * h, g + 16 * h + 2 * lane, 2);
    for (int64_t k = 0; k < quants / 4; ++k) std::memcpy(row + 2 * halves + 4 * k, g + 16 * halves + 32 * k + 4 * lane, 4);
  }
}

// Row r of W (rows one after another, or interleaved by eight), K weights, as fp32 into out.
void gguf_row(const uint8_t* w, int64_t type, bool by_eight, int64_t K, int64_t r, float* out) {
  const int64_t row_bytes = K / block_weights(type) * block_bytes(type);
  if (!by_eight) return unpack_row(w + r * row_bytes, type, K, out);
  if (block_weights(type) == kSuper)
    return unpack_group_k(w + (r / kGroup) * (K / kSuper) * group_bytes(type), type, K, r % kGroup, out);
  std::vector<uint8_t> row(row_bytes);
  deinterleave_row(w, type, K, r, row.data());
  unpack_row(row.data(), type, K, out);
}

// x W^T with x's rows quantized to int8 (XBlocks) and summed in integers, as llama.cpp's CPU
// backend computes with Q8_0 / Q4_0 / Q4_1 weights: each row of out depends on its own row of x
// alone, whatever the number of rows.
void linear_q8(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t type,
               const float* bias, float* out) {
  XBlocks xq;
  quantize_rows(x, M, K, xq);
  with_block_type(type, [&](auto k) { rows_dot_q8<k>(xq, M, K, w, row_bytes, N, bias, out); });
}

void check_gguf(const at::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "a GGUF weight is [rows, bytes] uint8");
  const int64_t per = block_weights(type);
  TORCH_CHECK(K > 0 && K % per == 0 && w.size(1) == K / per * block_bytes(type), "a GGUF weight's rows hold K / ",
              per, " blocks of its type (K = ", K, ", ", w.size(1), " bytes a row)");
}

// W interleaved by eight (Note [GGUF rows interleaved by eight], [K-quants interleaved by eight]):
// [N / 8, K / block weights, group bytes].
bool interleaved(const at::Tensor& w) { return w.dim() == 3; }

void check_interleaved(const at::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) * block_weights(type) == K &&
                  w.size(2) == group_bytes(type),
              "a GGUF weight interleaved by eight is [N / 8, K / block weights, eight rows' block bytes] uint8 (K = ",
              K, ", type ", type, ")");
}

void linear_gguf(const at::Tensor& x, const at::Tensor& w, int64_t type, const std::optional<at::Tensor>& bias,
                 at::Tensor out, bool quantize_x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x is [rows, K] fp32");
  const int64_t M = x.size(0), K = x.size(1), N = interleaved(w) ? w.size(0) * kGroup : w.size(0);
  if (interleaved(w)) {
    check_interleaved(w, type, K);
  } else {
    check_gguf(w, type, K);
  }
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.scalar_type() == at::kFloat &&
                  out.is_contiguous(), "out is [rows, N] fp32");
  TORCH_CHECK(!bias || (bias->numel() == N && bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              "bias is [N] fp32");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  if (interleaved(w) && quantize_x) {
    XBlocks xq;
    quantize_rows(xp, M, K, xq);
    return with_group_type(type, [&](auto k) { groups_q8<k>(xq, M, K, wp, N, bp, op); });
  }
  if (quantize_x) {
    TORCH_CHECK(block_weights(type) == kBlock, "x is quantized to int8 for Q8_0, Q4_0 and Q4_1 weights, or any "
                                               "type's rows interleaved by eight");
    return linear_q8(xp, M, K, wp, row_bytes, N, type, bp, op);
  }
#if defined(__AVX2__) && defined(__FMA__)
  if (M == 1 && !interleaved(w) && block_weights(type) == kBlock)  // decode: blocks unpacked in registers (row_dot)
    return with_block_type(type, [&](auto k) { rows_dot<k>(wp, row_bytes, N, K, xp, bp, op); });
#endif
  constexpr int64_t kRows = 4;
  at::parallel_for(0, (N + kRows - 1) / kRows, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> rows(kRows * K);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * kRows, count = std::min(kRows, N - n0);
      for (int64_t r = 0; r < count; ++r) gguf_row(wp, type, interleaved(w), K, n0 + r, rows.data() + r * K);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < count; ++r)
          op[m * N + n0 + r] = dot(xp + m * K, rows.data() + r * K, K) + (bp ? bp[n0 + r] : 0.0f);
    }
  });
}

// GGUF blocks as decode_layers takes them: a [N, K / 32, block bytes] uint8 view of Q8_0, Q4_0 or
// Q4_1, or any of the five types' rows interleaved by eight ([N / 8, K / block weights, group
// bytes]); the last size names the type. (Q4_K's rows as the file has them, 144 bytes a
// super-block, would read as Q4_0 interleaved: GgufWeight.step_view never gives them.)
int64_t blocks_type(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte, "GGUF blocks in a step: [N, K / 32, block bytes] uint8");
  for (const int64_t type : {kQ8_0, kQ4_0, kQ4_1, kQ4_K, kQ6_K})
    if ((block_weights(type) == kBlock && w.size(2) == block_bytes(type)) || w.size(2) == group_bytes(type)) return type;
  TORCH_CHECK(false, "GGUF blocks in a step: [N, K / 32, block bytes] of Q8_0, Q4_0 or Q4_1, or rows of those, Q4_K "
                     "or Q6_K interleaved by eight");
  return 0;
}

bool blocks_interleaved(const at::Tensor& w) { return w.size(2) == group_bytes(blocks_type(w)); }

int64_t blocks_rows(const at::Tensor& w) { return blocks_interleaved(w) ? w.size(0) * kGroup : w.size(0); }

int64_t blocks_inputs(const at::Tensor& w) { return w.size(1) * block_weights(blocks_type(w)); }

// x W^T over such a view, as Linear serves blocks (int8 x).
void linear_blocks(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor out) {
  const int64_t type = blocks_type(w);
  linear_gguf(x, blocks_interleaved(w) ? w : w.view({w.size(0), -1}), type, bias, out, true);
}

BlocksRef blocks_ref(const at::Tensor& w) {
  const int64_t type = blocks_type(w), K = w.size(1) * block_weights(type);
  const bool by_eight = blocks_interleaved(w);
  const int64_t unit = by_eight ? kGroup : 4, unit_bytes = by_eight ? w.size(1) * w.size(2) : 4 * w.size(1) * w.size(2);
  TORCH_CHECK(w.is_contiguous(), "GGUF blocks in a step are contiguous");
  return {w.data_ptr<uint8_t>(), type, blocks_rows(w), K, unit, unit_bytes, by_eight};
}

// Units [lo, hi) of W (each group_dots' or rows4_q8's rows) against one row of x, as groups_q8 and
// rows_dot_q8 compute them for a row of x alone.
void blocks_range(const float* x, const BlocksRef& b, const float* bias, float* out, int64_t lo, int64_t hi) {
  thread_local XBlocks xq;  // (this thread's copy of x in int8 blocks: quantize_rows runs inline here)
  quantize_rows(x, 1, b.K, xq);
  for (int64_t u = lo; u < hi; ++u) {
    const int64_t n = u * b.unit, count = std::min(b.unit, b.N - n);
    float dots[kGroup];
    if (b.by_eight) {
      float group[1][kGroup];
      with_group_type(b.type, [&](auto k) { group_dots<k, 1>(b.w + u * b.unit_bytes, xq, 0, b.K, group); });
      std::copy(group[0], group[0] + kGroup, dots);
    } else {
      const uint8_t* rows[4];
      four_rows(b.w, n, count, b.unit_bytes / b.unit, rows);
      with_block_type(b.type, [&](auto k) { rows4_q8<k>(rows, b.K, xq.q.data(), xq.d.data(), xq.s.data(), dots); });
    }
    for (int64_t r = 0; r < count; ++r) out[n + r] = dots[r] + (bias ? bias[n + r] : 0.0f);
  }
}

// Row r of such a view, as fp32 (a blocks embedding's row, as dequantize_gguf's lookup gives it).
void blocks_row(const at::Tensor& w, int64_t r, float* out) {
  const int64_t type = blocks_type(w);
  TORCH_CHECK(r >= 0 && r < blocks_rows(w), "row ", r, " of ", blocks_rows(w));
  gguf_row(w.data_ptr<uint8_t>(), type, blocks_interleaved(w), w.size(1) * block_weights(type), r, out);
}

void dequantize_gguf(const at::Tensor& w, int64_t type, const at::Tensor& rows, at::Tensor out) {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows are int64 indices");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows.size(0) && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out is [len(rows), K] fp32");
  const int64_t K = out.size(1), N = interleaved(w) ? w.size(0) * kGroup : w.size(0);
  if (interleaved(w))
    check_interleaved(w, type, K);
  else
    check_gguf(w, type, K);
  const int64_t* index = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) TORCH_CHECK(index[i] >= 0 && index[i] < N, "row ", index[i], " of ", N);
  at::parallel_for(0, rows.size(0), 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      gguf_row(w.data_ptr<uint8_t>(), type, interleaved(w), K, index[i], out.data_ptr<float>() + i * K);
  });
}

}  // namespace vkv
