// torch.ops.vkv.rope_store (rope.h).
#include "attention.h"
#include "ops.h"
#include "rope.h"

namespace vkv {


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

}  // namespace vkv
