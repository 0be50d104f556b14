// fusetrain::fused_lamb_ — Lamb (timm's Lamb: Adam moments, a per-tensor trust
// ratio ||w|| / ||update||, optional trust clipping, caution and decoupled
// decay) over lists of tensors, with unscale, clip, the non-finite skip,
// master weights and EMA folded in. The trust ratio is a reduction per tensor,
// so the update direction is an ATen stage and one fused pass applies it
// (NOTE [apply pass] in aten_stage.h).
#include <torch/library.h>

#include <cmath>
#include <map>
#include <vector>

#include "aten_stage.h"

namespace fusetrain {
namespace detail {

void fused_lamb_impl(UpdateKernel kernel, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList state_steps, at::TensorList master_params,
                     at::TensorList ema_params, const at::Tensor& lr, double beta1, double beta2, double eps,
                     double weight_decay, bool bias_correction, bool grad_averaging, bool trust_clip,
                     bool always_adapt, bool caution, bool decoupled_weight_decay, double decay_max_lr,
                     bool maximize, const OptT& inv_scale, const OptT& found_inf, const OptT& grad_norm,
                     double max_grad_norm, const OptT& ema_decay) {
  const char* op = "fused_lamb_";
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, op, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, op, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, op, ": weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(decay_max_lr >= 0.0, op, ": decay_max_lr must be >= 0 (0: no corrected weight decay), got ",
              decay_max_lr);
  check_stage_lists(op, params, grads, {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}}, state_steps,
                    master_params, ema_params, lr, inv_scale, found_inf, grad_norm);
  const size_t n = params.size();
  if (n == 0) return;

  const bool decoupled = decoupled_weight_decay && weight_decay != 0.0;
  const bool adapt = weight_decay != 0.0 || always_adapt;
  // L2 decay joins the direction after the caution mask (timm's order): in the
  // pass, or after the mask when there is one.
  const double l2 = decoupled ? 0.0 : weight_decay;
  DirectionHyper dh{beta1, beta2, eps, grad_averaging ? 1.0 - beta1 : 1.0, caution ? 0.0 : l2, bias_correction,
                    /*nesterov=*/false};
  ApplyHyper ah{decoupled ? weight_decay : 0.0};
  ah.aux_scales_step = true;  // aux: the trust ratio
  ah.decay_max_lr = decoupled ? decay_max_lr : 0.0;
  // The trust ratio reads the weights after the decoupled decay (timm's order):
  // ||w * (1 - lr * decay)|| = ||w|| * |1 - lr * decay|.
  at::Tensor norm_factor;
  if (decoupled && adapt) {
    at::Tensor lr_d = lr.to(at::kDouble);
    at::Tensor d = lr_d * weight_decay;
    if (decay_max_lr > 0.0) d = d * lr_d / decay_max_lr;
    norm_factor = at::rsub(d, 1.0).abs();
  }

  std::map<int, std::vector<size_t>> by_dtype;  // the state dtype of each param
  for (size_t i = 0; i < n; ++i) {
    by_dtype[static_cast<int>(params[i].scalar_type() == at::kDouble ? at::kDouble : at::kFloat)].push_back(i);
  }
  for (const auto& [sdi, idx] : by_dtype) {
    const auto sd = static_cast<at::ScalarType>(sdi);
    std::vector<at::Tensor> weights;  // read by the L2 term and the trust ratio only
    for (size_t i : idx) {
      if (l2 == 0.0 && !adapt) break;
      at::Tensor w = full_precision_param(params, master_params, i, sd);
      if (w.strides() != exp_avgs[i].strides()) w = at::empty_like(exp_avgs[i]).copy_(w);
      weights.push_back(w);
    }
    // 1. moments and the Adam direction (one fused pass; counts the step)
    std::vector<at::Tensor> dirs = run_direction_pass(op, kernel, idx, params, grads, exp_avgs, exp_avg_sqs, weights,
                                                      state_steps, lr, dh, maximize, inv_scale, found_inf,
                                                      grad_norm, max_grad_norm);
    // 2. caution and the trust ratio (reductions per tensor)
    std::vector<at::Tensor> ratios;
    for (size_t k = 0; k < idx.size(); ++k) {
      at::Tensor& u = dirs[k];
      if (caution) {  // entries whose sign disagrees with the gradient's are dropped, the rest rescaled
        at::Tensor agree = (u * grads[idx[k]] > 0);
        if (maximize) agree = (u * grads[idx[k]] < 0);
        at::Tensor mask = agree.to(sd);
        u.mul_(mask.div_(mask.mean().clamp_min_(1e-3)));
        if (l2 != 0.0) u.add_(weights[k], l2);
      }
      if (!adapt) continue;
      at::Tensor w_norm = weights[k].norm();
      if (norm_factor.defined()) w_norm = w_norm * norm_factor.to(sd);
      const at::Tensor u_norm = u.norm();
      at::Tensor ratio = at::where(w_norm > 0, at::where(u_norm > 0, w_norm / u_norm, 1.0), 1.0);
      if (trust_clip) ratio = ratio.clamp_max(1.0);
      if (sd == at::kDouble) {
        u.mul_(ratio);  // a float64 ratio would lose digits as the pass's float32 factor
      } else {
        ratios.push_back(ratio);
      }
    }
    // 3. decay and step (master weights, EMA, the skip)
    run_apply_pass(op, kernel, idx, dirs, ratios, params, state_steps, master_params, ema_params, lr, ah, found_inf,
                   ema_decay, /*count_step=*/false);
  }
}

}  // namespace detail
}  // namespace fusetrain

TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  m.def(
      "fused_lamb_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(e!)[] state_steps, Tensor(f!)[] master_params, Tensor(g!)[] ema_params, *, Tensor lr, float beta1, "
      "float beta2, float eps, float weight_decay, bool bias_correction, bool grad_averaging, bool trust_clip, "
      "bool always_adapt, bool caution, bool decoupled_weight_decay, float decay_max_lr, bool maximize, "
      "Tensor? inv_scale=None, Tensor? found_inf=None, Tensor? grad_norm=None, float max_grad_norm=0.0, "
      "Tensor? ema_decay=None) -> ()");
}
