// The public C++ API of csrc/include/fusetrain/ops.h: typed calls into the
// dispatcher, so C++ callers get the same kernels and checks as Python.
#include <ATen/core/dispatch/Dispatcher.h>

#include "fusetrain/ops.h"

#include "../common/update_args.h"

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

void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList max_exp_avg_sqs, at::TensorList state_steps, at::TensorList master_params,
                 at::TensorList ema_params, const at::Tensor& lr, double beta1, double beta2, double weight_decay,
                 double eps, bool amsgrad, bool maximize, bool decoupled_weight_decay, const FusedTail& tail,
                 bool bias_correction) {
  static auto op = op_handle<&detail::fused_adam_impl>("fusetrain::fused_adam_");
  op.call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params, ema_params, lr, beta1,
          beta2, weight_decay, eps, amsgrad, maximize, decoupled_weight_decay, tail.inv_scale, tail.found_inf,
          tail.grad_norm, tail.max_grad_norm, tail.ema_decay, bias_correction);
}

void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                at::TensorList state_steps, at::TensorList master_params, at::TensorList ema_params,
                const at::Tensor& lr, double momentum, double dampening, double weight_decay, bool nesterov,
                bool maximize, const FusedTail& tail) {
  static auto op = op_handle<&detail::fused_sgd_impl>("fusetrain::fused_sgd_");
  op.call(params, grads, momentum_buffers, state_steps, master_params, ema_params, lr, momentum, dampening,
          weight_decay, nesterov, maximize, tail.inv_scale, tail.found_inf, tail.grad_norm, tail.max_grad_norm,
          tail.ema_decay);
}

void fused_lion_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList state_steps,
                 at::TensorList master_params, at::TensorList ema_params, const at::Tensor& lr, double beta1,
                 double beta2, double weight_decay, bool maximize, const FusedTail& tail) {
  static auto op = op_handle<&detail::fused_lion_impl>("fusetrain::fused_lion_");
  op.call(params, grads, exp_avgs, state_steps, master_params, ema_params, lr, beta1, beta2, weight_decay, maximize,
          tail.inv_scale, tail.found_inf, tail.grad_norm, tail.max_grad_norm, tail.ema_decay);
}

void fused_rmsprop_(at::TensorList params, at::TensorList grads, at::TensorList square_avgs,
                    at::TensorList momentum_buffers, at::TensorList grad_avgs, at::TensorList state_steps,
                    at::TensorList master_params, at::TensorList ema_params, const at::Tensor& lr, double alpha,
                    double eps, double weight_decay, double momentum, bool centered, bool maximize,
                    const FusedTail& tail, const RMSpropTFForm& tf) {
  static auto op = op_handle<&detail::fused_rmsprop_impl>("fusetrain::fused_rmsprop_");
  op.call(params, grads, square_avgs, momentum_buffers, grad_avgs, state_steps, master_params, ema_params, lr, alpha,
          eps, weight_decay, momentum, centered, maximize, tail.inv_scale, tail.found_inf, tail.grad_norm,
          tail.max_grad_norm, tail.ema_decay, tf.enabled, tf.lr_in_momentum, tf.decoupled_weight_decay);
}

void fused_adadelta_(at::TensorList params, at::TensorList grads, at::TensorList square_avgs,
                     at::TensorList acc_deltas, at::TensorList state_steps, at::TensorList master_params,
                     at::TensorList ema_params, const at::Tensor& lr, double rho, double eps, double weight_decay,
                     bool maximize, const FusedTail& tail) {
  static auto op = op_handle<&detail::fused_adadelta_impl>("fusetrain::fused_adadelta_");
  op.call(params, grads, square_avgs, acc_deltas, state_steps, master_params, ema_params, lr, rho, eps,
          weight_decay, maximize, tail.inv_scale, tail.found_inf, tail.grad_norm, tail.max_grad_norm,
          tail.ema_decay);
}

void fused_radam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList state_steps, at::TensorList master_params, at::TensorList ema_params,
                  const at::Tensor& lr, double beta1, double beta2, double eps, double weight_decay,
                  bool decoupled_weight_decay, bool maximize, const FusedTail& tail) {
  static auto op = op_handle<&detail::fused_radam_impl>("fusetrain::fused_radam_");
  op.call(params, grads, exp_avgs, exp_avg_sqs, state_steps, master_params, ema_params, lr, beta1, beta2, eps,
          weight_decay, decoupled_weight_decay, maximize, tail.inv_scale, tail.found_inf, tail.grad_norm,
          tail.max_grad_norm, tail.ema_decay);
}

