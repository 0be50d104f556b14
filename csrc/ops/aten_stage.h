// Pieces shared by the update ops with reductions inside their step (Muon,
// Lamb, AdamP).
//
// NOTE [apply pass]: Muon's Newton-Schulz iterations, Lamb's per-tensor trust
// ratio and AdamP's per-channel projection need reductions that an
// element-wise pass cannot hold. Their steps are staged, every changing
// scalar staying a device tensor (no host sync):
//   1. the direction: for Lamb and AdamP a fused pass of kind Direction
//      (staged_math.h) updates the moments with the unscaled, clipped
//      gradient and writes the Adam direction into a scratch tensor, counting
//      the step (and skipping as every fused pass does); Muon's momentum is an
//      ATen stage (NOTE [muon apply]);
//   2. the reductions, with ATen operations (norms, cosine similarities,
//      Newton-Schulz);
//   3. one fused pass of kind Apply: p = p * (1 - lr * decay) - lr * ratio *
//      direction, with the skip, master weights and the EMA (ApplyMath).
// Where an ATen stage updates state (Muon's momentum), a skipped step must
// leave it as it was without a host branch: the gradient's non-finite entries
// are zeroed and the update's weights multiplied by (1 - found_inf).
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "../common/kind_table.h"
#include "../common/op_kernels.h"
#include "../common/update_launch.h"

namespace fusetrain {
namespace detail {

// The multiplier of every gradient element as a 0-d device tensor (undefined
// for 1): grad_multiplier of step_math.h, in float32.
at::Tensor grad_multiplier_tensor(const OptT& inv_scale, const OptT& grad_norm, double max_grad_norm);

// 1 - found_inf as a 0-d tensor, or undefined without a flag.
at::Tensor keep_tensor(const OptT& found_inf);

// The gradient of the ATen stage in the state dtype: unscaled and clipped by
// `mult`, negated for maximize, its non-finite entries zeroed when a step may
// be skipped (`keep` defined).
at::Tensor stage_grad(const at::Tensor& grad, at::ScalarType sd, const at::Tensor& mult, const at::Tensor& keep,
                      bool maximize);

// The checks common to the ATen-stage ops: list lengths, devices, shapes and
// dtypes of params, grads and one state list per name.
void check_stage_lists(const char* op, at::TensorList params, at::TensorList grads,
                       const std::vector<std::pair<const char*, at::TensorList>>& states, at::TensorList state_steps,
                       at::TensorList master_params, at::TensorList ema_params, const at::Tensor& lr,
                       const OptT& inv_scale, const OptT& found_inf, const OptT& grad_norm);

// The value the optimizer holds for param i at full precision, in the state
// dtype: the fp32 master when there is one, else the param (converted).
at::Tensor full_precision_param(at::TensorList params, at::TensorList master_params, size_t i, at::ScalarType sd);

// The apply pass (kind Apply) over params `idx` with the directions `dirs`
// (one per index, the state dtype) and the per-tensor inputs `aux` (0-d
// float32, or empty). count_step: whether this pass counts the step (false
// when a direction pass counted it).
void run_apply_pass(const char* op, UpdateKernel kernel, const std::vector<size_t>& idx,
                    const std::vector<at::Tensor>& dirs, const std::vector<at::Tensor>& aux, at::TensorList params,
                    at::TensorList state_steps, at::TensorList master_params, at::TensorList ema_params,
                    const at::Tensor& lr, const ApplyFields& fields, const OptT& found_inf, const OptT& ema_decay,
                    bool count_step = true);

// The direction pass (kind Direction) over params `idx`: updates exp_avgs and
// exp_avg_sqs and returns the directions (new tensors in the state dtype).
// `weights` (the full-precision weights, one per index) are read when
// fields.l2_decay != 0, else may be empty.
std::vector<at::Tensor> run_direction_pass(const char* op, UpdateKernel kernel, const std::vector<size_t>& idx,
                                           at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                                           at::TensorList exp_avg_sqs, const std::vector<at::Tensor>& weights,
                                           at::TensorList state_steps, const at::Tensor& lr,
                                           const DirectionFields& fields, bool maximize, const OptT& inv_scale,
                                           const OptT& found_inf, const OptT& grad_norm, double max_grad_norm);

}  // namespace detail
}  // namespace fusetrain
