// Rotary embedding of q and k, and k, v stored at their positions in the caches (`RopeRows`).
#pragma once
#include "common.h"

namespace vkv {

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
}  // namespace vkv
