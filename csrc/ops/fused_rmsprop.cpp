// fusetrain::fused_rmsprop_ — RMSprop (centered, momentum, weight decay; the
// TensorFlow form of timm's RMSpropTF with tf_style, NOTE [rmsprop tf] in
// csrc/common/rms_math.h) over lists of tensors, with unscale, clip,
// non-finite skip and EMA folded in.
#include <torch/library.h>

#include "../common/update_args.h"

namespace fusetrain {
namespace detail {

void fused_rmsprop_impl(UpdateKernel kernel, at::TensorList params, at::TensorList grads, at::TensorList square_avgs,
                        at::TensorList momentum_buffers, at::TensorList grad_avgs, at::TensorList state_steps,
                        at::TensorList master_params, at::TensorList ema_params, const at::Tensor& lr, double alpha,
                        double eps, double weight_decay, double momentum, bool centered, bool maximize,
                        const OptT& inv_scale, const OptT& found_inf, const OptT& grad_norm, double max_grad_norm,
                        const OptT& ema_decay, bool tf_style, bool lr_in_momentum, bool decoupled_weight_decay) {
  const char* op = "fused_rmsprop_";
  TORCH_CHECK(tf_style || (!lr_in_momentum && !decoupled_weight_decay), op, ": lr_in_momentum and "
              "decoupled_weight_decay belong to the TensorFlow form: they need tf_style=True");
  TORCH_CHECK(alpha >= 0.0, op, ": alpha must be >= 0, got ", alpha);
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, op, ": weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(momentum >= 0.0, op, ": momentum must be >= 0, got ", momentum);
  const size_t n = params.size();
  TORCH_CHECK(square_avgs.size() == n, op, ": square_avgs needs one tensor per param (", n, "), got ",
              square_avgs.size());
  TORCH_CHECK(momentum == 0.0 || momentum_buffers.size() == n, op, ": momentum > 0 needs one momentum_buffers "
              "tensor per param (", n, "), got ", momentum_buffers.size());
  TORCH_CHECK(!centered || grad_avgs.size() == n, op, ": centered=True needs one grad_avgs tensor per param (", n,
              "), got ", grad_avgs.size());
  OptimHyper h;
  h.kind = OptimKind::RMSprop;
  h.rmsprop = RMSpropHyper{alpha, eps, weight_decay, momentum, centered, tf_style, lr_in_momentum,
                           decoupled_weight_decay};
  const OpStates st{square_avgs, momentum > 0.0 ? momentum_buffers : at::TensorList(),
                    centered ? grad_avgs : at::TensorList(), {"square_avgs", "momentum_buffers", "grad_avgs"}};
  run_update_op(op, kernel, h, st, params, grads, state_steps, master_params, ema_params, lr, maximize, inv_scale,
                found_inf, grad_norm, max_grad_norm, ema_decay);
}

}  // namespace detail
}  // namespace fusetrain

TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  m.def(
      "fused_rmsprop_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] square_avgs, Tensor(c!)[] momentum_buffers, "
      "Tensor(d!)[] grad_avgs, Tensor(e!)[] state_steps, Tensor(f!)[] master_params, Tensor(g!)[] ema_params, *, "
      "Tensor lr, float alpha, float eps, float weight_decay, float momentum, bool centered, bool maximize, "
      "Tensor? inv_scale=None, Tensor? found_inf=None, Tensor? grad_norm=None, float max_grad_norm=0.0, "
      "Tensor? ema_decay=None, bool tf_style=False, bool lr_in_momentum=False, "
      "bool decoupled_weight_decay=False) -> ()");
}
