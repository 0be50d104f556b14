// fusetrain::fused_adadelta_ — Adadelta over lists of tensors, with unscale,
// clip, non-finite skip and EMA folded in.
#include <torch/library.h>

#include "../common/update_args.h"

namespace fusetrain {
namespace detail {

void fused_adadelta_impl(UpdateKernel kernel, at::TensorList params, at::TensorList grads, at::TensorList square_avgs,
                         at::TensorList acc_deltas, at::TensorList state_steps, at::TensorList master_params,
                         at::TensorList ema_params, const at::Tensor& lr, double rho, double eps, double weight_decay,
                         bool maximize, const OptT& inv_scale, const OptT& found_inf, const OptT& grad_norm,
                         double max_grad_norm, const OptT& ema_decay) {
  const char* op = "fused_adadelta_";
  TORCH_CHECK(rho >= 0.0 && rho <= 1.0, op, ": rho must be in [0, 1], got ", rho);
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, op, ": weight_decay must be >= 0, got ", weight_decay);
  const size_t n = params.size();
  TORCH_CHECK(square_avgs.size() == n && acc_deltas.size() == n, op, ": square_avgs and acc_deltas need one tensor "
              "per param (", n, "), got ", square_avgs.size(), " and ", acc_deltas.size());
  OptimHyper h;
  h.kind = OptimKind::Adadelta;
  h.adadelta = AdadeltaHyper{rho, eps, weight_decay};
  const OpStates st{square_avgs, acc_deltas, {}, {"square_avgs", "acc_deltas", "state3"}};
  run_update_op(op, kernel, h, st, params, grads, state_steps, master_params, ema_params, lr, maximize, inv_scale,
                found_inf, grad_norm, max_grad_norm, ema_decay);
}

}  // namespace detail
}  // namespace fusetrain

TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  m.def(
      "fused_adadelta_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] square_avgs, Tensor(c!)[] acc_deltas, "
      "Tensor(e!)[] state_steps, Tensor(f!)[] master_params, Tensor(g!)[] ema_params, *, Tensor lr, float rho, "
      "float eps, float weight_decay, bool maximize, Tensor? inv_scale=None, Tensor? found_inf=None, "
      "Tensor? grad_norm=None, float max_grad_norm=0.0, Tensor? ema_decay=None) -> ()");
}
