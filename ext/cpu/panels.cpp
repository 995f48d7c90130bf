// torch.ops.vkv.linear_panels, panel_width and ahead_hint (panels.h).
#include "ops.h"
#include "panels.h"

namespace vkv {

void linear_panels(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias, at::Tensor out) {
  linear_panels_then(x, panels, bias, out);
}

int64_t panel_width() { return kPanel; }

std::string ahead_hint() { return ahead_hint_text(); }

}  // namespace vkv
