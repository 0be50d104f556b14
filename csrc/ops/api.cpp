// The public C++ API of csrc/include/fusetrain/ops.h: typed calls into the
// dispatcher, so C++ callers get the same kernels and checks as Python.
#include <ATen/core/dispatch/Dispatcher.h>

#include "fusetrain/ops.h"

#include "../common/op_kernels.h"

namespace fusetrain {
namespace {

// The handle's C++ type is the implementation's signature without its kernel
// argument (detail::OpSignature), so no signature is spelled twice.
template <auto Impl>
c10::TypedOperatorHandle<detail::OpSignature<Impl>> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<detail::OpSignature<Impl>>();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> grad_stats(at::TensorList grads, const std::optional<at::Tensor>& inv_scale) {
  static auto op = op_handle<&detail::grad_stats_impl>("fusetrain::grad_stats");
  return op.call(grads, inv_scale);
}

void ema_update_(at::TensorList ema, at::TensorList src, const at::Tensor& decay,
                 const std::optional<at::Tensor>& found_inf, const std::optional<at::TensorList>& remainders) {
  static auto op = op_handle<&detail::ema_update_impl>("fusetrain::ema_update_");
  op.call(ema, src, decay, found_inf, remainders);
}

void gated_copy_(at::TensorList dst, at::TensorList src, const at::Tensor& found_inf) {
  static auto op = op_handle<&detail::gated_copy_impl>("fusetrain::gated_copy_");
  op.call(dst, src, found_inf);
}

void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                   double growth_factor, double backoff_factor, int64_t growth_interval,
                   const std::optional<at::Tensor>& last_skipped, const std::optional<at::Tensor>& skipped_steps) {
  static auto op = op_handle<&detail::update_scale_impl>("fusetrain::update_scale_");
  op.call(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, last_skipped,
          skipped_steps);
}

// Composite ops (no kernel argument): the handle's type is the public function's.
void fused_step_(c10::string_view optimizer, at::TensorList params, at::TensorList grads, at::TensorList state_steps,
                 at::TensorList state1, at::TensorList state2, at::TensorList state3, at::TensorList master_params,
                 at::TensorList ema_params, at::IntArrayRef group_sizes, at::TensorList lrs,
                 at::ArrayRef<double> hyper, const std::optional<at::Tensor>& inv_scale,
                 const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& ema_decay,
                 const std::optional<at::Tensor>& grad_norm_out, const std::optional<at::Tensor>& found_inf_out,
                 const std::optional<at::Tensor>& grad_norm,
                 const std::optional<at::TensorList>& group_values,
                 const std::optional<at::TensorList>& state_scales,
                 const std::optional<at::TensorList>& ema_remainders,
                 const std::optional<at::Tensor>& stalled_out) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fusetrain::fused_step_", "").typed<decltype(fused_step_)>();
  op.call(optimizer, params, grads, state_steps, state1, state2, state3, master_params, ema_params, group_sizes, lrs,
          hyper, inv_scale, found_inf, ema_decay, grad_norm_out, found_inf_out, grad_norm, group_values,
          state_scales, ema_remainders, stalled_out);
}

void ema_decay_(const at::Tensor& decay_out, const at::Tensor& step, const std::optional<at::Tensor>& total_steps,
                c10::string_view decay_type, double decay, double beta, bool warmup, double warmup_gamma,
                double warmup_power) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fusetrain::ema_decay_", "").typed<decltype(ema_decay_)>();
  op.call(decay_out, step, total_steps, decay_type, decay, beta, warmup, warmup_gamma, warmup_power);
}

void ema_step_(at::TensorList ema, at::TensorList src, at::TensorList copy_dst, at::TensorList copy_src,
               const at::Tensor& decay, const at::Tensor& step, const std::optional<at::Tensor>& found_inf,
               const std::optional<at::TensorList>& remainders) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fusetrain::ema_step_", "").typed<decltype(ema_step_)>();
  op.call(ema, src, copy_dst, copy_src, decay, step, found_inf, remainders);
}

}  // namespace fusetrain
