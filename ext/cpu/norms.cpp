// torch.ops.vkv.add_rms_norm and silu_and_mul (norms.h).
#include "norms.h"
#include "ops.h"

namespace vkv {


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

}  // namespace vkv
