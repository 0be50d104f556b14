// The "muon" kind: Muon (torch.optim.Muon's update) over lists of
// matrix and convolution params, batched across params of one shape, with
// unscale, clip, the non-finite skip, master weights and EMA folded in.
#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "aten_stage.h"
#include "kind_registry.h"

namespace fusetrain {
namespace detail {
namespace {

// NOTE [muon apply]: a Muon step of one list is three stages, per batch of
// params whose matrices (dim 0 x the rest flattened) share a shape:
//   1. momentum (ATen, per param): g = grad * inv_scale * clip coefficient;
//      buf.lerp_(g, 1 - momentum); u = nesterov ? g.lerp(buf, momentum) : buf.
//      A skipped step must leave buf as it was without a host branch: g's
//      non-finite entries are zeroed and the lerp weight becomes
//      (1 - momentum) * (1 - found_inf), so a skipped step adds exactly 0.
//   2. Newton-Schulz (ATen) in bfloat16, with torch.optim.Muon's
//      coefficients, normalisation and precision, so the results agree. On
//      CUDA the batch's u are stacked and orthogonalised together (batched
//      matmuls: one launch per iteration for the batch); on the CPU, where a
//      bfloat16 batched matmul is slower than the plain one, one at a time.
//   3. the apply pass (NOTE [apply pass] in aten_stage.h): p = p * (1 - lr * wd)
//      - lr * ratio * O with the skip, master weights and EMA in one pass.
//      Its step counter counts the steps taken (the update does not read it).

// Newton-Schulz iterations on a matrix [r, c] or a stack of them [B, r, c],
// as torch.optim.Muon's _zeropower_via_newtonschulz on each: bfloat16, the
// wide orientation, Frobenius normalisation clamped at eps.
at::Tensor newton_schulz(const at::Tensor& g, double a, double b, double c, int64_t steps, double eps) {
  at::Tensor x = g.to(at::kBFloat16);
  const bool tall = g.size(-2) > g.size(-1);
  if (tall) x = x.mT();
  const bool batched = g.dim() == 3;
  x = x / (batched ? at::linalg_vector_norm(x, 2, at::IntArrayRef({-2, -1}), /*keepdim=*/true) : x.norm())
              .clamp_min(eps);
  for (int64_t k = 0; k < steps; ++k) {
    const at::Tensor gram = at::matmul(x, x.mT());
    if (batched) {
      x = at::baddbmm(x, at::baddbmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c), x, /*beta=*/a);
    } else {
      x = at::addmm(x, at::addmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c), x, /*beta=*/a);
    }
  }
  if (tall) x = x.mT();
  return x.contiguous();
}

// torch.optim.Muon's _adjust_lr ratio for an r x c matrix.
double lr_ratio(const std::string& fn, int64_t r, int64_t c) {
  const double rd = static_cast<double>(r), cd = static_cast<double>(c);
  if (fn == "match_rms_adamw") return 0.2 * std::sqrt(std::max(rd, cd));
  return std::sqrt(std::max(1.0, rd / cd));
}

// NOTE [muon groups]: a Muon optimizer holds two kinds of groups: use_muon
// groups (matrices and convolution filters: state momentum_buffer) and the
// others (AdamW with the group's lr and weight_decay, adamw_beta1,
// adamw_beta2 and adamw_eps: state exp_avg, exp_avg_sq). Both take the one
// global norm and non-finite flag of the stats pass.
void run_adamw(const KindCall& c) {
  AdamFields a{};
  a.beta1 = c["adamw_beta1"];
  a.beta2 = c["adamw_beta2"];
  a.weight_decay = c["weight_decay"];
  a.eps = c["adamw_eps"];
  a.amsgrad = 0.0;
  a.decoupled_weight_decay = 1.0;
  a.bias_correction = 1.0;
  OptimHyper h;
  h.set(OptimKind::Adam, a);
  run_kind_update(c, h, c.state[0], c.state[1], {});
}

void run(const KindCall& c) {
  if (!c.flag("use_muon")) return run_adamw(c);
  const char* op = c.op;
  const UpdateKernel kernel = c.kernel;
  const at::TensorList params = c.params, grads = c.grads, momentum_buffers = c.state[0];
  const at::TensorList state_steps = c.steps, master_params = c.masters, ema_params = c.emas;
  const at::Tensor& lr = c.lr;
  const double momentum = c["momentum"], weight_decay = c["weight_decay"], eps = c["eps"];
  const bool nesterov = c.flag("nesterov");
  const double ns_coefficients[3] = {c["ns_a"], c["ns_b"], c["ns_c"]};
  const auto ns_steps = static_cast<int64_t>(c["ns_steps"]);
  const std::string adjust = c.flag("match_rms_adamw") ? "match_rms_adamw" : "original";
  const OptT &inv_scale = c.inv_scale, &found_inf = c.found_inf, &grad_norm = c.grad_norm, &ema_decay = c.ema_decay;
  const double max_grad_norm = c.max_grad_norm;
  check_stage_lists(op, params, grads, {{"momentum_buffers", momentum_buffers}}, state_steps, master_params,
                    ema_params, lr, inv_scale, found_inf, grad_norm);
  const size_t n = params.size();
  if (n == 0) return;
  const at::Device dev = params[0].device();

  // Batches: params whose matrices share (rows, cols) and whose state shares a dtype.
  std::map<std::tuple<int64_t, int64_t, int>, std::vector<size_t>> batches;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    // 2 or more dims: the table's param rule (fused_step_ checks it first).
    const at::ScalarType sd = p.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    // A convolution filter is the matrix out_channels x (in_channels * kernel size).
    const int64_t rows = p.size(0);
    const int64_t cols = c10::multiply_integers(p.sizes().slice(1));
    batches[{rows, cols, static_cast<int>(sd)}].push_back(i);
  }

