// The ops each family's file defines, for the registration (ops.cpp) and for decode_step.cpp,
// which calls several of them.
#pragma once
#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace vkv {

std::string isa();
void attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& block_table, int64_t block_size, const at::Tensor& q_start, const at::Tensor& q_len,
               const at::Tensor& ctx_len, double scale, at::Tensor out);
void rope_store(at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& positions,
                const at::Tensor& cos_sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& block_table,
                int64_t block_size, const at::Tensor& token_seq);
void add_rms_norm(at::Tensor x, std::optional<at::Tensor> residual, const at::Tensor& weight, double eps);
void silu_and_mul(const at::Tensor& gate_up, at::Tensor out);
void linear_panels(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias, at::Tensor out);
int64_t panel_width();
bool bf16_dot();
void write_panels(at::Tensor panels, const at::Tensor& w, int64_t row);
void linear_gguf(const at::Tensor& x, const at::Tensor& w, int64_t type, const std::optional<at::Tensor>& bias,
                 at::Tensor out, bool quantize_x);
void dequantize_gguf(const at::Tensor& w, int64_t type, const at::Tensor& rows, at::Tensor out);
void linear_blocks(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor out);
void blocks_row(const at::Tensor& w, int64_t r, float* out);
int64_t blocks_rows(const at::Tensor& w);    // (N of a blocks view, interleaved by eight or not)
int64_t blocks_inputs(const at::Tensor& w);  // (its K)
// A blocks view's pieces for decode_step.cpp's one parallel region: a share of its rows on the
// calling thread, counted in units (groups of eight rows interleaved, else four rows), x rounded
// to int8 blocks on that thread; the bits linear_blocks gives them.
struct BlocksRef {
  const uint8_t* w;
  int64_t type, N, K, unit, unit_bytes;  // unit: rows a unit holds
  bool by_eight;
};
BlocksRef blocks_ref(const at::Tensor& w);
inline int64_t blocks_units(const BlocksRef& b) { return (b.N + b.unit - 1) / b.unit; }
void blocks_range(const float* x, const BlocksRef& b, const float* bias, float* out, int64_t lo, int64_t hi);
std::string ahead_hint();
void decode_layers(at::Tensor x, at::Tensor residual, at::TensorList input_norms, at::TensorList post_norms,
                   double eps, at::TensorList qkv_weights, const c10::List<std::optional<at::Tensor>>& qkv_tails,
                   const c10::List<std::optional<at::Tensor>>& qkv_biases,
                   at::TensorList o_weights, at::TensorList gate_up_weights, at::TensorList down_weights,
                   int64_t num_heads, int64_t num_kv_heads, const at::Tensor& positions, const at::Tensor& cos_sin,
                   at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& block_table,
                   int64_t block_size, const at::Tensor& token_seq, const at::Tensor& q_start, const at::Tensor& q_len,
                   const at::Tensor& ctx_len, double scale, const std::optional<at::Tensor>& rows,
                   const std::optional<at::Tensor>& final_norm, const std::optional<at::Tensor>& lm_head, bool bf16,
                   std::optional<at::Tensor> logits, const std::optional<at::Tensor>& embed,
                   std::optional<at::Tensor> tokens, const std::optional<at::Tensor>& stop_ids,
                   const std::optional<at::Tensor>& pick, const std::optional<at::Tensor>& pick_bounds,
                   const std::optional<at::Tensor>& pick_scales);
void last_logits(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& rows, const at::Tensor& norm,
                 double eps, const at::Tensor& panels, bool bf16, at::Tensor out);
void time_decode_stages(bool on);
c10::Dict<std::string, double> decode_stage_times(bool reset);
void row_max(const at::Tensor& x, at::Tensor values, at::Tensor indices);
void greedy_pick(const at::Tensor& h, const at::Tensor& panels, const at::Tensor& pick, const at::Tensor& bounds,
                 const std::optional<at::Tensor>& scales, bool bf16, at::Tensor logits, at::Tensor best,
                 at::Tensor picked);
void lora_segments(const at::Tensor& x, at::Tensor out, at::TensorList a, at::TensorList b, at::IntArrayRef bounds);

}  // namespace vkv
