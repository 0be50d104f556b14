// Public C++ entry points to fusetrain's fused ops. Each call goes through the
// PyTorch dispatcher, so CPU and CUDA tensors reach their kernels and the same
// argument checks apply as from Python.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

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

// Adam (decoupled_weight_decay=false) / AdamW (true). state_steps are float32
// scalars incremented in place; max_exp_avg_sqs is used when amsgrad.
void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList max_exp_avg_sqs, at::TensorList state_steps, at::TensorList master_params,
                 at::TensorList ema_params, const at::Tensor& lr, double beta1, double beta2, double weight_decay,
                 double eps, bool amsgrad, bool maximize, bool decoupled_weight_decay, const FusedTail& tail = {});

void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                at::TensorList state_steps, at::TensorList master_params, at::TensorList ema_params,
                const at::Tensor& lr, double momentum, double dampening, double weight_decay, bool nesterov,
                bool maximize, const FusedTail& tail = {});

void fused_lion_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList state_steps,
                 at::TensorList master_params, at::TensorList ema_params, const at::Tensor& lr, double beta1,
                 double beta2, double weight_decay, bool maximize, const FusedTail& tail = {});

// ema += (1 - decay) * (src - ema) for every pair (same dtype and shape), in
// one multi-tensor pass; nothing changes when found_inf is non-zero.
void ema_update_(at::TensorList ema, at::TensorList src, const at::Tensor& decay,
                 const std::optional<at::Tensor>& found_inf = std::nullopt);

// Dynamic loss-scale update in device memory (torch.amp.GradScaler semantics).
// scale: 0-d float32; growth_tracker: 0-d int32; found_inf: 0-d float32.
void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                   double growth_factor, double backoff_factor, int64_t growth_interval);

}  // namespace fusetrain
