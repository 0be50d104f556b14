// fusetrain::fused_muon_ — Muon (torch.optim.Muon's update) over lists of
// matrix and convolution params, batched across params of one shape, with
// unscale, clip, the non-finite skip, master weights and EMA folded in.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "../common/update_args.h"

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
//   3. apply (the fused update kernel, kind Muon): p = p * (1 - lr * wd)
//      - lr * ratio * O with the skip, master weights and EMA in one pass.
//      Its step counter counts the steps taken (the update does not read it).
// Gradient unscaling and clipping act in stage 1 (before the momentum, as
// torch's GradScaler.unscale_ and clip_grad_norm_ would); stage 3 gets only
// the skip flag.

// The multiplier of every gradient element as a 0-d device tensor (undefined
// for 1): grad_multiplier of optim_math.h, in float32.
at::Tensor grad_multiplier_tensor(const OptT& inv_scale, const OptT& grad_norm, double max_grad_norm) {
  at::Tensor m;
  if (inv_scale.has_value()) m = *inv_scale;
  if (grad_norm.has_value() && max_grad_norm > 0.0) {
    at::Tensor coef = at::full({}, max_grad_norm, grad_norm->options()).div_(*grad_norm + 1e-6).clamp_max_(1.0);
    m = m.defined() ? m * coef : coef;
  }
  return m;
}

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

void check_device_scalar(const char* op, const char* name, const OptT& t, const at::Device& dev) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->defined() && t->numel() == 1 && t->scalar_type() == at::kFloat, op, ": ", name,
              " must be a float32 tensor with one element");
  TORCH_CHECK(t->device() == dev, op, ": ", name, " is on ", t->device(), " but params are on ", dev);
}

}  // namespace

void fused_muon_impl(UpdateKernel kernel, at::TensorList params, at::TensorList grads,
                     at::TensorList momentum_buffers, at::TensorList state_steps, at::TensorList master_params,
                     at::TensorList ema_params, const at::Tensor& lr, double momentum, bool nesterov, double weight_decay,
                     at::ArrayRef<double> ns_coefficients, double eps, int64_t ns_steps,
                     c10::string_view adjust_lr_fn, const OptT& inv_scale, const OptT& found_inf,
                     const OptT& grad_norm, double max_grad_norm, const OptT& ema_decay) {
  const char* op = "fused_muon_";
  const std::string adjust(adjust_lr_fn);
  TORCH_CHECK(momentum >= 0.0, op, ": momentum must be >= 0, got ", momentum);
  TORCH_CHECK(weight_decay >= 0.0, op, ": weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  TORCH_CHECK(ns_coefficients.size() == 3, op, ": ns_coefficients must hold 3 values (a, b, c), got ",
              ns_coefficients.size());
  TORCH_CHECK(ns_steps >= 0 && ns_steps < 100, op, ": ns_steps must be in [0, 100), got ", ns_steps);
  TORCH_CHECK(adjust == "original" || adjust == "match_rms_adamw", op,
              ": adjust_lr_fn must be 'original' or 'match_rms_adamw', got '", adjust, "'");
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && momentum_buffers.size() == n && state_steps.size() == n, op, ": got ", n,
              " params, ", grads.size(), " grads, ", momentum_buffers.size(), " momentum_buffers and ",
              state_steps.size(), " state_steps");
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
  // Batches: params whose matrices share (rows, cols) and whose state shares a dtype.
  std::map<std::tuple<int64_t, int64_t, int>, std::vector<size_t>> batches;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.defined(), op, ": params[", i, "] is undefined");
    TORCH_CHECK(p.dim() >= 2, op, ": params[", i, "] has shape ", p.sizes(),
                "; Muon updates matrices and convolution filters (2 or more dims): give 1-D params to AdamW");
    TORCH_CHECK(!p.is_complex(), op, ": params[", i, "] is complex; Muon does not support complex params");
    TORCH_CHECK(p.device() == dev, op, ": params[", i, "] is on ", p.device(), " but params[0] is on ", dev);
    const at::Tensor& g = grads[i];
    TORCH_CHECK(g.defined() && g.layout() == at::kStrided, op, ": grads[", i, "] must be a dense tensor");
    TORCH_CHECK(g.is_floating_point(), op, ": grads[", i, "] has dtype ", g.scalar_type(),
                "; supported: float32, float16, bfloat16, float64");
    TORCH_CHECK(g.sizes() == p.sizes(), op, ": grads[", i, "] has shape ", g.sizes(), " but params[", i,
                "] has shape ", p.sizes());
    TORCH_CHECK(g.device() == dev, op, ": params[", i, "] is on ", dev, " but grads[", i, "] is on ", g.device());
    const at::ScalarType sd = p.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const at::Tensor& b = momentum_buffers[i];
    TORCH_CHECK(b.defined(), op, ": momentum_buffers[", i, "] is undefined");
    TORCH_CHECK(b.sizes() == p.sizes() && b.scalar_type() == sd && b.device() == dev, op, ": momentum_buffers[",
                i, "] must be a ", sd, " tensor of shape ", p.sizes(), " on ", dev, ", got ", b.scalar_type(),
                " of shape ", b.sizes(), " on ", b.device());
    // A convolution filter is the matrix out_channels x (in_channels * kernel size).
    const int64_t rows = p.size(0);
    const int64_t cols = c10::multiply_integers(p.sizes().slice(1));
    batches[{rows, cols, static_cast<int>(sd)}].push_back(i);
  }

  const at::Tensor mult = grad_multiplier_tensor(inv_scale, grad_norm, max_grad_norm);
  // The momentum's lerp weight: 1 - momentum, or 0 on a skipped step (NOTE [muon apply]).
  at::Tensor keep;
  if (found_inf.has_value()) keep = at::rsub(*found_inf, 1.0);
  std::map<int, at::Tensor> weights;
  const at::Tensor ema_dec = opt_or_undef(ema_decay);
  const at::Tensor flag = opt_or_undef(found_inf);

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
      at::Tensor g = grads[i].to(sd);
      if (mult.defined()) g = g * mult;
      if (keep.defined()) g = at::nan_to_num(g, 0.0, 0.0, 0.0);
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
    UpdateLists l;
    for (size_t k = 0; k < idx.size(); ++k) {
      const size_t i = idx[k];
      l.params.push_back(params[i]);
      l.grads.push_back(ortho[k].view(params[i].sizes()));
      l.steps.push_back(state_steps[i]);
      if (!master_params.empty()) l.master.push_back(master_params[i]);
      if (!ema_params.empty()) l.ema.push_back(ema_params[i]);
    }
    OptimHyper h;
    h.kind = OptimKind::Muon;
    h.muon = MuonHyper{weight_decay, lr_ratio(adjust, rows, cols)};
    run_fused_update(op, l, h, UpdateScalars{lr, at::Tensor(), flag, at::Tensor(), ema_dec}, kernel);
  }
}

}  // namespace detail
}  // namespace fusetrain

TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  m.def(
      "fused_muon_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor(e!)[] state_steps, "
      "Tensor(f!)[] master_params, Tensor(g!)[] ema_params, *, Tensor lr, float momentum, bool nesterov, "
      "float weight_decay, float[] ns_coefficients, float eps, int ns_steps, str adjust_lr_fn, "
      "Tensor? inv_scale=None, Tensor? found_inf=None, Tensor? grad_norm=None, float max_grad_norm=0.0, "
      "Tensor? ema_decay=None) -> ()");
}