void fused_nadam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList mu_products, at::TensorList state_steps, at::TensorList master_params,
                  at::TensorList ema_params, const at::Tensor& lr, double beta1, double beta2, double eps,
                  double weight_decay, double momentum_decay, bool decoupled_weight_decay, bool maximize,
                  const FusedTail& tail) {
  static auto op = op_handle<&detail::fused_nadam_impl>("fusetrain::fused_nadam_");
  op.call(params, grads, exp_avgs, exp_avg_sqs, mu_products, state_steps, master_params, ema_params, lr, beta1, beta2,
          eps, weight_decay, momentum_decay, decoupled_weight_decay, maximize, tail.inv_scale, tail.found_inf,
          tail.grad_norm, tail.max_grad_norm, tail.ema_decay);
}

void fused_lamb_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList state_steps, at::TensorList master_params, at::TensorList ema_params,
                 const at::Tensor& lr, double beta1, double beta2, double eps, double weight_decay, bool maximize,
                 const FusedTail& tail, const LambForm& form) {
  static auto op = op_handle<&detail::fused_lamb_impl>("fusetrain::fused_lamb_");
  op.call(params, grads, exp_avgs, exp_avg_sqs, state_steps, master_params, ema_params, lr, beta1, beta2, eps,
          weight_decay, form.bias_correction, form.grad_averaging, form.trust_clip, form.always_adapt, form.caution,
          form.decoupled_weight_decay, form.decay_max_lr, maximize, tail.inv_scale, tail.found_inf, tail.grad_norm,
          tail.max_grad_norm, tail.ema_decay);
}

void fused_adamp_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList state_steps, at::TensorList master_params, at::TensorList ema_params,
                  const at::Tensor& lr, double beta1, double beta2, double eps, double weight_decay, double delta,
                  double wd_ratio, bool nesterov, bool maximize, const FusedTail& tail) {
  static auto op = op_handle<&detail::fused_adamp_impl>("fusetrain::fused_adamp_");
  op.call(params, grads, exp_avgs, exp_avg_sqs, state_steps, master_params, ema_params, lr, beta1, beta2, eps,
          weight_decay, delta, wd_ratio, nesterov, maximize, tail.inv_scale, tail.found_inf, tail.grad_norm,
          tail.max_grad_norm, tail.ema_decay);
}

void fused_muon_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                 at::TensorList state_steps, at::TensorList master_params, at::TensorList ema_params,
                 const at::Tensor& lr, double momentum, bool nesterov, double weight_decay,
                 at::ArrayRef<double> ns_coefficients, double eps, int64_t ns_steps, c10::string_view adjust_lr_fn,
                 const FusedTail& tail) {
  static auto op = op_handle<&detail::fused_muon_impl>("fusetrain::fused_muon_");
  op.call(params, grads, momentum_buffers, state_steps, master_params, ema_params, lr, momentum, nesterov,
          weight_decay, ns_coefficients, eps, ns_steps, adjust_lr_fn, tail.inv_scale, tail.found_inf, tail.grad_norm,
          tail.max_grad_norm, tail.ema_decay);
}

void ema_update_(at::TensorList ema, at::TensorList src, const at::Tensor& decay,
                 const std::optional<at::Tensor>& found_inf) {
  static auto op = op_handle<&detail::ema_update_impl>("fusetrain::ema_update_");
  op.call(ema, src, decay, found_inf);
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
                 const std::optional<at::Tensor>& grad_norm) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fusetrain::fused_step_", "").typed<decltype(fused_step_)>();
  op.call(optimizer, params, grads, state_steps, state1, state2, state3, master_params, ema_params, group_sizes, lrs,
          hyper, inv_scale, found_inf, ema_decay, grad_norm_out, found_inf_out, grad_norm);
}

void ema_decay_(const at::Tensor& decay_out, const at::Tensor& step, const std::optional<at::Tensor>& total_steps,
                c10::string_view decay_type, double decay, double beta, bool warmup, double warmup_gamma,
                double warmup_power) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fusetrain::ema_decay_", "").typed<decltype(ema_decay_)>();
  op.call(decay_out, step, total_steps, decay_type, decay, beta, warmup, warmup_gamma, warmup_power);
}

void ema_step_(at::TensorList ema, at::TensorList src, at::TensorList copy_dst, at::TensorList copy_src,
               const at::Tensor& decay, const at::Tensor& step, const std::optional<at::Tensor>& found_inf) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fusetrain::ema_step_", "").typed<decltype(ema_step_)>();
  op.call(ema, src, copy_dst, copy_src, decay, step, found_inf);
}

}  // namespace fusetrain