  const at::Tensor mult = grad_multiplier_tensor(inv_scale, grad_norm, max_grad_norm);
  // The momentum's lerp weight: 1 - momentum, or 0 on a skipped step (NOTE [muon apply]).
  const at::Tensor keep = keep_tensor(found_inf);
  std::map<int, at::Tensor> weights;

  for (const auto& [key, idx] : batches) {
    const auto [rows, cols, sdi] = key;
    const auto sd = static_cast<at::ScalarType>(sdi);
    at::Tensor weight;
    if (keep.defined()) {
      auto it = weights.find(sdi);
      if (it == weights.end()) it = weights.emplace(sdi, keep.to(sd) * (1.0 - momentum)).first;
      weight = it->second;
    }
    // 1. momentum
    std::vector<at::Tensor> updates;
    updates.reserve(idx.size());
    for (size_t i : idx) {
      const at::Tensor g = stage_grad(grads[i], sd, mult, keep, /*maximize=*/false);
      at::Tensor buf = momentum_buffers[i];
      if (weight.defined()) {
        buf.lerp_(g, weight);
      } else {
        buf.lerp_(g, 1.0 - momentum);
      }
      const at::Tensor u = nesterov ? at::lerp(g, buf, momentum) : buf;
      updates.push_back(u.reshape({rows, cols}));
    }
    // 2. Newton-Schulz on the stacked batch
    std::vector<at::Tensor> ortho;
    const auto [na, nb, nc] = std::make_tuple(ns_coefficients[0], ns_coefficients[1], ns_coefficients[2]);
    if (dev.is_cuda() && idx.size() > 1) {
      ortho = newton_schulz(at::stack(updates), na, nb, nc, ns_steps, eps).unbind(0);
    } else {
      for (const at::Tensor& u : updates) ortho.push_back(newton_schulz(u, na, nb, nc, ns_steps, eps));
    }
    if (sd == at::kDouble)  // float64 params take float64 grads (exact)
      for (at::Tensor& o : ortho) o = o.to(at::kDouble);
    // 3. apply
    for (size_t k = 0; k < idx.size(); ++k) ortho[k] = ortho[k].view(params[idx[k]].sizes());
    ApplyFields ah{};
    ah.weight_decay = weight_decay;
    ah.lr_ratio = lr_ratio(adjust, rows, cols);
    ah.aux_scales_step = 0.0;
    ah.aux_base = 0.0;
    ah.aux_mul = 1.0;
    ah.decay_max_lr = 0.0;
    run_apply_pass(op, kernel, idx, ortho, {}, params, state_steps, master_params, ema_params, lr, ah, found_inf,
                   ema_decay);
  }
}

const bool registered = set_kind_run("muon", &run);

}  // namespace
}  // namespace detail
}  // namespace fusetrain
