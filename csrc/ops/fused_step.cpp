// fusetrain::fused_step_ — the whole tail of an optimizer step for every param
// group of one optimizer, written once for the Python and C++ front ends:
//   1. the read-only stats pass (grad_stats per device; the global norm over
//      every group and device, the non-finite flag) when a group clips or the
//      gradients are loss-scaled without a flag from the caller;
//   2. the results into the caller's persistent buffers (NOTE [persistent step
//      results] in python/fusetrain/training/step.py);
//   3. one update pass per group (and per master-weight partition) through the
//      optimizer's update op, with unscaling, clipping, the non-finite skip and
//      the EMA folded in.
// It holds no kernel: the ops it calls dispatch on each group's device, so it
// is registered once, for every backend.
#include <ATen/TensorOperators.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/maximum.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "fusetrain/ops.h"

namespace fusetrain {
namespace detail {
namespace {

// NOTE [group records]: `hyper` holds one record per group: kCommon fields,
// then the optimizer's own fields (flags as 0 or 1):
//   common: max_grad_norm (<= 0: no clipping), master_weights, has_ema, maximize
//   adam:   beta1, beta2, weight_decay, eps, amsgrad, decoupled_weight_decay, bias_correction
//   sgd:    momentum, dampening, weight_decay, nesterov
//   lion:   beta1, beta2, weight_decay
//   rmsprop: alpha, eps, weight_decay, momentum, centered, tf_style, lr_in_momentum, decoupled_weight_decay
//   adadelta: rho, eps, weight_decay
//   radam:  beta1, beta2, eps, weight_decay, decoupled_weight_decay
//   nadam:  beta1, beta2, eps, weight_decay, momentum_decay, decoupled_weight_decay (state3 = mu_product, 0-d)
//   lamb:   beta1, beta2, eps, weight_decay, bias_correction, grad_averaging, trust_clip, always_adapt, caution,
//           decoupled_weight_decay, decay_max_lr
//   adamp:  beta1, beta2, eps, weight_decay, delta, wd_ratio, nesterov
//   muon:   use_muon, momentum, nesterov, weight_decay, ns_a, ns_b, ns_c, ns_eps, ns_steps, match_rms_adamw,
//           beta1, beta2, eps (NOTE [muon groups])
// The state lists hold entries only for the groups that use them (adam's state3
// = max_exp_avg_sq for amsgrad groups, sgd's state1 = momentum_buffer for groups
// with momentum != 0; rmsprop's state2 = momentum_buffer for momentum > 0 and
// state3 = grad_avg for centered groups); master_params one per float16/bfloat16 param of a
// master_weights group; ema_params one per param of a has_ema group.
//
// NOTE [muon groups]: a Muon optimizer holds two kinds of groups: use_muon
// groups (matrices and convolution filters: fused_muon_, state1 =
// momentum_buffer) and the others (AdamW with the group's lr and
// weight_decay, beta1, beta2 and eps: state1 = exp_avg, state2 = exp_avg_sq).
// Both take the one global norm and non-finite flag of the stats pass.
constexpr int kCommon = 4;
enum class Kind { Adam, SGD, Lion, RMSprop, Adadelta, RAdam, NAdam, Lamb, AdamP, Muon };

struct KindInfo {
  Kind kind;
  int fields;
};

KindInfo kind_info(const std::string& name) {
  if (name == "adam") return {Kind::Adam, kCommon + 7};
  if (name == "sgd") return {Kind::SGD, kCommon + 4};
  if (name == "lion") return {Kind::Lion, kCommon + 3};
  if (name == "rmsprop") return {Kind::RMSprop, kCommon + 8};
  if (name == "adadelta") return {Kind::Adadelta, kCommon + 3};
  if (name == "radam") return {Kind::RAdam, kCommon + 5};
  if (name == "nadam") return {Kind::NAdam, kCommon + 6};
  if (name == "lamb") return {Kind::Lamb, kCommon + 11};
  if (name == "adamp") return {Kind::AdamP, kCommon + 7};
  if (name == "muon") return {Kind::Muon, kCommon + 13};
  TORCH_CHECK_VALUE(false, "fused_step_: optimizer must be one of 'adam', 'sgd', 'lion', 'rmsprop', 'adadelta', "
                    "'radam', 'nadam', 'lamb', 'adamp', 'muon', got '", name, "'");
}

// Whether a group of this kind keeps state list k (0..2).
bool uses_state(Kind kind, const double* f, int k) {
  switch (kind) {
    case Kind::Adam:
      return k < 2 || f[kCommon + 4] != 0.0;
    case Kind::SGD:
      return k == 0 && f[kCommon] != 0.0;
    case Kind::Lion:
      return k == 0;
    case Kind::RMSprop:
      return k == 0 || (k == 1 && f[kCommon + 3] > 0.0) || (k == 2 && f[kCommon + 4] != 0.0);
    case Kind::Adadelta:
    case Kind::RAdam:
    case Kind::Lamb:
    case Kind::AdamP:
      return k < 2;
    case Kind::NAdam:
      return true;
    case Kind::Muon:
      return f[kCommon] != 0.0 ? k == 0 : k < 2;
  }
  return false;
}

// One group's slices of the flattened lists (views, no copies).
struct Lists {
  at::TensorList params, grads, steps, s[3], masters, emas;
};

void call_update(Kind kind, const Lists& l, const at::Tensor& lr, const double* f, const FusedTail& tail) {
  const bool maximize = f[3] != 0.0;
  const double* k = f + kCommon;
  switch (kind) {
    case Kind::Adam:
      fused_adam_(l.params, l.grads, l.s[0], l.s[1], l.s[2], l.steps, l.masters, l.emas, lr, k[0], k[1], k[2], k[3],
                  k[4] != 0.0, maximize, k[5] != 0.0, tail, k[6] != 0.0);
      break;
    case Kind::SGD:
      fused_sgd_(l.params, l.grads, l.s[0], l.steps, l.masters, l.emas, lr, k[0], k[1], k[2], k[3] != 0.0, maximize,
                 tail);
      break;
    case Kind::Lion:
      fused_lion_(l.params, l.grads, l.s[0], l.steps, l.masters, l.emas, lr, k[0], k[1], k[2], maximize, tail);
      break;
    case Kind::RMSprop:
      fused_rmsprop_(l.params, l.grads, l.s[0], l.s[1], l.s[2], l.steps, l.masters, l.emas, lr, k[0], k[1], k[2],
                     k[3], k[4] != 0.0, maximize, tail, RMSpropTFForm{k[5] != 0.0, k[6] != 0.0, k[7] != 0.0});
      break;
    case Kind::Adadelta:
      fused_adadelta_(l.params, l.grads, l.s[0], l.s[1], l.steps, l.masters, l.emas, lr, k[0], k[1], k[2], maximize,
                      tail);
      break;
    case Kind::RAdam:
      fused_radam_(l.params, l.grads, l.s[0], l.s[1], l.steps, l.masters, l.emas, lr, k[0], k[1], k[2], k[3],
                   k[4] != 0.0, maximize, tail);
      break;
    case Kind::NAdam:
      fused_nadam_(l.params, l.grads, l.s[0], l.s[1], l.s[2], l.steps, l.masters, l.emas, lr, k[0], k[1], k[2], k[3],
                   k[4], k[5] != 0.0, maximize, tail);
      break;
    case Kind::Lamb:
      fused_lamb_(l.params, l.grads, l.s[0], l.s[1], l.steps, l.masters, l.emas, lr, k[0], k[1], k[2], k[3],
                  maximize, tail, LambForm{k[4] != 0.0, k[5] != 0.0, k[6] != 0.0, k[7] != 0.0, k[8] != 0.0,
                                           k[9] != 0.0, k[10]});
      break;
    case Kind::AdamP:
      fused_adamp_(l.params, l.grads, l.s[0], l.s[1], l.steps, l.masters, l.emas, lr, k[0], k[1], k[2], k[3], k[4],
                   k[5], k[6] != 0.0, maximize, tail);
      break;
    case Kind::Muon:  // NOTE [muon groups]
      if (k[0] != 0.0) {
        fused_muon_(l.params, l.grads, l.s[0], l.steps, l.masters, l.emas, lr, k[1], k[2] != 0.0, k[3],
                    {k[4], k[5], k[6]}, k[7], static_cast<int64_t>(k[8]), k[9] != 0.0 ? "match_rms_adamw" : "original",
                    tail);
      } else {
        fused_adam_(l.params, l.grads, l.s[0], l.s[1], {}, l.steps, l.masters, l.emas, lr, k[10], k[11], k[3],
                    k[12], /*amsgrad=*/false, maximize, /*decoupled_weight_decay=*/true, tail);
      }
      break;
  }
}

// Takes the next `n` entries of a flattened list.
struct Cursor {
  at::TensorList list;
  const char* name;
  size_t pos = 0;
  at::TensorList take(size_t n) {
    TORCH_CHECK_VALUE(pos + n <= list.size(), "fused_step_: ", name, " has ", list.size(),
                      " tensors, fewer than the group records need");
    at::TensorList out = list.slice(pos, n);
    pos += n;
    return out;
  }
  void expect_done() const {
    TORCH_CHECK_VALUE(pos == list.size(), "fused_step_: ", name, " has ", list.size(), " tensors but the group "
                      "records use ", pos, " (NOTE [group records] in csrc/ops/fused_step.cpp)");
  }
};

// The global L2 norm of every gradient (unscaled by inv_scale) and the
// non-finite flag, on the first gradient's device.
std::tuple<at::Tensor, at::Tensor> global_stats(at::TensorList grads, const std::optional<at::Tensor>& inv_scale) {
  const bool one_device = std::all_of(grads.begin(), grads.end(),
                                      [&](const at::Tensor& g) { return g.device() == grads[0].device(); });
  if (one_device) return grad_stats(grads, inv_scale);
  std::vector<std::string> order;
  std::map<std::string, std::vector<at::Tensor>> by_device;
  for (const auto& g : grads) {
    const auto key = g.device().str();
    if (!by_device.count(key)) order.push_back(key);
    by_device[key].push_back(g);
  }
  const auto dev0 = grads[0].device();
  at::Tensor sq, flag;
  for (const auto& key : order) {
    const auto& gs = by_device[key];
    std::optional<at::Tensor> inv;
    if (inv_scale) inv = inv_scale->to(gs.front().device());
    auto [n, f] = grad_stats(gs, inv);
    n = n.to(dev0);
    f = f.to(dev0);
    sq = sq.defined() ? sq + n * n : n * n;
    flag = flag.defined() ? at::maximum(flag, f) : f;
  }
  return {sq.sqrt(), flag};
}

std::optional<at::Tensor> on(const at::Tensor& t, const at::Device& dev) {
  if (!t.defined()) return std::nullopt;
  return t.device() == dev ? t : t.to(dev);
}

void fused_step_impl(c10::string_view optimizer, at::TensorList params, at::TensorList grads,
                     at::TensorList state_steps, at::TensorList state1, at::TensorList state2, at::TensorList state3,
                     at::TensorList master_params, at::TensorList ema_params, at::IntArrayRef group_sizes,
                     at::TensorList lrs, at::ArrayRef<double> hyper, const std::optional<at::Tensor>& inv_scale,
                     const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& ema_decay,
                     const std::optional<at::Tensor>& grad_norm_out, const std::optional<at::Tensor>& found_inf_out,
                     const std::optional<at::Tensor>& grad_norm) {
  // NOTE [below autograd]: the ops this step calls go straight to their CPU or
  // CUDA kernels. The dispatcher would otherwise send each through the boxed
  // autograd fallback (no fusetrain op has an autograd formula), which copies
  // every tensor list into IValues and back, per call: a few microseconds per
  // hundred tensors, on every step. fused_step_ itself passed that fallback once.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const KindInfo info = kind_info(std::string(optimizer));
  const size_t groups = group_sizes.size();
  TORCH_CHECK_VALUE(lrs.size() == groups, "fused_step_: got ", groups, " group_sizes but ", lrs.size(), " lrs");
  TORCH_CHECK_VALUE(hyper.size() == groups * info.fields, "fused_step_: optimizer '", optimizer, "' takes ",
                    info.fields, " hyper values per group (", groups, " groups), got ", hyper.size());
  TORCH_CHECK_VALUE(grads.size() == params.size() && state_steps.size() == params.size(), "fused_step_: got ",
                    params.size(), " params, ", grads.size(), " grads and ", state_steps.size(), " state_steps");
  TORCH_CHECK_VALUE(!ema_decay.has_value() || ema_decay->defined(), "fused_step_: ema_decay is undefined");
  TORCH_CHECK_VALUE(!grad_norm.has_value() || (grad_norm->defined() && grad_norm->numel() == 1 &&
                                               grad_norm->scalar_type() == at::kFloat),
                    "fused_step_: grad_norm must be a float32 tensor with one element");

  // 1. Stats pass: the norm for clipping (unless the caller measured it), the
  // flag for an unscaled step.
  bool clips = false;
  for (size_t g = 0; g < groups; ++g) clips = clips || hyper[g * info.fields] > 0.0;
  const bool measure =
      !params.empty() && ((clips && !grad_norm.has_value()) || (inv_scale.has_value() && !found_inf.has_value()));
  at::Tensor norm = grad_norm.has_value() ? grad_norm->reshape({}) : at::Tensor();
  at::Tensor flag = found_inf.has_value() ? *found_inf : at::Tensor();
  if (measure) {
    auto [n, f] = global_stats(grads, inv_scale);
    if (!norm.defined()) norm = n;
    flag = flag.defined() ? at::maximum(flag.to(f.device()), f) : f;
  }
  // 2. Results the host may read after the step (NaN: no norm was measured).
  if (grad_norm_out.has_value()) {
    if (norm.defined()) {
      grad_norm_out->copy_(norm);
    } else {
      grad_norm_out->fill_(std::numeric_limits<double>::quiet_NaN());
    }
  }
  if (found_inf_out.has_value()) {
    if (flag.defined()) {
      found_inf_out->copy_(flag);
    } else {
      found_inf_out->zero_();
    }
  }

  // 3. One update pass per group (two when only some params have masters).
  Cursor pc{params, "params"}, gc{grads, "grads"}, tc{state_steps, "state_steps"};
  Cursor sc[3] = {{state1, "state1"}, {state2, "state2"}, {state3, "state3"}};
  Cursor mc{master_params, "master_params"}, ec{ema_params, "ema_params"};
  for (size_t g = 0; g < groups; ++g) {
    const double* f = hyper.data() + g * info.fields;
    TORCH_CHECK_VALUE(group_sizes[g] >= 0, "fused_step_: group_sizes[", g, "] is negative");
    const size_t n = static_cast<size_t>(group_sizes[g]);
    Lists l;
    l.params = pc.take(n);
    l.grads = gc.take(n);
    l.steps = tc.take(n);
    for (int k = 0; k < 3; ++k) l.s[k] = sc[k].take(uses_state(info.kind, f, k) ? n : 0);
    const bool has_ema = f[2] != 0.0;
    l.emas = ec.take(has_ema ? n : 0);
    std::vector<size_t> low, full;
    for (size_t i = 0; i < n; ++i) {
      const auto t = l.params[i].scalar_type();
      (t == at::kHalf || t == at::kBFloat16 ? low : full).push_back(i);
    }
    const bool masters = f[1] != 0.0 && !low.empty();
    l.masters = mc.take(masters ? low.size() : 0);
    if (n == 0) continue;

    const at::Device dev = l.params[0].device();
    const at::Tensor lr = lrs[g].device() == dev && lrs[g].scalar_type() == at::kFloat
                              ? lrs[g]
                              : lrs[g].to(dev, at::kFloat);
    FusedTail tail;
    tail.inv_scale = on(inv_scale.has_value() ? *inv_scale : at::Tensor(), dev);
    tail.found_inf = on(flag, dev);
    tail.max_grad_norm = f[0] > 0.0 ? f[0] : 0.0;
    if (f[0] > 0.0) tail.grad_norm = on(norm, dev);
    if (has_ema) {
      TORCH_CHECK_VALUE(ema_decay.has_value(), "fused_step_: group ", g, " has EMA tensors but no ema_decay");
      tail.ema_decay = on(*ema_decay, dev);
    }
    if (!masters || full.empty()) {
      call_update(info.kind, l, lr, f, tail);
      continue;
    }
    // Float32/float64 params of a master_weights group are updated in place,
    // float16/bfloat16 ones through their fp32 master copy: one call each.
    for (const auto* idx : {&low, &full}) {
      std::vector<at::Tensor> v[7];
      auto pick = [&](at::TensorList from, std::vector<at::Tensor>& out) -> at::TensorList {
        if (!from.empty())
          for (size_t i : *idx) out.push_back(from[i]);
        return out;
      };
      Lists part;
      part.params = pick(l.params, v[0]);
      part.grads = pick(l.grads, v[1]);
      part.steps = pick(l.steps, v[2]);
      for (int k = 0; k < 3; ++k) part.s[k] = pick(l.s[k], v[3 + k]);
      part.emas = pick(l.emas, v[6]);
      if (idx == &low) part.masters = l.masters;
      call_update(info.kind, part, lr, f, tail);
    }
  }
  pc.expect_done();
  for (const auto& c : sc) c.expect_done();
  mc.expect_done();
  ec.expect_done();
}

}  // namespace
}  // namespace detail
}  // namespace fusetrain

TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  m.def(
      "fused_step_(str optimizer, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state_steps, "
      "Tensor(c!)[] state1, Tensor(d!)[] state2, Tensor(e!)[] state3, Tensor(f!)[] master_params, "
      "Tensor(g!)[] ema_params, int[] group_sizes, Tensor[] lrs, float[] hyper, Tensor? inv_scale=None, "
      "Tensor? found_inf=None, Tensor? ema_decay=None, Tensor(h!)? grad_norm_out=None, "
      "Tensor(i!)? found_inf_out=None, Tensor? grad_norm=None) -> ()");
}

// Composite: the update and stats ops it calls dispatch per device.
TORCH_LIBRARY_IMPL(fusetrain, CompositeExplicitAutograd, m) {
  m.impl("fused_step_", &fusetrain::detail::fused_step_impl);
}
