// fusetrain::fused_sgd_ — SGD (momentum, dampening, nesterov, weight decay)
// over lists of tensors, with unscale, clip, non-finite skip and EMA folded in.
#include <torch/library.h>

#include "../common/update_args.h"

namespace fusetrain {
namespace detail {

void fused_sgd_impl(UpdateKernel kernel, at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                    at::TensorList state_steps, at::TensorList master_params, at::TensorList ema_params,
                    const at::Tensor& lr, double momentum, double dampening, double weight_decay, bool nesterov,
                    bool maximize, const std::optional<at::Tensor>& inv_scale,
                    const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& grad_norm,
                    double max_grad_norm, const std::optional<at::Tensor>& ema_decay) {
  const char* op = "fused_sgd_";
  TORCH_CHECK(momentum >= 0.0, op, ": momentum must be >= 0, got ", momentum);
  TORCH_CHECK(weight_decay >= 0.0, op, ": weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(!nesterov || (momentum > 0.0 && dampening == 0.0), op,
              ": nesterov=True needs momentum > 0 and dampening == 0, got momentum=", momentum,
              ", dampening=", dampening);
  TORCH_CHECK(momentum == 0.0 || momentum_buffers.size() == params.size(), op,
              ": momentum != 0 needs one momentum_buffers tensor per param (", params.size(), "), got ",
              momentum_buffers.size());
  OptimHyper h;
  h.kind = OptimKind::SGD;
  h.sgd = SGDHyper{momentum, dampening, weight_decay, nesterov};
  const OpStates st{momentum != 0.0 ? momentum_buffers : at::TensorList(), {}, {},
                    {"momentum_buffers", "state2", "state3"}};
  run_update_op(op, kernel, h, st, params, grads, state_steps, master_params, ema_params, lr, maximize, inv_scale,
                found_inf, grad_norm, max_grad_norm, ema_decay);
}

}  // namespace detail
}  // namespace fusetrain

TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  m.def(
      "fused_sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
      "Tensor(e!)[] state_steps, Tensor(f!)[] master_params, Tensor(g!)[] ema_params, *, Tensor lr, "
      "float momentum, float dampening, float weight_decay, bool nesterov, bool maximize, "
      "Tensor? inv_scale=None, Tensor? found_inf=None, Tensor? grad_norm=None, float max_grad_norm=0.0, "
      "Tensor? ema_decay=None) -> ()");
}
