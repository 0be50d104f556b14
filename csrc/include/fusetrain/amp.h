// Dynamic loss scaling and EMA for LibTorch programs, plus the one-call fused
// tail of a training step.
#pragma once

#include <fusetrain/optim.h>

#include <torch/nn/module.h>
#include <torch/serialize/archive.h>

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

namespace fusetrain {

struct LossScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  TORCH_ARG(bool, enabled) = true;
};

// torch.amp.GradScaler semantics with the scale and growth tracker kept in
// device memory. step(optimizer) hands the inverse scale to a fusetrain
// optimizer, which detects non-finite gradients and skips the update on the
// device; update() adjusts the scale on the device. No host sync.
class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions options = {});

  // loss * scale (the scale tensor is created on the loss's device).
  at::Tensor scale(const at::Tensor& loss);
  // Unscaled, non-finite-checked fused step of a fusetrain optimizer.
  void step(FusedOptimizer& optimizer);
  // Scale update from the found_inf flags of the steps since the last update.
  void update();
  // Forgets the flags recorded by step() since the last update() (after a
  // failed CUDA-graph capture, whose flags were never computed).
  void reset_pending();

  double get_scale() const;                 // host sync
  at::Tensor get_scale_tensor() const { return scale_; }
  at::Tensor growth_tracker() const { return growth_tracker_; }
  // 0-d float32 device tensors (undefined before the first scale()): 1.0 when
  // the last update() saw non-finite gradients (its step was skipped), and the
  // number of skipped steps so far.
  at::Tensor last_step_skipped() const { return last_step_skipped_; }
  at::Tensor skipped_steps() const { return skipped_steps_; }
  bool is_enabled() const { return options_.enabled(); }
  const LossScalerOptions& options() const { return options_; }

  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  void lazy_init(const at::Device& device);
  LossScalerOptions options_;
  at::Tensor scale_, growth_tracker_, last_step_skipped_, skipped_steps_, pending_found_inf_;
};

struct ModelEMAOptions {
  TORCH_ARG(double, decay) = 0.9999;
  TORCH_ARG(std::string, decay_type) = "exp";  // "constant", "threshold" or "exp"
  TORCH_ARG(double, beta) = 15.0;
  TORCH_ARG(int64_t, total_steps) = 0;  // needed by "exp" (0 = not set)
  TORCH_ARG(bool, warmup) = false;
  TORCH_ARG(double, warmup_gamma) = 1.0;
  TORCH_ARG(double, warmup_power) = 2.0 / 3.0;
  TORCH_ARG(bool, include_buffers) = true;
  // An int16 remainder beside each averaged bfloat16 tensor: with it the
  // tensor is the exact float32 EMA (NOTE [ema remainder] in
  // csrc/common/lean_state.h); false keeps a bfloat16 EMA alone.
  TORCH_ARG(bool, remainder) = true;
};

// Exponential moving average of a module's parameters (and float buffers).
// The EMA copy is made with module->clone() (the module must be Cloneable, as
// all torch::nn modules and torch::nn::Cloneable subclasses are). Schedules,
// with t the 1-based number of non-skipped updates, evaluated with float32
// device ops:
//   constant: decay;  threshold: min(decay, (1+t)/(10+t));
//   exp: decay * (1 - exp(-beta * t / total_steps));
//   warmup additionally caps at 1 - (1 + t/gamma)^-power.
class ModelEMA {
 public:
  ModelEMA(std::shared_ptr<torch::nn::Module> model, ModelEMAOptions options = {});
  template <typename M>
  ModelEMA(const torch::nn::ModuleHolder<M>& model, ModelEMAOptions options = {})
      : ModelEMA(std::static_pointer_cast<torch::nn::Module>(model.ptr()), std::move(options)) {}
  ~ModelEMA();
  ModelEMA(const ModelEMA&) = delete;
  ModelEMA& operator=(const ModelEMA&) = delete;

  // Standalone update from the source model (skipped on the device when
  // found_inf is non-zero).
  void update(const std::optional<at::Tensor>& found_inf = std::nullopt);

  // Ride the parameter EMA inside the optimizer's fused update pass. Params of
  // the model that the optimizer does not own, and buffers, are updated right
  // after the optimizer's step, gated by its found_inf. An EMA with
  // remainders attached to an optimizer whose pass cannot carry them (Lamb,
  // AdamP, Muon) averages every param after the step instead.
  void attach(FusedOptimizer& optimizer);
  void detach();
  bool attached_to(const FusedOptimizer& optimizer) const { return optimizer_ == &optimizer; }

  std::shared_ptr<torch::nn::Module> module() const { return ema_; }
  at::Tensor step_tensor() const { return step_; }     // float32, non-skipped updates
  at::Tensor decay_tensor() const { return decay_; }   // last decay used
  void set_total_steps(int64_t total_steps);
  const ModelEMAOptions& options() const { return options_; }

  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

  // The int16 remainder of an EMA tensor (undefined if it has none).
  at::Tensor remainder_for(const at::Tensor& ema_tensor) const;

  // Used by FusedOptimizer: the decay of the next update (fusetrain::ema_decay_),
  // the EMA tensor of a param of the source model that rides in its pass
  // (undefined if none), and the buffers' update after the step
  // (fusetrain::ema_step_, gated by found_inf).
  const at::Tensor& prepare_decay();
  at::Tensor ema_for(const at::Tensor& param) const;
  void finish_step(const at::Tensor& found_inf);

 private:
  struct Pairs {
    std::vector<at::Tensor> avg_dst, avg_src, copy_dst, copy_src, avg_rem;
  };
  void lazy_init();
  Pairs pairs(bool params) const;
  std::shared_ptr<torch::nn::Module> model_, ema_;
  ModelEMAOptions options_;
  at::Tensor step_, decay_, total_;
  FusedOptimizer* optimizer_ = nullptr;
  bool rides_ = false;  // the params' EMA rides in the attached optimizer's pass
  // Source param (TensorImpl) -> EMA param, built once on first use.
  mutable std::unordered_map<const void*, at::Tensor> ema_by_param_;
  // EMA tensor (TensorImpl) -> its remainder (NOTE [ema remainder]), by name for archives.
  std::unordered_map<const void*, at::Tensor> rem_by_ema_;
  std::vector<std::pair<std::string, at::Tensor>> rem_by_name_;
};

// The fused tail of a training step for C++ loops: unscale + non-finite check
// + clipping + update + EMA in one pass (when the EMA is attached; otherwise
// a standalone EMA update follows, gated by the same flag) and the loss-scale
// update. scaler and ema may be null.
void fused_step(FusedOptimizer& optimizer, LossScaler* scaler = nullptr, ModelEMA* ema = nullptr);
inline void fused_step(FusedOptimizer& optimizer, LossScaler& scaler, ModelEMA& ema) {
  fused_step(optimizer, &scaler, &ema);
}

}  // namespace fusetrain
