// A whole training step (forward, loss, backward and the fused tail) as one
// call, run eagerly or captured once as a CUDA graph and replayed per batch.
#pragma once

#include <fusetrain/amp.h>
#include <fusetrain/optim.h>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <functional>
#include <memory>
#include <optional>

namespace fusetrain {

enum class StepMode {
  Eager,      // run the step op by op (CPU or CUDA); the reference
  CudaGraph,  // capture the step once after warm-up, then replay it (CUDA only)
};

struct TrainStepOptions {
  // How the step runs.
  TORCH_ARG(StepMode, mode) = StepMode::Eager;
  // CudaGraph: optimizer steps (accumulate calls each) run eagerly before the
  // capture. They are real training steps. Must be >= 1 for CudaGraph.
  TORCH_ARG(int64_t, warmup_steps) = 3;
  // Gradient accumulation: the optimizer steps on every accumulate-th call;
  // each call backpropagates loss / accumulate.
  TORCH_ARG(int64_t, accumulate) = 1;
  // Run loss_fn under autocast with this dtype (kHalf or kBFloat16) on the
  // inputs' device; unset = no autocast.
  TORCH_ARG(std::optional<at::ScalarType>, autocast_dtype) = std::nullopt;
};

// One training step per call:
//   loss = loss_fn(x, y)                 (under autocast when set)
//   scaler.scale(loss / accumulate).backward()   (plain backward without scaler)
//   every accumulate-th call: fused_step(optimizer, scaler, attached EMA); zero_grad
// The EMA rides along when it is attached to the optimizer (ModelEMA::attach).
//
// StepMode::CudaGraph needs CUDA inputs and a build with CUDA. The first
// warmup_steps optimizer steps run eagerly on a side stream; the next call of
// each kind (the stepping call, and with accumulate > 1 the accumulating call)
// is captured as a CUDA graph, and later calls copy x and y into static
// buffers and replay it. lr (set_lr, LR schedulers), step counts, the loss
// scale and the EMA decay are read from device memory, so they change without
// a recapture. Gradients are zeroed in place (never set to undefined) so that
// they keep their addresses. A call whose x or y differs in shape, dtype or
// device from the captured ones runs eagerly (e.g. a partial last batch).
// A step that cannot be captured (e.g. loss_fn syncs with the host) raises a
// c10::Error saying why.
class TrainStep {
 public:
  using LossFn = std::function<torch::Tensor(const torch::Tensor& x, const torch::Tensor& y)>;

  TrainStep(LossFn loss_fn, FusedOptimizer& optimizer, LossScaler* scaler = nullptr, TrainStepOptions options = {});
  ~TrainStep();
  TrainStep(const TrainStep&) = delete;
  TrainStep& operator=(const TrainStep&) = delete;
  TrainStep(TrainStep&&) noexcept;
  TrainStep& operator=(TrainStep&&) noexcept;

  // Runs one step and returns loss_fn's loss, detached. With a replayed graph
  // the result is the graph's static output buffer: the next replay of the
  // same graph overwrites it (clone it to keep it).
  torch::Tensor operator()(const torch::Tensor& x, const torch::Tensor& y);

  // Drops the captured graphs and their memory; the next calls warm up and
  // capture again. The accumulation phase is kept.
  void reset();

  // True when every graph this step needs is captured (CudaGraph mode).
  bool captured() const;
  // Number of CUDA graphs captured since construction (each reset() and
  // recapture adds to it).
  int64_t capture_count() const;
  // Calls made so far.
  int64_t calls() const;
  const TrainStepOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fusetrain
