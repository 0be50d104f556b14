// The "lamb" kind: Lamb (timm's Lamb: Adam moments, a per-tensor trust
// ratio ||w|| / ||update||, optional trust clipping, caution and decoupled
// decay) over lists of tensors, with unscale, clip, the non-finite skip,
// master weights and EMA folded in. The trust ratio is a reduction per tensor,
// so the update direction is an ATen stage and one fused pass applies it
// (NOTE [apply pass] in aten_stage.h).
#include <cmath>
#include <map>
#include <vector>

#include "aten_stage.h"
#include "kind_registry.h"

namespace fusetrain {
namespace detail {

namespace {

void run(const KindCall& c) {
  const char* op = c.op;
  const UpdateKernel kernel = c.kernel;
  const at::TensorList params = c.params, grads = c.grads, exp_avgs = c.state[0], exp_avg_sqs = c.state[1];
  const at::TensorList state_steps = c.steps, master_params = c.masters, ema_params = c.emas;
  const at::Tensor& lr = c.lr;
  const double beta1 = c["beta1"], beta2 = c["beta2"], eps = c["eps"], weight_decay = c["weight_decay"];
  // timm's corrected weight decay: the decoupled decay scaled by lr / max_lr (the constructor's lr).
  const double decay_max_lr = c.flag("corrected_weight_decay") ? c["max_lr"] : 0.0;
  const bool bias_correction = c.flag("bias_correction"), grad_averaging = c.flag("grad_averaging");
  const bool trust_clip = c.flag("trust_clip"), always_adapt = c.flag("always_adapt"), caution = c.flag("caution");
  const bool decoupled_weight_decay = c.flag("decoupled_weight_decay"), maximize = c.maximize;
  const OptT &inv_scale = c.inv_scale, &found_inf = c.found_inf, &grad_norm = c.grad_norm, &ema_decay = c.ema_decay;
  const double max_grad_norm = c.max_grad_norm;
  check_stage_lists(op, params, grads, {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}}, state_steps,
                    master_params, ema_params, lr, inv_scale, found_inf, grad_norm);
  const size_t n = params.size();
  if (n == 0) return;

  const bool decoupled = decoupled_weight_decay && weight_decay != 0.0;
  const bool adapt = weight_decay != 0.0 || always_adapt;
  // L2 decay joins the direction after the caution mask (timm's order): in the
  // pass, or after the mask when there is one.
  const double l2 = decoupled ? 0.0 : weight_decay;
  DirectionFields dh{};
  dh.beta1 = beta1;
  dh.beta2 = beta2;
  dh.eps = eps;
  dh.beta3 = grad_averaging ? 1.0 - beta1 : 1.0;
  dh.l2_decay = caution ? 0.0 : l2;
  dh.bias_correction = bias_correction;
  dh.nesterov = 0.0;
  ApplyFields ah{};
  ah.weight_decay = decoupled ? weight_decay : 0.0;
  ah.lr_ratio = 1.0;
  ah.aux_scales_step = 1.0;  // aux: the trust ratio
  ah.aux_base = 0.0;
  ah.aux_mul = 1.0;
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

const bool registered = set_kind_run("lamb", &run);

}  // namespace
}  // namespace detail
}  // namespace fusetrain
