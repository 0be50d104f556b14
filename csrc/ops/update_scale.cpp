// fusetrain::update_scale_ — the dynamic loss-scale update, on the device:
// back off on a non-finite step, grow after growth_interval clean steps.
// Semantics of torch.amp.GradScaler.update (torch._amp_update_scale_).
#include <torch/library.h>
#include <cmath>

#include "../common/op_kernels.h"

namespace fusetrain {
namespace detail {

void update_scale_impl(UpdateScaleKernel kernel, const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                       int64_t growth_interval, const OptT& last_skipped, const OptT& skipped_steps) {
  const char* op = "update_scale_";
  TORCH_CHECK(scale.numel() == 1 && scale.scalar_type() == at::kFloat, op,
              ": scale must be a float32 tensor with one element, got ", scale.scalar_type(), " of shape ",
              scale.sizes());
  TORCH_CHECK(growth_tracker.numel() == 1 && growth_tracker.scalar_type() == at::kInt, op,
              ": growth_tracker must be an int32 tensor with one element, got ", growth_tracker.scalar_type(),
              " of shape ", growth_tracker.sizes());
  TORCH_CHECK(found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat, op,
              ": found_inf must be a float32 tensor with one element, got ", found_inf.scalar_type(), " of shape ",
              found_inf.sizes());
  TORCH_CHECK(growth_tracker.device() == scale.device() && found_inf.device() == scale.device(), op,
              ": scale (", scale.device(), "), growth_tracker (", growth_tracker.device(), ") and found_inf (",
              found_inf.device(), ") must be on one device");
  TORCH_CHECK_VALUE(growth_factor > 1.0 && std::isfinite(growth_factor), op,
                    ": growth_factor must be a finite number > 1, got ", growth_factor);
  TORCH_CHECK_VALUE(backoff_factor > 0.0 && backoff_factor < 1.0, op, ": backoff_factor must be in (0, 1), got ",
                    backoff_factor);
  TORCH_CHECK_VALUE(growth_interval > 0, op, ": growth_interval must be > 0, got ", growth_interval);
  // The skip counters a logger reads: the flag of this update and a running count.
  for (const auto* t : {&last_skipped, &skipped_steps}) {
    if (!t->has_value()) continue;
    TORCH_CHECK((*t)->numel() == 1 && (*t)->scalar_type() == at::kFloat && (*t)->device() == scale.device(), op,
                ": ", t == &last_skipped ? "last_skipped" : "skipped_steps",
                " must be a float32 tensor with one element on ", scale.device());
  }
  if (last_skipped.has_value()) last_skipped->copy_(found_inf);
  if (skipped_steps.has_value()) skipped_steps->add_(found_inf);
  kernel(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval);
}

}  // namespace detail
}  // namespace fusetrain

TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor found_inf, float growth_factor, "
      "float backoff_factor, int growth_interval, Tensor(c!)? last_skipped=None, "
      "Tensor(d!)? skipped_steps=None) -> ()");
}
