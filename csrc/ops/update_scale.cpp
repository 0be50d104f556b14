// fusetrain::update_scale_ — the dynamic loss-scale update, on the device:
// back off on a non-finite step, grow after growth_interval clean steps.
// Semantics of torch.amp.GradScaler.update (torch._amp_update_scale_).
#include <torch/library.h>

#include "../common/update_args.h"

namespace fusetrain {
namespace detail {
namespace {

void update_scale_impl(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval) {
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
  TORCH_CHECK(growth_factor > 1.0, op, ": growth_factor must be > 1, got ", growth_factor);
  TORCH_CHECK(backoff_factor > 0.0 && backoff_factor < 1.0, op, ": backoff_factor must be in (0, 1), got ",
              backoff_factor);
  TORCH_CHECK(growth_interval > 0, op, ": growth_interval must be > 0, got ", growth_interval);
  if (scale.device().is_cpu()) {
    update_scale_cpu(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval);
  } else {
#ifdef FUSETRAIN_WITH_CUDA
    TORCH_CHECK(scale.device().is_cuda(), op, ": tensors must be on CPU or CUDA, got ", scale.device());
    update_scale_cuda(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval);
#else
    TORCH_CHECK(false, op, ": tensors are on ", scale.device(), " but fusetrain was built without CUDA");
#endif
  }
}

}  // namespace
}  // namespace detail
}  // namespace fusetrain

TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor found_inf, float growth_factor, "
      "float backoff_factor, int growth_interval) -> ()");
}

TORCH_LIBRARY_IMPL(fusetrain, CPU, m) { m.impl("update_scale_", &fusetrain::detail::update_scale_impl); }
#ifdef FUSETRAIN_WITH_CUDA
TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) { m.impl("update_scale_", &fusetrain::detail::update_scale_impl); }
#endif
