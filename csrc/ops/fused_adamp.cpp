// The "adamp" kind: AdamP (timm's AdamP: Adam whose update of a
// scale-invariant weight is projected off the weight's direction, per channel
// or per layer, with its weight decay scaled by wd_ratio) over lists of
// tensors, with unscale, clip, the non-finite skip, master weights and EMA
// folded in. The projection needs per-channel reductions: the update direction
// is an ATen stage and one fused pass applies it (NOTE [apply pass] in
// aten_stage.h).
#include <cmath>
#include <map>
#include <utility>
#include <vector>

#include "aten_stage.h"
#include "kind_registry.h"

namespace fusetrain {
namespace detail {
namespace {

// NOTE [adamp projection]: timm's AdamP tests the channel view (rows = dim 0)
// first, then the whole layer: the first view whose largest |cosine(grad, w)|
// is below delta / sqrt(view width) takes the projection
// u -= w_n * <w_n, u> (w_n = w / (||w|| + eps) per row of the view) and
// wd_ratio. It branches on the host; here both views are evaluated from four
// row reductions (<g, w>, ||g||^2, ||w||^2, <w, u>) and the choice is made with
// torch.where on the device, so the step never syncs; the projection is then
// one pass, u - w * coef with coef = <w, u> / (||w|| + eps)^2 per row.
// The gradient is the one the update takes (times ``mult``: unscaled and
// clipped): the cosine's eps clamps its norm, so a loss-scaled or clipped
// gradient would decide otherwise than timm's AdamP stepping on that gradient.
// Returns the projected direction and whether a projection was taken (0-d
// float32, exactly 0 or 1: the apply pass's selector of wd_ratio).
std::pair<at::Tensor, at::Tensor> project(const at::Tensor& w, const at::Tensor& g, const at::Tensor& mult,
                                          const at::Tensor& u, double delta, double eps) {
  const int64_t rows = w.size(0);
  const at::Tensor W = w.reshape({rows, -1});
  at::Tensor G = g.reshape({rows, -1}).to(w.scalar_type());
  if (mult.defined()) G = G * mult;
  const at::Tensor U = u.reshape({rows, -1});
  static const int64_t kRowDim[] = {1};
  const at::IntArrayRef dim1(kRowDim);
  const at::Tensor gw = (G * W).sum(dim1), gg = (G * G).sum(dim1), ww = (W * W).sum(dim1), wu = (W * U).sum(dim1);
  // cosine_similarity's x1.x2 / (max(||x1||, eps) * max(||x2||, eps)), per row and for the whole layer
  const at::Tensor cos_ch = (gw / (gg.sqrt().clamp_min(eps) * ww.sqrt().clamp_min(eps))).abs();
  const at::Tensor cos_l = (gw.sum() / (gg.sum().sqrt().clamp_min(eps) * ww.sum().sqrt().clamp_min(eps))).abs();
  const double width_ch = static_cast<double>(W.size(1)), width_l = static_cast<double>(W.numel());
  const at::Tensor use_ch = cos_ch.max() < delta / std::sqrt(width_ch);
  const at::Tensor use_l = at::logical_and(use_ch.logical_not(), cos_l < delta / std::sqrt(width_l));
  const at::Tensor n_ch = ww.sqrt().add_(eps), n_l = ww.sum().sqrt().add_(eps);
  const at::Tensor coef = at::where(use_ch, wu / (n_ch * n_ch), at::where(use_l, wu.sum() / (n_l * n_l), 0.0));
  const at::Tensor projected = at::addcmul(U, W, coef.unsqueeze(1), -1.0);
  return {projected.view(u.sizes()), at::logical_or(use_ch, use_l).to(at::kFloat)};
}

void run(const KindCall& c) {
  const char* op = c.op;
  const UpdateKernel kernel = c.kernel;
  const at::TensorList params = c.params, grads = c.grads, exp_avgs = c.state[0], exp_avg_sqs = c.state[1];
  const at::TensorList state_steps = c.steps, master_params = c.masters, ema_params = c.emas;
  const at::Tensor& lr = c.lr;
  const double beta1 = c["beta1"], beta2 = c["beta2"], eps = c["eps"], weight_decay = c["weight_decay"];
  const double delta = c["delta"], wd_ratio = c["wd_ratio"];
  const bool nesterov = c.flag("nesterov"), maximize = c.maximize;
  const OptT &inv_scale = c.inv_scale, &found_inf = c.found_inf, &grad_norm = c.grad_norm, &ema_decay = c.ema_decay;
  const double max_grad_norm = c.max_grad_norm;
  check_stage_lists(op, params, grads, {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}}, state_steps,
                    master_params, ema_params, lr, inv_scale, found_inf, grad_norm);
  const size_t n = params.size();
  if (n == 0) return;

  // 1. moments and the Adam direction over 1 - beta1^t (one fused pass; counts the step)
  DirectionFields dh{};
  dh.beta1 = beta1;
  dh.beta2 = beta2;
  dh.eps = eps;
  dh.beta3 = 1.0 - beta1;
  dh.l2_decay = 0.0;
  dh.bias_correction = 1.0;
  dh.nesterov = nesterov ? 1.0 : 0.0;
  // 3. the decay: weight_decay, times wd_ratio where the projection was taken (aux 1)
  ApplyFields ah{};
  ah.weight_decay = weight_decay;
  ah.lr_ratio = 1.0;
  ah.aux_scales_step = 0.0;
  ah.aux_base = 1.0;
  ah.aux_mul = wd_ratio - 1.0;
  ah.decay_max_lr = 0.0;
  const at::Tensor not_projected = at::zeros({}, lr.options().dtype(at::kFloat));
  const at::Tensor mult = grad_multiplier_tensor(inv_scale, grad_norm, max_grad_norm);  // NOTE [adamp projection]

  std::map<int, std::vector<size_t>> by_dtype;  // the state dtype of each param
  for (size_t i = 0; i < n; ++i) {
    by_dtype[static_cast<int>(params[i].scalar_type() == at::kDouble ? at::kDouble : at::kFloat)].push_back(i);
  }
  for (const auto& [sdi, idx] : by_dtype) {
    const auto sd = static_cast<at::ScalarType>(sdi);
    std::vector<at::Tensor> dirs = run_direction_pass(op, kernel, idx, params, grads, exp_avgs, exp_avg_sqs, {},
                                                      state_steps, lr, dh, maximize, inv_scale, found_inf,
                                                      grad_norm, max_grad_norm);
    // 2. the projection of weights of 2+ dims (NOTE [adamp projection])
    std::vector<at::Tensor> projected;
    for (size_t k = 0; k < idx.size(); ++k) {
      const size_t i = idx[k];
      at::Tensor taken = not_projected;
      if (params[i].dim() > 1 && params[i].numel() > 0) {
        std::tie(dirs[k], taken) =
            project(full_precision_param(params, master_params, i, sd), grads[i], mult, dirs[k], delta, eps);
      }
      projected.push_back(taken);
    }
    run_apply_pass(op, kernel, idx, dirs, projected, params, state_steps, master_params, ema_params, lr, ah,
                   found_inf, ema_decay, /*count_step=*/false);
  }
}

const bool registered = set_kind_run("adamp", &run);

}  // namespace
}  // namespace detail
}  // namespace fusetrain
