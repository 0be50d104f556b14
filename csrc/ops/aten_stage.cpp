// The shared pieces of the ATen-stage update ops (NOTE [apply pass] in
// aten_stage.h).
#include "aten_stage.h"

#include <string>

namespace fusetrain {
namespace detail {

at::Tensor grad_multiplier_tensor(const OptT& inv_scale, const OptT& grad_norm, double max_grad_norm) {
  at::Tensor m;
  if (inv_scale.has_value()) m = *inv_scale;
  if (grad_norm.has_value() && max_grad_norm > 0.0) {
    at::Tensor coef = at::full({}, max_grad_norm, grad_norm->options()).div_(*grad_norm + 1e-6).clamp_max_(1.0);
    m = m.defined() ? m * coef : coef;
  }
  return m;
}

at::Tensor keep_tensor(const OptT& found_inf) {
  return found_inf.has_value() ? at::rsub(*found_inf, 1.0) : at::Tensor();
}

at::Tensor stage_grad(const at::Tensor& grad, at::ScalarType sd, const at::Tensor& mult, const at::Tensor& keep,
                      bool maximize) {
  at::Tensor g = grad.to(sd);
  if (mult.defined()) g = g * mult;
  if (maximize) g = g.neg();
  if (keep.defined()) g = at::nan_to_num(g, 0.0, 0.0, 0.0);
  return g;
}

namespace {

void check_device_scalar(const char* op, const char* name, const OptT& t, const at::Device& dev) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->defined() && t->numel() == 1 && t->scalar_type() == at::kFloat, op, ": ", name,
              " must be a float32 tensor with one element");
  TORCH_CHECK(t->device() == dev, op, ": ", name, " is on ", t->device(), " but params are on ", dev);
}

}  // namespace

void check_stage_lists(const char* op, at::TensorList params, at::TensorList grads,
                       const std::vector<std::pair<const char*, at::TensorList>>& states, at::TensorList state_steps,
                       at::TensorList master_params, at::TensorList ema_params, const at::Tensor& lr,
                       const OptT& inv_scale, const OptT& found_inf, const OptT& grad_norm) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && state_steps.size() == n, op, ": got ", n, " params, ", grads.size(),
              " grads and ", state_steps.size(), " state_steps");
  for (const auto& [name, list] : states) {
    TORCH_CHECK(list.size() == n, op, ": ", name, " needs one tensor per param (", n, "), got ", list.size());
  }
  TORCH_CHECK(master_params.empty() || master_params.size() == n, op,
              ": master_params must be empty or have one tensor per param (", n, "), got ", master_params.size());
  TORCH_CHECK(ema_params.empty() || ema_params.size() == n, op,
              ": ema_params must be empty or have one tensor per param (", n, "), got ", ema_params.size());
  TORCH_CHECK(lr.defined(), op, ": lr is required");
  if (n == 0) return;
  const at::Device dev = params[0].device();
  check_device_scalar(op, "inv_scale", inv_scale, dev);
  check_device_scalar(op, "grad_norm", grad_norm, dev);
  check_device_scalar(op, "found_inf", found_inf, dev);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.defined(), op, ": params[", i, "] is undefined");
    TORCH_CHECK(!p.is_complex(), op, ": params[", i, "] is complex; complex params are not supported");
    TORCH_CHECK(p.device() == dev, op, ": params[", i, "] is on ", p.device(), " but params[0] is on ", dev);
    const at::Tensor& g = grads[i];
    TORCH_CHECK(g.defined() && g.layout() == at::kStrided, op, ": grads[", i, "] must be a dense tensor");
    TORCH_CHECK(g.is_floating_point(), op, ": grads[", i, "] has dtype ", g.scalar_type(),
                "; supported: float32, float16, bfloat16, float64");
    TORCH_CHECK(g.sizes() == p.sizes(), op, ": grads[", i, "] has shape ", g.sizes(), " but params[", i,
                "] has shape ", p.sizes());
    TORCH_CHECK(g.device() == dev, op, ": params[", i, "] is on ", dev, " but grads[", i, "] is on ", g.device());
    const at::ScalarType sd = p.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    for (const auto& [name, list] : states) {
      const at::Tensor& s = list[i];
      TORCH_CHECK(s.defined(), op, ": ", name, "[", i, "] is undefined");
      TORCH_CHECK(s.sizes() == p.sizes() && s.scalar_type() == sd && s.device() == dev, op, ": ", name, "[", i,
                  "] must be a ", sd, " tensor of shape ", p.sizes(), " on ", dev, ", got ", s.scalar_type(),
                  " of shape ", s.sizes(), " on ", s.device());
    }
  }
}

