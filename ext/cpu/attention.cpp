// torch.ops.vkv.attention: one call per layer for the whole batch (attention.h).
#include "attention.h"
#include "ops.h"

namespace vkv {


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

}  // namespace vkv
