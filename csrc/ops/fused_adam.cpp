// fusetrain::fused_adam_ — Adam / AdamW update over lists of tensors, with the
// gradient unscale, clip, non-finite skip and EMA folded into the same pass.
#include <torch/library.h>

#include "../common/update_args.h"

namespace fusetrain {
namespace detail {

void fused_adam_impl(UpdateKernel kernel, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList state_steps,
                     at::TensorList master_params, at::TensorList ema_params, const at::Tensor& lr,
                     double beta1, double beta2, double weight_decay, double eps, bool amsgrad, bool maximize,
                     bool decoupled_weight_decay, const std::optional<at::Tensor>& inv_scale,
                     const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& grad_norm,
                     double max_grad_norm, const std::optional<at::Tensor>& ema_decay, bool bias_correction) {
  const char* op = "fused_adam_";
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, op, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, op, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, op, ": weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(exp_avgs.size() == params.size() && exp_avg_sqs.size() == params.size(), op,
              ": exp_avgs and exp_avg_sqs need one tensor per param (", params.size(), "), got ",
              exp_avgs.size(), " and ", exp_avg_sqs.size());
  TORCH_CHECK(!amsgrad || max_exp_avg_sqs.size() == params.size(), op,
              ": amsgrad=True needs one max_exp_avg_sqs tensor per param (", params.size(), "), got ",
              max_exp_avg_sqs.size());
  OptimHyper h;
  h.kind = OptimKind::Adam;
  h.adam = AdamHyper{beta1, beta2, eps, weight_decay, decoupled_weight_decay, amsgrad, bias_correction};
  const OpStates st{exp_avgs, exp_avg_sqs, amsgrad ? max_exp_avg_sqs : at::TensorList(),
                    {"exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"}};
  run_update_op(op, kernel, h, st, params, grads, state_steps, master_params, ema_params, lr, maximize, inv_scale,
                found_inf, grad_norm, max_grad_norm, ema_decay);
}

}  // namespace detail
}  // namespace fusetrain

TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  m.def(
      "fused_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] state_steps, Tensor(f!)[] master_params, "
      "Tensor(g!)[] ema_params, *, Tensor lr, float beta1, float beta2, float weight_decay, float eps, "
      "bool amsgrad, bool maximize, bool decoupled_weight_decay, Tensor? inv_scale=None, "
      "Tensor? found_inf=None, Tensor? grad_norm=None, float max_grad_norm=0.0, "
      "Tensor? ema_decay=None, bool bias_correction=True) -> ()");
}