at::Tensor full_precision_param(at::TensorList params, at::TensorList master_params, size_t i, at::ScalarType sd) {
  if (!master_params.empty()) return master_params[i];
  return params[i].to(sd);
}

void run_apply_pass(const char* op, UpdateKernel kernel, const std::vector<size_t>& idx,
                    const std::vector<at::Tensor>& dirs, const std::vector<at::Tensor>& aux, at::TensorList params,
                    at::TensorList state_steps, at::TensorList master_params, at::TensorList ema_params,
                    const at::Tensor& lr, const ApplyFields& fields, const OptT& found_inf, const OptT& ema_decay,
                    bool count_step) {
  UpdateLists l;
  l.aux_name = "decay inputs";
  for (size_t k = 0; k < idx.size(); ++k) {
    const size_t i = idx[k];
    l.params.push_back(params[i]);
    l.grads.push_back(dirs[k].view(params[i].sizes()));
    l.steps.push_back(state_steps[i]);
    if (!master_params.empty()) l.master.push_back(master_params[i]);
    if (!ema_params.empty()) l.ema.push_back(ema_params[i]);
    if (!aux.empty()) l.aux.push_back(aux[k]);
  }
  OptimHyper h;
  h.set(OptimKind::Apply, fields);
  h.count_step = count_step;
  run_fused_update(op, l, h, UpdateScalars{lr, at::Tensor(), opt_or_undef(found_inf), at::Tensor(),
                                           opt_or_undef(ema_decay)},
                   kernel);
}

std::vector<at::Tensor> run_direction_pass(const char* op, UpdateKernel kernel, const std::vector<size_t>& idx,
                                           at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                                           at::TensorList exp_avg_sqs, const std::vector<at::Tensor>& weights,
                                           at::TensorList state_steps, const at::Tensor& lr,
                                           const DirectionFields& fields, bool maximize, const OptT& inv_scale,
                                           const OptT& found_inf, const OptT& grad_norm, double max_grad_norm) {
  UpdateLists l;
  l.state_names[0] = "exp_avgs";
  l.state_names[1] = "exp_avg_sqs";
  l.state_names[2] = "weights";
  std::vector<at::Tensor> dirs;
  dirs.reserve(idx.size());
  for (size_t k = 0; k < idx.size(); ++k) {
    const size_t i = idx[k];
    dirs.push_back(at::empty_like(exp_avgs[i]));  // written by the pass (its "params")
    l.params.push_back(dirs.back());
    l.grads.push_back(grads[i]);
    l.steps.push_back(state_steps[i]);
    l.state1.push_back(exp_avgs[i]);
    l.state2.push_back(exp_avg_sqs[i]);
    if (fields.l2_decay != 0.0) l.state3.push_back(weights[k]);
  }
  OptimHyper h;
  h.set(OptimKind::Direction, fields);
  h.maximize = maximize;
  h.max_grad_norm = max_grad_norm;
  run_fused_update(op, l, h, UpdateScalars{lr, opt_or_undef(inv_scale), opt_or_undef(found_inf),
                                           opt_or_undef(grad_norm), at::Tensor()},
                   kernel);
  return dirs;
}

}  // namespace detail
}  // namespace fusetrain
