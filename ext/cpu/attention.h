// Attention over K/V rows read where they lie (a block table; a virtual slot is one block as long
// as the slot): one work item's online softmax (`attend_item`), the batch's split into items, the
// dtype dispatch and the checks. The op is attention.cpp's; decode_step.cpp runs items directly.
#pragma once
#include "common.h"

namespace vkv {

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
}  // namespace vkv
