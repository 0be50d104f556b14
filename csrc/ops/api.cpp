// The public C++ API of csrc/include/fusetrain/ops.h: typed calls into the
// dispatcher, so C++ callers get the same kernels and checks as Python.
#include <ATen/core/dispatch/Dispatcher.h>

#include "fusetrain/build_info.h"
#include "fusetrain/ops.h"

namespace fusetrain {
namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using OptT = const std::optional<at::Tensor>&;

}  // namespace

std::tuple<at::Tensor, at::Tensor> grad_stats(at::TensorList grads, const std::optional<at::Tensor>& inv_scale) {
  static auto op = op_handle<std::tuple<at::Tensor, at::Tensor>(at::TensorList, OptT)>("fusetrain::grad_stats");
  return op.call(grads, inv_scale);
}

void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList max_exp_avg_sqs, at::TensorList state_steps, at::TensorList master_params,
                 at::TensorList ema_params, const at::Tensor& lr, double beta1, double beta2, double weight_decay,
                 double eps, bool amsgrad, bool maximize, bool decoupled_weight_decay, const FusedTail& tail) {
  static auto op = op_handle<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                                  at::TensorList, at::TensorList, at::TensorList, const at::Tensor&, double, double,
                                  double, double, bool, bool, bool, OptT, OptT, OptT, double, OptT)>(
      "fusetrain::fused_adam_");
  op.call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params, ema_params, lr, beta1,
          beta2, weight_decay, eps, amsgrad, maximize, decoupled_weight_decay, tail.inv_scale, tail.found_inf,
          tail.grad_norm, tail.max_grad_norm, tail.ema_decay);
}

void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                at::TensorList state_steps, at::TensorList master_params, at::TensorList ema_params,
                const at::Tensor& lr, double momentum, double dampening, double weight_decay, bool nesterov,
                bool maximize, const FusedTail& tail) {
  static auto op = op_handle<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                                  at::TensorList, const at::Tensor&, double, double, double, bool, bool, OptT, OptT,
                                  OptT, double, OptT)>("fusetrain::fused_sgd_");
  op.call(params, grads, momentum_buffers, state_steps, master_params, ema_params, lr, momentum, dampening,
          weight_decay, nesterov, maximize, tail.inv_scale, tail.found_inf, tail.grad_norm, tail.max_grad_norm,
          tail.ema_decay);
}

void fused_lion_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList state_steps,
                 at::TensorList master_params, at::TensorList ema_params, const at::Tensor& lr, double beta1,
                 double beta2, double weight_decay, bool maximize, const FusedTail& tail) {
  static auto op = op_handle<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                                  at::TensorList, const at::Tensor&, double, double, double, bool, OptT, OptT, OptT,
                                  double, OptT)>("fusetrain::fused_lion_");
  op.call(params, grads, exp_avgs, state_steps, master_params, ema_params, lr, beta1, beta2, weight_decay, maximize,
          tail.inv_scale, tail.found_inf, tail.grad_norm, tail.max_grad_norm, tail.ema_decay);
}

void ema_update_(at::TensorList ema, at::TensorList src, const at::Tensor& decay,
                 const std::optional<at::Tensor>& found_inf) {
  static auto op = op_handle<void(at::TensorList, at::TensorList, const at::Tensor&, OptT)>("fusetrain::ema_update_");
  op.call(ema, src, decay, found_inf);
}

void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                   double growth_factor, double backoff_factor, int64_t growth_interval) {
  static auto op = op_handle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double, int64_t)>(
      "fusetrain::update_scale_");
  op.call(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval);
}

bool built_with_cuda() {
#ifdef FUSETRAIN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace fusetrain
