// The EMA bookkeeping that both front ends (fusetrain.ModelEMA,
// fusetrain::ModelEMA) run, written once:
//   fusetrain::ema_decay_ — evaluates the decay schedule for the next update
//     into a device tensor, one launch (no host sync, no recompile when it
//     changes; kernels in csrc/cpu and csrc/cuda/ema_decay_kernel.*);
//   fusetrain::ema_step_ — one EMA update of a set of tensors: floating-point
//     pairs averaged (ema_update_), the rest copied, the update counter
//     advanced, everything gated on the step's non-finite flag on the device.
// ema_step_ is composite: the ops it calls dispatch on the tensors' devices.
#include <ATen/TensorOperators.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/where.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fusetrain/ops.h"

#include "../common/op_kernels.h"

namespace fusetrain {
namespace detail {
namespace {

void check_scalar(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.defined() && t.numel() == 1 && t.scalar_type() == at::kFloat, op, ": ", name,
                    " must be a float32 tensor with one element, got ",
                    t.defined() ? c10::str(t.scalar_type(), " of shape ", t.sizes()) : std::string("undefined"));
}

}  // namespace

// The schedule's checks, then one kernel launch (the math: ema_decay_math in
// csrc/common/optim_math.h).
void ema_decay_impl(EmaDecayKernel kernel, const at::Tensor& decay_out, const at::Tensor& step,
                    const std::optional<at::Tensor>& total_steps, c10::string_view decay_type, double decay,
                    double beta, bool warmup, double warmup_gamma, double warmup_power) {
  const char* op = "ema_decay_";
  check_scalar(op, "decay_out", decay_out);
  check_scalar(op, "step", step);
  TORCH_CHECK_VALUE(step.device() == decay_out.device(), op, ": step is on ", step.device(), " but decay_out is on ",
                    decay_out.device());
  if (total_steps.has_value() && total_steps->defined() && total_steps->device() != decay_out.device()) {
    // NOTE [ema_decay_ devices]: the dispatcher picks the kernel of the device of any tensor argument, the
    // optional total_steps included (a CUDA total_steps beside a CPU decay_out reaches the CUDA kernel). The
    // schedule runs where decay_out is: total_steps is moved there and the op dispatched again.
    check_scalar(op, "total_steps", *total_steps);
    fusetrain::ema_decay_(decay_out, step, total_steps->to(decay_out.device()), decay_type, decay, beta, warmup,
                          warmup_gamma, warmup_power);
    return;
  }
  TORCH_CHECK_VALUE(decay >= 0.0 && decay <= 1.0, op, ": decay must be in [0, 1], got ", decay);
  for (const auto& [name, v] : {std::pair<const char*, double>{"beta", beta}, {"warmup_gamma", warmup_gamma},
                                 {"warmup_power", warmup_power}}) {
    TORCH_CHECK_VALUE(v > 0.0 && std::isfinite(v), op, ": ", name, " must be a finite number > 0, got ", v);
  }
  EmaSchedule s;
  at::Tensor total;
  if (decay_type == "constant") {
    s.type = EmaDecayType::Constant;
  } else if (decay_type == "threshold") {
    s.type = EmaDecayType::Threshold;
  } else if (decay_type == "exp") {
    TORCH_CHECK_VALUE(total_steps.has_value(), op, ": decay_type 'exp' needs total_steps (the run's number of "
                      "optimizer steps); or use decay_type 'constant' or 'threshold'");
    check_scalar(op, "total_steps", *total_steps);
    s.type = EmaDecayType::Exp;
    total = total_steps->to(step.device());
  } else {
    TORCH_CHECK_VALUE(false, op, ": decay_type must be one of 'constant', 'threshold', 'exp', got '", decay_type,
                      "'");
  }
  s.decay = static_cast<float>(decay);
  s.beta = static_cast<float>(beta);
  s.warmup = warmup;
  s.warmup_gamma = static_cast<float>(warmup_gamma);
  s.warmup_power = static_cast<float>(warmup_power);
  kernel(decay_out, step, total, s);
}

namespace {

// A group of copies: (destination | source device, destination dtype, source dtype).
using Key = std::tuple<std::string, int, int>;

void ema_step_impl(at::TensorList ema, at::TensorList src, at::TensorList copy_dst, at::TensorList copy_src,
                   const at::Tensor& decay, const at::Tensor& step, const std::optional<at::Tensor>& found_inf,
                   const std::optional<at::TensorList>& remainders) {
  const char* op = "ema_step_";
  TORCH_CHECK_VALUE(ema.size() == src.size(), op, ": got ", ema.size(), " ema tensors but ", src.size(),
                    " src tensors");
  TORCH_CHECK_VALUE(copy_dst.size() == copy_src.size(), op, ": got ", copy_dst.size(), " copy_dst tensors but ",
                    copy_src.size(), " copy_src tensors");
  check_scalar(op, "decay", decay);
  check_scalar(op, "step", step);
  if (found_inf.has_value()) check_scalar(op, "found_inf", *found_inf);
  auto flag_on = [&](const at::Device& dev) -> std::optional<at::Tensor> {
    if (!found_inf.has_value()) return std::nullopt;
    return found_inf->device() == dev ? *found_inf : found_inf->to(dev);
  };

  // Averaged: one ema_update_ pass per device (with the remainders of its
  // bfloat16 tensors, NOTE [ema remainder]).
  const at::TensorList rems = remainders.has_value() ? *remainders : at::TensorList();
  size_t n_bf16 = 0;
  for (const auto& e : ema) n_bf16 += e.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(rems.empty() || rems.size() == n_bf16, op, ": remainders must be empty or hold one int16 "
                    "tensor per bfloat16 ema tensor (", n_bf16, "), got ", rems.size());
  struct DeviceLists {
    std::vector<at::Tensor> ema, src, rem;
  };
  std::map<std::string, DeviceLists> by_device;
  size_t next_rem = 0;
  for (size_t i = 0; i < ema.size(); ++i) {
    TORCH_CHECK_VALUE(ema[i].sizes() == src[i].sizes() && ema[i].scalar_type() == src[i].scalar_type(), op,
                      ": ema[", i, "] (", ema[i].scalar_type(), ema[i].sizes(), ") and src[", i, "] (",
                      src[i].scalar_type(), src[i].sizes(), ") differ in dtype or shape");
    auto& lists = by_device[ema[i].device().str()];
    lists.ema.push_back(ema[i]);
    lists.src.push_back(src[i]);
    if (!rems.empty() && ema[i].scalar_type() == at::kBFloat16) lists.rem.push_back(rems[next_rem++]);
  }
  for (auto& [key, lists] : by_device) {
    const auto dev = lists.ema.front().device();
    ema_update_(lists.ema, lists.src, decay.device() == dev ? decay : decay.to(dev), flag_on(dev),
                lists.rem.empty() ? std::nullopt : std::optional<at::TensorList>(lists.rem));
  }

  // NOTE [gated copy]: the copied tensors, one multi-tensor copy per group of
  // tensors with the same devices and dtypes. With a flag, a group whose pairs
  // share a device, dtype and dense layout (every BatchNorm's running stats
  // and counter) is one gated_copy_ launch, which keeps the destination's
  // bytes on a skipped step; any other group is gathered into one flat
  // tensor per side, one select keeps the destination's values, and the
  // result is copied back (exact for every dtype and value, non-finite ones
  // included): a handful of launches however many shapes the group holds.
  std::map<Key, std::vector<size_t>> groups;
  for (size_t i = 0; i < copy_dst.size(); ++i) {
    const auto& d = copy_dst[i];
    const auto& s = copy_src[i];
    TORCH_CHECK_VALUE(d.sizes() == s.sizes(), op, ": copy_dst[", i, "] has shape ", d.sizes(), " but copy_src[", i,
                      "] has shape ", s.sizes());
    groups[{d.device().str() + "|" + s.device().str(), static_cast<int>(d.scalar_type()),
            static_cast<int>(s.scalar_type())}]
        .push_back(i);
  }
  for (const auto& [key, idx] : groups) {
    std::vector<at::Tensor> ds, ss;
    for (size_t i : idx) {
      ds.push_back(copy_dst[i]);
      ss.push_back(copy_src[i]);
    }
    const auto dev = ds.front().device();
    auto f = flag_on(dev);
    if (!f) {
      at::_foreach_copy_(ds, ss);
      continue;
    }
    if (std::all_of(idx.begin(), idx.end(), [&](size_t i) { return gated_copy_takes(copy_dst[i], copy_src[i]); })) {
      gated_copy_(ds, ss, *f);
      continue;
    }
    std::vector<at::Tensor> flat_d, flat_s;
    std::vector<int64_t> numels;
    for (size_t j = 0; j < ds.size(); ++j) {
      flat_d.push_back(ds[j].reshape({-1}));
      flat_s.push_back(ss[j].reshape({-1}));
      numels.push_back(ds[j].numel());
    }
    const at::Tensor kept = at::where(*f != 0, at::cat(flat_d), at::cat(flat_s).to(dev, ds.front().scalar_type()));
    std::vector<at::Tensor> parts = kept.split_with_sizes(numels);
    for (size_t j = 0; j < ds.size(); ++j) parts[j] = parts[j].view(ds[j].sizes());
    at::_foreach_copy_(ds, parts);
  }

  // The counter of updates done (skipped steps excluded).
  auto f = flag_on(step.device());
  if (f) {
    step.add_(1.0 - *f);
  } else {
    step.add_(1.0);
  }
}

}  // namespace
}  // namespace detail
}  // namespace fusetrain

TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  m.def(
      "ema_decay_(Tensor(a!) decay_out, Tensor step, Tensor? total_steps, str decay_type, float decay, float beta, "
      "bool warmup, float warmup_gamma, float warmup_power) -> ()");
  m.def(
      "ema_step_(Tensor(a!)[] ema, Tensor[] src, Tensor(b!)[] copy_dst, Tensor[] copy_src, Tensor decay, "
      "Tensor(c!) step, Tensor? found_inf=None, Tensor(d!)[]? remainders=None) -> ()");
}

// ema_decay_'s kernels register it beside them (NOTE [kernel registration]).
TORCH_LIBRARY_IMPL(fusetrain, CompositeExplicitAutograd, m) {
  m.impl("ema_step_", &fusetrain::detail::ema_step_impl);
}
