// fusetrain::fused_nadam_ — NAdam (Adam with Nesterov momentum and the
// momentum-decay schedule; L2 or decoupled weight decay) over lists of
// tensors, with unscale, clip, non-finite skip and EMA folded in. Each param
// keeps its running product of momentum coefficients, mu_product, as a 0-d
// float32 tensor beside its step (NOTE [tensor scalars] in update_args.h).
#include <torch/library.h>

#include "../common/update_args.h"

namespace fusetrain {
namespace detail {

void fused_nadam_impl(UpdateKernel kernel, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList mu_products, at::TensorList state_steps,
                      at::TensorList master_params, at::TensorList ema_params, const at::Tensor& lr, double beta1,
                      double beta2, double eps, double weight_decay, double momentum_decay,
                      bool decoupled_weight_decay, bool maximize, const OptT& inv_scale, const OptT& found_inf,
                      const OptT& grad_norm, double max_grad_norm, const OptT& ema_decay) {
  const char* op = "fused_nadam_";
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, op, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, op, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, op, ": weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(momentum_decay >= 0.0, op, ": momentum_decay must be >= 0, got ", momentum_decay);
  const size_t n = params.size();
  TORCH_CHECK(exp_avgs.size() == n && exp_avg_sqs.size() == n && mu_products.size() == n, op,
              ": exp_avgs, exp_avg_sqs and mu_products need one tensor per param (", n, "), got ", exp_avgs.size(),
              ", ", exp_avg_sqs.size(), " and ", mu_products.size());
  OptimHyper h;
  h.kind = OptimKind::NAdam;
  h.nadam = NAdamHyper{beta1, beta2, eps, weight_decay, momentum_decay, decoupled_weight_decay};
  const OpStates st{exp_avgs, exp_avg_sqs, {}, {"exp_avgs", "exp_avg_sqs", "state3"}, mu_products, "mu_products"};
  run_update_op(op, kernel, h, st, params, grads, state_steps, master_params, ema_params, lr, maximize, inv_scale,
                found_inf, grad_norm, max_grad_norm, ema_decay);
}

}  // namespace detail
}  // namespace fusetrain

TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  m.def(
      "fused_nadam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] mu_products, Tensor(e!)[] state_steps, Tensor(f!)[] master_params, Tensor(g!)[] ema_params, *, "
      "Tensor lr, float beta1, float beta2, float eps, float weight_decay, float momentum_decay, "
      "bool decoupled_weight_decay, bool maximize, Tensor? inv_scale=None, Tensor? found_inf=None, "
      "Tensor? grad_norm=None, float max_grad_norm=0.0, Tensor? ema_decay=None) -> ()");
}
