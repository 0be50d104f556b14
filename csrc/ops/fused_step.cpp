// fusetrain::fused_step_ — the whole tail of an optimizer step for every param
// group of one optimizer, written once for the Python and C++ front ends:
//   1. the read-only stats pass (grad_stats per device; the global norm over
//      every group and device, the non-finite flag) when a group clips or the
//      gradients are loss-scaled without a flag from the caller;
//   2. the results into the caller's persistent buffers (NOTE [persistent step
//      results] in python/fusetrain/training/step.py);
//   3. one update pass per group (and per master-weight partition) through the
//      optimizer kind's entry in the kind table (kind_registry.h), with
//      unscaling, clipping, the non-finite skip and the EMA folded in.
// It holds no kernel: each group's update takes its device's kernel, so it is
// registered once, for every backend.
#include <ATen/TensorOperators.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/maximum.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "capture.h"
#include "fusetrain/ops.h"
#include "kind_registry.h"

namespace fusetrain {
namespace detail {
namespace {

// NOTE [group records]: `hyper` holds one record per group: kCommon fields,
//   max_grad_norm (<= 0: no clipping), master_weights, has_ema, maximize
// (flags as 0 or 1; master_weights 0 none, 1 float32 masters, 2 int16
// remainders, 3 stochastic rounding: NOTE [lean state] in
// csrc/common/lean_state.h), then the optimizer's own fields, in the order of
// its entry in the kind table (NOTE [kind table] in kind_registry.h; listed in
// docs/ops.md). The state lists hold entries only for the groups whose entry
// keeps them (e.g. adam's state3 = max_exp_avg_sq for amsgrad groups);
// master_params one per float16/bfloat16 param of a group with masters (1 or
// 2); ema_params one per param of a has_ema group. With `group_values` (one per
// group, of a kind with schedulable fields) the kernels read those fields from
// the group's values tensor (NOTE [device values] in
// csrc/common/update_launch.h); the record's copies of them are checked and
// decide which states a group keeps. A values tensor on the CPU for params
// elsewhere is read here, on the host, checked with the record and passed to
// the kernels as its fields (NOTE [compiled settings] in
// python/fusetrain/optim/_group_values.py); one on the params' device is
// read by the kernels. `state_scales` holds the block scales of
// int8 state tensors (NOTE [8-bit state] in csrc/common/lean_state.h): group
// by group, slot by slot (state1, state2, state3), one per param whose state
// tensor in that slot is int8. `ema_remainders`, when not empty, holds one
// int16 tensor per bfloat16 entry of ema_params, in order (NOTE [ema
// remainder]); the element-wise kinds take them. `stalled_out`, a 0-d
// int64 tensor on the params' device, gets the step's stalled updates added
// (NOTE [stalled updates] in csrc/common/lean_state.h; element-wise kinds).
constexpr int kCommon = 4;

// One group's slices of the flattened lists (views, no copies).
struct Lists {
  at::TensorList params, grads, steps, s[3], masters, emas;
  std::vector<at::Tensor> scales[3];  // per param of an int8 state slot; undefined elsewhere
  std::vector<at::Tensor> ema_rems;   // per ema entry with a remainder; undefined elsewhere
};

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
                     const std::optional<at::Tensor>& grad_norm,
                     const std::optional<at::TensorList>& group_values_arg,
                     const std::optional<at::TensorList>& state_scales,
                     const std::optional<at::TensorList>& ema_remainders,
                     const std::optional<at::Tensor>& stalled_out) {
  // NOTE [below autograd]: the ops this step calls go straight to their CPU or
  // CUDA kernels. The dispatcher would otherwise send each through the boxed
  // autograd fallback (no fusetrain op has an autograd formula), which copies
  // every tensor list into IValues and back, per call: a few microseconds per
  // hundred tensors, on every step. fused_step_ itself passed that fallback once.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const KindSpec& spec = find_kind(std::string(optimizer));
  const size_t fields = kCommon + spec.fields.size();
  const size_t groups = group_sizes.size();
  TORCH_CHECK_VALUE(lrs.size() == groups, "fused_step_: got ", groups, " group_sizes but ", lrs.size(), " lrs");
  TORCH_CHECK_VALUE(hyper.size() == groups * fields, "fused_step_: optimizer '", optimizer, "' takes ", fields,
                    " hyper values per group (", groups, " groups), got ", hyper.size());
  TORCH_CHECK_VALUE(grads.size() == params.size() && state_steps.size() == params.size(), "fused_step_: got ",
                    params.size(), " params, ", grads.size(), " grads and ", state_steps.size(), " state_steps");
  TORCH_CHECK_VALUE(!ema_decay.has_value() || ema_decay->defined(), "fused_step_: ema_decay is undefined");
  const at::TensorList group_values = group_values_arg.has_value() ? *group_values_arg : at::TensorList();
  const size_t n_values = spec.value_positions.size();
  TORCH_CHECK_VALUE(group_values.empty() || (n_values > 0 && group_values.size() == groups), "fused_step_: ",
                    n_values > 0 ? "group_values must hold one tensor per group (" + std::to_string(groups) + "), got " +
                                       std::to_string(group_values.size())
                                 : "optimizer '" + std::string(spec.name) + "' has no schedulable fields, but got " +
                                       std::to_string(group_values.size()) + " group_values");
  for (const auto& v : group_values)
    TORCH_CHECK_VALUE(v.defined() && v.scalar_type() == at::kDouble && v.dim() == 1 &&
                          static_cast<size_t>(v.numel()) == n_values && v.is_contiguous(),
                      "fused_step_: each of group_values must be a contiguous float64 vector of ", n_values,
                      " values (optimizer '", spec.name, "'), got ", v.defined() ? v.toString() : "undefined",
                      v.defined() ? " of shape " + c10::str(v.sizes()) : "");
  TORCH_CHECK_VALUE(!stalled_out.has_value() || (stalled_out->defined() && stalled_out->numel() == 1 &&
                                                 stalled_out->scalar_type() == at::kLong),
                    "fused_step_: stalled_out must be an int64 tensor with one element");
  TORCH_CHECK_VALUE(!stalled_out.has_value() || spec.lean, "fused_step_: optimizer '", spec.name, "' does not "
                    "count stalled updates (the element-wise optimizers do; NOTE [stalled updates])");
  for (size_t i = 0; stalled_out.has_value() && i < params.size(); ++i)
    TORCH_CHECK_VALUE(params[i].device() == stalled_out->device(), "fused_step_: stalled_out is on ",
                      stalled_out->device(), " but params[", i, "] is on ", params[i].device(),
                      "; count on the params' device");
  TORCH_CHECK_VALUE(!grad_norm.has_value() || (grad_norm->defined() && grad_norm->numel() == 1 &&
                                               grad_norm->scalar_type() == at::kFloat),
                    "fused_step_: grad_norm must be a float32 tensor with one element");

  // Every group's record (with the values a CPU values tensor holds) is checked before anything is written.
  std::vector<std::vector<double>> host_records(groups);  // per group read from a CPU values tensor, else empty
  auto own_fields = [&](size_t g) -> const double* {
    return host_records[g].empty() ? hyper.data() + g * fields + kCommon : host_records[g].data();
  };
  bool clips = false;
  size_t first = 0;  // the group's first param
  const at::TensorList states[3] = {state1, state2, state3};
  size_t state_pos[3] = {0, 0, 0};
  size_t n_scales = 0;  // state_scales the int8 states use (NOTE [group records])
  const at::TensorList ema_rems = ema_remainders.has_value() ? *ema_remainders : at::TensorList();
  size_t ema_pos = 0, n_ema_rems = 0;  // ema_remainders the bfloat16 EMA tensors use
  for (size_t g = 0; g < groups; ++g) {
    const double* f = hyper.data() + g * fields;
    const std::string where = "fused_step_ (" + std::string(spec.name) + ", group " + std::to_string(g) + ")";
    const size_t size = group_sizes[g] > 0 ? static_cast<size_t>(group_sizes[g]) : 0;
    const at::TensorList group_params = params.slice(std::min(first, params.size()),
                                                     std::min(size, params.size() - std::min(first, params.size())));
    if (!group_values.empty() && group_values[g].is_cpu()) {
      TORCH_CHECK_VALUE(group_params.empty() || !stream_is_capturing(group_params[0].device()), where,
                        ": group_values is on the CPU, but a CUDA graph is being captured: the graph would keep its "
                        "values; give it on ", group_params[0].device());
      host_records[g].assign(f + kCommon, f + fields);
      const double* v = group_values[g].data_ptr<double>();
      for (size_t k = 0; k < n_values; ++k) host_records[g][spec.value_positions[k]] = v[k];
    }
    spec.check(where, own_fields(g));
    spec.check_params(where, own_fields(g), group_params);
    TORCH_CHECK_VALUE(f[1] == 0.0 || f[1] == 1.0 || f[1] == 2.0 || f[1] == 3.0, where,
                      ": master_weights must be 0 (none), 1 (float32), 2 (remainder) or 3 (stochastic), got ", f[1]);
    TORCH_CHECK_VALUE(f[1] < 2.0 || spec.lean, where, ": master_weights ", f[1] == 2.0 ? "remainder" : "stochastic",
                      " is for the element-wise optimizers (NOTE [lean state])");
    for (size_t i = first; f[1] >= 2.0 && i < std::min(first + size, params.size()); ++i) {
      TORCH_CHECK_VALUE(params[i].scalar_type() != at::kHalf, where, ": params[", i, "] is float16 but the group's "
                        "master_weights are ", f[1] == 2.0 ? "remainders" : "stochastic",
                        ", which keep bfloat16 params (use float32 masters for float16)");
    }
    for (int k = 0; k < 3; ++k) {
      if (!spec.uses_slot(own_fields(g), k)) continue;
      for (size_t i = state_pos[k]; i < std::min(state_pos[k] + size, states[k].size()); ++i)
        n_scales += states[k][i].defined() && states[k][i].scalar_type() == at::kChar;
      state_pos[k] += size;
    }
    if (f[2] != 0.0 && !ema_rems.empty()) {
      size_t bf16 = 0;
      for (size_t i = ema_pos; i < std::min(ema_pos + size, ema_params.size()); ++i)
        bf16 += ema_params[i].scalar_type() == at::kBFloat16;
      TORCH_CHECK_VALUE(bf16 == 0 || spec.lean, where, ": EMA remainders are for the element-wise optimizers "
                        "(NOTE [ema remainder] in csrc/common/lean_state.h)");
      n_ema_rems += bf16;
    }
    if (f[2] != 0.0) ema_pos += size;
    first += size;
    clips = clips || f[0] > 0.0;
  }
  TORCH_CHECK_VALUE(ema_rems.empty() || ema_rems.size() == n_ema_rems, "fused_step_: ema_remainders has ",
                    ema_rems.size(), " tensors but the bfloat16 EMA tensors need ", n_ema_rems, " (one each, or "
                    "none; NOTE [group records] in csrc/ops/fused_step.cpp)");
  const size_t given_scales = state_scales.has_value() ? state_scales->size() : 0;
  TORCH_CHECK_VALUE(given_scales == n_scales, "fused_step_: state_scales has ", given_scales, " tensors but the "
                    "int8 state tensors need ", n_scales, " (one per int8 state; NOTE [group records] in "
                    "csrc/ops/fused_step.cpp)");

  // 1. Stats pass: the norm for clipping (unless the caller measured it), the
  // flag for an unscaled step.
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
  Cursor qc{state_scales.has_value() ? *state_scales : at::TensorList(), "state_scales"};
  Cursor rc{ema_rems, "ema_remainders"};
  for (size_t g = 0; g < groups; ++g) {
    const double* f = hyper.data() + g * fields;
    TORCH_CHECK_VALUE(group_sizes[g] >= 0, "fused_step_: group_sizes[", g, "] is negative");
    const size_t n = static_cast<size_t>(group_sizes[g]);
    Lists l;
    l.params = pc.take(n);
    l.grads = gc.take(n);
    l.steps = tc.take(n);
    for (int k = 0; k < 3; ++k) {
      l.s[k] = sc[k].take(spec.uses_slot(own_fields(g), k) ? n : 0);
      size_t q8 = 0;
      for (const auto& t : l.s[k]) q8 += t.defined() && t.scalar_type() == at::kChar;
      const at::TensorList taken = qc.take(q8);
      size_t next = 0;
      for (const auto& t : l.s[k])
        l.scales[k].push_back(t.defined() && t.scalar_type() == at::kChar ? taken[next++] : at::Tensor());
    }
    const bool has_ema = f[2] != 0.0;
    l.emas = ec.take(has_ema ? n : 0);
    if (!ema_rems.empty()) {
      size_t bf16 = 0;
      for (const auto& e : l.emas) bf16 += e.scalar_type() == at::kBFloat16;
      const at::TensorList taken = rc.take(bf16);
      size_t next = 0;
      for (const auto& e : l.emas)
        l.ema_rems.push_back(e.scalar_type() == at::kBFloat16 ? taken[next++] : at::Tensor());
    }
    const auto mode = static_cast<MasterMode>(static_cast<int>(f[1]));
    std::vector<size_t> low, full;
    for (size_t i = 0; i < n; ++i) {
      const auto t = l.params[i].scalar_type();
      (t == at::kHalf || t == at::kBFloat16 ? low : full).push_back(i);
    }
    const bool masters = (mode == MasterMode::Full || mode == MasterMode::Remainder) && !low.empty();
    l.masters = mc.take(masters ? low.size() : 0);
    if (n == 0) continue;

    const at::Device dev = l.params[0].device();
    const at::Tensor lr = lrs[g].device() == dev && lrs[g].scalar_type() == at::kFloat
                              ? lrs[g]
                              : lrs[g].to(dev, at::kFloat);
    KindCall call;
    call.spec = &spec;
    call.fields = own_fields(g);
    call.kernel = update_kernel(dev.type());
    call.lr = lr;
    if (!group_values.empty() && host_records[g].empty())
      call.values = group_values[g].device() == dev ? group_values[g] : group_values[g].to(dev);
    call.maximize = f[3] != 0.0;
    call.master_mode = mode;
    call.inv_scale = on(inv_scale.has_value() ? *inv_scale : at::Tensor(), dev);
    call.found_inf = on(flag, dev);
    call.max_grad_norm = f[0] > 0.0 ? f[0] : 0.0;
    if (stalled_out.has_value()) call.stalled = *stalled_out;
    if (f[0] > 0.0) call.grad_norm = on(norm, dev);
    if (has_ema) {
      TORCH_CHECK_VALUE(ema_decay.has_value(), "fused_step_: group ", g, " has EMA tensors but no ema_decay");
      call.ema_decay = on(*ema_decay, dev);
    }
    auto run = [&](const Lists& part) {
      call.params = part.params;
      call.grads = part.grads;
      call.steps = part.steps;
      for (int k = 0; k < 3; ++k) {
        call.state[k] = part.s[k];
        call.scales[k] = part.scales[k];
      }
      call.masters = part.masters;
      call.emas = part.emas;
      call.ema_rems = part.ema_rems;
      run_kind(call);
    };
    if (!masters || full.empty()) {
      run(l);
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
      for (int k = 0; k < 3; ++k) {
        part.s[k] = pick(l.s[k], v[3 + k]);
        if (!l.scales[k].empty())
          for (size_t i : *idx) part.scales[k].push_back(l.scales[k][i]);
      }
      part.emas = pick(l.emas, v[6]);
      if (!l.ema_rems.empty())
        for (size_t i : *idx) part.ema_rems.push_back(l.ema_rems[i]);
      if (idx == &low) part.masters = l.masters;
      run(part);
    }
  }
  pc.expect_done();
  for (const auto& c : sc) c.expect_done();
  mc.expect_done();
  ec.expect_done();
  qc.expect_done();
  rc.expect_done();
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
      "Tensor(i!)? found_inf_out=None, Tensor? grad_norm=None, Tensor[]? group_values=None, "
      "Tensor(j!)[]? state_scales=None, Tensor(k!)[]? ema_remainders=None, Tensor(l!)? stalled_out=None) -> ()");
}

// Composite: the update and stats ops it calls dispatch per device.
TORCH_LIBRARY_IMPL(fusetrain, CompositeExplicitAutograd, m) {
  m.impl("fused_step_", &fusetrain::detail::fused_step_impl);
}
