// Public C++ entry points to fusetrain's fused ops. Each call goes through the
// PyTorch dispatcher, so CPU and CUDA tensors reach their kernels and the same
// argument checks apply as from Python.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace fusetrain {

// The optional tail folded into every update: gradient unscaling (inv_scale),
// the skip on non-finite gradients (found_inf), global-norm clipping (grad_norm
// from grad_stats and max_grad_norm > 0) and an EMA of the updated params.
// All tensors are 0-d float32 on the params' device.
struct FusedTail {
  std::optional<at::Tensor> inv_scale;
  std::optional<at::Tensor> found_inf;
  std::optional<at::Tensor> grad_norm;
  double max_grad_norm = 0.0;
  std::optional<at::Tensor> ema_decay;
};

// Global L2 norm of the (unscaled, when inv_scale is given) gradients and a
// non-finite flag (1.0 when any element is inf or NaN), both 0-d float32 tensors
// on the gradients' device. One read of each gradient, no host sync.
std::tuple<at::Tensor, at::Tensor> grad_stats(at::TensorList grads,
                                              const std::optional<at::Tensor>& inv_scale = std::nullopt);

// ema += (1 - decay) * (src - ema) for every pair (same dtype and shape), in
// one multi-tensor pass; nothing changes when found_inf is non-zero.
// remainders, when not empty: one int16 tensor per bfloat16 ema tensor, in
// order; each such pair is then the exact float32 EMA (NOTE [ema remainder]
// in csrc/common/lean_state.h).
void ema_update_(at::TensorList ema, at::TensorList src, const at::Tensor& decay,
                 const std::optional<at::Tensor>& found_inf = std::nullopt,
                 const std::optional<at::TensorList>& remainders = std::nullopt);

// dst[i] <- src[i] for every pair (same dtype, shape and strides, dense), in
// one pass; nothing changes when found_inf (0-d float32) is non-zero.
void gated_copy_(at::TensorList dst, at::TensorList src, const at::Tensor& found_inf);

// Dynamic loss-scale update in device memory (torch.amp.GradScaler semantics).
// scale: 0-d float32; growth_tracker: 0-d int32; found_inf: 0-d float32. The
// optional skip counters (0-d float32) get found_inf copied / added.
void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                   double growth_factor, double backoff_factor, int64_t growth_interval,
                   const std::optional<at::Tensor>& last_skipped = std::nullopt,
                   const std::optional<at::Tensor>& skipped_steps = std::nullopt);

// The whole tail of an optimizer step for every group of one optimizer (a kind
// of the kind table, generated from the optimizer table: docs/ops.md lists
// them): the stats pass when a group clips or the gradients are loss-scaled
// without a flag, then one update pass per group.
// Lists are flattened over groups; group_sizes, lrs (0-d float32 each) and
// hyper (one record per group) describe the groups: NOTE [group records] in
// csrc/ops/fused_step.cpp. grad_norm_out / found_inf_out (0-d float32), when
// given, receive the global norm (NaN when none was measured) and the step's
// non-finite flag. grad_norm, when given, is the global norm of the
// (unscaled) gradients measured by the caller (sharded parameters: the norm
// over every shard, NOTE [sharded steps] in python/fusetrain/optim/_base.py):
// clipping uses it and no stats pass runs for it. group_values, when not
// empty, holds one float64 vector per group with the kind's schedulable
// fields (optim_kinds(); NOTE [device values] in
// csrc/common/update_launch.h): on its params' device the kernels read those
// fields there, so a compiled or captured step follows their changes; on the
// CPU the op reads and checks them on the host (not while capturing). state_scales: the block
// scales of int8 state tensors (NOTE [group records]; NOTE [8-bit state] in
// csrc/common/lean_state.h). ema_remainders, when not empty: one int16
// tensor per bfloat16 entry of ema_params, in order (NOTE [ema remainder]).
// stalled_out: a 0-d int64 tensor on the params' device that gets the number
// of stalled updates added (NOTE [stalled updates]; the element-wise kinds).
// This is what fusetrain::FusedOptimizer and fusetrain.optim.* call.
void fused_step_(c10::string_view optimizer, at::TensorList params, at::TensorList grads, at::TensorList state_steps,
                 at::TensorList state1, at::TensorList state2, at::TensorList state3, at::TensorList master_params,
                 at::TensorList ema_params, at::IntArrayRef group_sizes, at::TensorList lrs,
                 at::ArrayRef<double> hyper, const std::optional<at::Tensor>& inv_scale,
                 const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& ema_decay,
                 const std::optional<at::Tensor>& grad_norm_out, const std::optional<at::Tensor>& found_inf_out,
                 const std::optional<at::Tensor>& grad_norm = std::nullopt,
                 const std::optional<at::TensorList>& group_values = std::nullopt,
                 const std::optional<at::TensorList>& state_scales = std::nullopt,
                 const std::optional<at::TensorList>& ema_remainders = std::nullopt,
                 const std::optional<at::Tensor>& stalled_out = std::nullopt);

// The EMA decay of the next update (1-based number step + 1) into decay_out:
// decay_type "constant", "threshold" or "exp" (needs total_steps), optionally
// capped by the warmup schedule (fusetrain::ModelEMA's docs).
void ema_decay_(const at::Tensor& decay_out, const at::Tensor& step, const std::optional<at::Tensor>& total_steps,
                c10::string_view decay_type, double decay, double beta, bool warmup, double warmup_gamma,
                double warmup_power);

// One EMA update: ema += (1 - decay) * (src - ema) pairwise, copy_dst <- copy_src,
// step += 1; nothing changes when found_inf is non-zero (decided on the device).
// remainders: as ema_update_'s.
void ema_step_(at::TensorList ema, at::TensorList src, at::TensorList copy_dst, at::TensorList copy_src,
               const at::Tensor& decay, const at::Tensor& step,
               const std::optional<at::Tensor>& found_inf = std::nullopt,
               const std::optional<at::TensorList>& remainders = std::nullopt);

}  // namespace fusetrain
