// fusetrain::TrainStep: the whole training step, eager or captured as a CUDA graph.
#include <fusetrain/step.h>

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <string>
#include <utility>
#include <vector>

#include "../ops/capture.h"

#ifdef FUSETRAIN_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fusetrain {
namespace {

// Enables autocast for one device type and dtype for its lifetime, restoring
// the previous state (and clearing the cast cache when the outermost autocast
// region ends) also when loss_fn throws.
class AutocastScope {
 public:
  AutocastScope(c10::DeviceType device_type, const std::optional<at::ScalarType>& dtype) {
    if (!dtype.has_value()) return;
    TORCH_CHECK(at::autocast::is_autocast_available(device_type), "fusetrain::TrainStep: autocast_dtype is set (",
                *dtype, ") but autocast is not available for device type ", device_type);
    device_type_ = device_type;
    prev_enabled_ = at::autocast::is_autocast_enabled(device_type);
    prev_dtype_ = at::autocast::get_autocast_dtype(device_type);
    at::autocast::set_autocast_enabled(device_type, true);
    at::autocast::set_autocast_dtype(device_type, *dtype);
    at::autocast::increment_nesting();
    active_ = true;
  }
  ~AutocastScope() {
    if (!active_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device_type_, prev_enabled_);
    at::autocast::set_autocast_dtype(device_type_, prev_dtype_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_ = false;
  c10::DeviceType device_type_ = c10::DeviceType::CPU;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

std::string error_text(const std::exception& e) {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

#ifdef FUSETRAIN_WITH_CUDA
// One captured graph with its static input buffers and its loss output.
struct Captured {
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  at::Tensor x, y, loss;
  bool fits(const at::Tensor& a, const at::Tensor& b) const {
    return a.sizes() == x.sizes() && b.sizes() == y.sizes() && a.scalar_type() == x.scalar_type() &&
           b.scalar_type() == y.scalar_type() && a.device() == x.device() && b.device() == y.device();
  }
};

// After a failed capture: release what capture_end left behind (NOTE [failed
// capture] in capture.h), unless the capture did end (pool() then succeeds and
// the graph releases its pool itself).
void abandon_capture(at::cuda::CUDAGraph& graph, c10::DeviceIndex device, at::cuda::MempoolId_t pool) {
  try {
    graph.pool();
    return;
  } catch (...) {
  }
  detail::abandon_capture(device, pool);
}
#endif

}  // namespace

struct TrainStep::Impl {
  LossFn loss_fn;
  FusedOptimizer* optimizer;
  LossScaler* scaler;
  TrainStepOptions options;
  int64_t calls = 0;
  int64_t warm_steps = 0;  // optimizer steps run eagerly since construction or reset()
  int64_t captures = 0;
#ifdef FUSETRAIN_WITH_CUDA
  Captured step_graph, micro_graph;  // micro: the accumulating call (accumulate > 1)
  at::cuda::MempoolId_t pool{0, 0};
  std::optional<c10::cuda::CUDAStream> side;
  c10::Device device{c10::kCUDA};
  std::vector<std::pair<at::Tensor, at::Tensor>> static_grads;  // (param, its .grad) read by the graphs
#endif

  Impl(LossFn fn, FusedOptimizer& opt, LossScaler* s, TrainStepOptions o)
      : loss_fn(std::move(fn)), optimizer(&opt), scaler(s), options(std::move(o)) {}
  ~Impl() {
#ifdef FUSETRAIN_WITH_CUDA
    try {
      drop_graphs();
    } catch (...) {
    }
#endif
  }

  // forward + loss, backward, and on a stepping call the fused tail and zero_grad.
  at::Tensor run(const at::Tensor& x, const at::Tensor& y, bool do_step, bool set_to_none) {
    at::AutoGradMode grad_mode(true);
    at::Tensor loss;
    {
      AutocastScope autocast(x.device().type(), options.autocast_dtype());
      loss = loss_fn(x, y);
    }
    TORCH_CHECK(loss.defined(), "fusetrain::TrainStep: loss_fn returned an undefined tensor");
    TORCH_CHECK(loss.numel() == 1, "fusetrain::TrainStep: loss_fn must return a single-element loss, got shape ",
                loss.sizes());
    TORCH_CHECK(loss.requires_grad(),
                "fusetrain::TrainStep: the loss returned by loss_fn does not require grad (no trainable "
                "parameter contributed to it)");
    at::Tensor to_backward = options.accumulate() > 1 ? loss / static_cast<double>(options.accumulate()) : loss;
    if (scaler != nullptr) to_backward = scaler->scale(to_backward);
    to_backward.backward();
    if (do_step) {
      fused_step(*optimizer, scaler, optimizer->attached_ema());
      optimizer->zero_grad(set_to_none);
    }
    return loss.detach();
  }

#ifdef FUSETRAIN_WITH_CUDA
  // Runs f eagerly on the side stream, ordered after the work already queued on
  // the current stream, and the current stream's later work after it.
  template <typename F>
  at::Tensor on_side_stream(F&& f) {
    auto current = c10::cuda::getCurrentCUDAStream(device.index());
    at::cuda::CUDAEvent to_side, back;
    to_side.record(current);
    to_side.block(*side);
    at::Tensor out;
    try {
      c10::cuda::CUDAStreamGuard guard(*side);
      out = f();
    } catch (...) {
      back.record(*side);
      back.block(current);
      throw;
    }
    back.record(*side);
    back.block(current);
    return out;
  }

  // The graphs read and write the .grad tensors that existed at capture time.
  void check_static_grads() const {
    for (const auto& [p, g] : static_grads)
      TORCH_CHECK(p.grad().defined() && p.grad().is_same(g),
                  "fusetrain::TrainStep: a parameter's .grad was replaced or reset since the step was captured "
                  "(e.g. by zero_grad() with set_to_none); the captured step zeroes the gradients itself. Call "
                  "reset() to capture again");
  }

  void capture(Captured& g, const at::Tensor& x, const at::Tensor& y, bool do_step) {
    if (static_grads.empty()) {
      for (const auto& group : optimizer->param_groups())
        for (const auto& p : group.params())
          if (p.grad().defined()) static_grads.emplace_back(p, p.grad());
    } else {
      check_static_grads();
    }
    std::vector<at::Tensor> no_grad_before;
    for (const auto& group : optimizer->param_groups())
      for (const auto& p : group.params())
        if (p.requires_grad() && !p.grad().defined()) no_grad_before.push_back(p);
    g.x = x.detach().clone();
    g.y = y.detach().clone();
    // State, lr tensors (holding the current lr: a fill recorded into the graph
    // would reset the lr on every replay) and result buffers exist before the
    // capture (NOTE [state before capture]).
    optimizer->prepare_capture();
    if (pool.first == 0 && pool.second == 0) pool = at::cuda::graph_pool_handle();
    c10::cuda::device_synchronize();
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    at::Tensor loss;
    std::string why;
    {
      c10::cuda::CUDAStreamGuard guard(*side);
      // NOTE [capture mode] (python/fusetrain/training/step.py): other threads may use CUDA meanwhile.
      graph->capture_begin(pool, cudaStreamCaptureModeThreadLocal);
      bool ending = false;
      try {
        loss = run(g.x, g.y, do_step, /*set_to_none=*/false);
        ending = true;
        graph->capture_end();
      } catch (const std::exception& e) {
        why = error_text(e);
        if (!ending) {
          try {
            graph->capture_end();
          } catch (...) {
          }
        }
      }
    }
    size_t late = 0;
    if (why.empty() && options.accumulate() > 1) {
      // The captured backward assigns these .grad tensors instead of
      // accumulating into them: every replay would overwrite the sum so far.
      for (auto& p : no_grad_before) {
        if (p.grad().defined()) {
          ++late;
          p.mutable_grad() = at::Tensor();
        }
      }
    }
    if (!why.empty() || late > 0) {
      abandon_capture(*graph, device.index(), pool);
      graph.reset();
      g = Captured();
      if (scaler != nullptr) scaler->reset_pending();
      if (!step_graph.graph && !micro_graph.graph) {
        pool = {0, 0};
        static_grads.clear();
      }
      TORCH_CHECK(late == 0, "fusetrain::TrainStep: ", late, " parameter(s) got their first gradient inside the "
                  "CUDA-graph capture, after ", options.warmup_steps(), " warm-up step(s) without one; with accumulate ",
                  options.accumulate(), " the captured step would overwrite instead of accumulate their gradients. A "
                  "captured step needs the same parameters to receive gradients in every step: call reset() after "
                  "unfreezing parameters, or raise warmup_steps");
      TORCH_CHECK(false, "fusetrain::TrainStep: the training step could not be captured as a CUDA graph "
                  "(StepMode::CudaGraph). Everything in loss_fn must stay on the device: no host syncs "
                  "(.item(), .cpu(), printing tensors, data-dependent shapes such as nonzero or masked_select) "
                  "and no CPU tensors. Use StepMode::Eager for such a step. The error during capture was: ",
                  why);
    }
    g.graph = std::move(graph);
    g.loss = loss;
    ++captures;
  }

  at::Tensor run_captured(const at::Tensor& x, const at::Tensor& y, bool do_step) {
    TORCH_CHECK(x.is_cuda() && y.is_cuda(),
                "fusetrain::TrainStep: StepMode::CudaGraph needs CUDA tensors, got x on ", x.device(), " and y on ",
                y.device(), "; use StepMode::Eager for the CPU");
    TORCH_CHECK(x.device() == y.device(), "fusetrain::TrainStep: x is on ", x.device(), " but y is on ",
                y.device());
    if (!side.has_value()) {
      device = x.device();
      side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
    }
    TORCH_CHECK(x.device() == device, "fusetrain::TrainStep: the step runs on ", device, " but x is on ",
                x.device(), "; call reset() before changing the device");
    c10::cuda::CUDAGuard device_guard(device);
    if (warm_steps < options.warmup_steps()) {
      auto out = on_side_stream([&] { return run(x, y, do_step, /*set_to_none=*/false); });
      if (do_step) ++warm_steps;
      return out;
    }
    Captured& g = do_step ? step_graph : micro_graph;
    if (!g.graph) {
      capture(g, x, y, do_step);
    } else if (!g.fits(x, y)) {
      // NOTE [eager fallback]: another shape (a partial last batch) runs
      // eagerly on the same static gradients; the graphs stay valid.
      return on_side_stream([&] { return run(x, y, do_step, /*set_to_none=*/false); });
    } else {
      check_static_grads();
      g.x.copy_(x);
      g.y.copy_(y);
      optimizer->refresh_device_values();
    }
    g.graph->replay();
    return g.loss;
  }

  void drop_graphs() {
    if (step_graph.graph || micro_graph.graph) c10::cuda::device_synchronize();
    step_graph = Captured();
    micro_graph = Captured();
    pool = {0, 0};
    side.reset();
    static_grads.clear();
  }
#endif
};

TrainStep::TrainStep(LossFn loss_fn, FusedOptimizer& optimizer, LossScaler* scaler, TrainStepOptions options) {
  TORCH_CHECK(static_cast<bool>(loss_fn), "fusetrain::TrainStep: loss_fn is empty");
  TORCH_CHECK(options.accumulate() >= 1, "fusetrain::TrainStep: accumulate must be >= 1, got ",
              options.accumulate());
  TORCH_CHECK(options.warmup_steps() >= 0, "fusetrain::TrainStep: warmup_steps must be >= 0, got ",
              options.warmup_steps());
  const auto& dt = options.autocast_dtype();
  TORCH_CHECK(!dt.has_value() || *dt == at::kHalf || *dt == at::kBFloat16,
              "fusetrain::TrainStep: autocast_dtype must be Half or BFloat16 (or unset), got ",
              dt.has_value() ? c10::toString(*dt) : "");
  if (options.mode() == StepMode::CudaGraph) {
#ifdef FUSETRAIN_WITH_CUDA
    TORCH_CHECK(options.warmup_steps() >= 1,
                "fusetrain::TrainStep: warmup_steps must be >= 1 with StepMode::CudaGraph (the optimizer, loss "
                "scaler and EMA create their state in the first step, which cannot happen inside a capture), got ",
                options.warmup_steps());
#else
    TORCH_CHECK(false, "fusetrain::TrainStep: StepMode::CudaGraph needs CUDA, but this fusetrain library was built "
                "without CUDA (FUSETRAIN_CUDA=OFF); use StepMode::Eager");
#endif
  }
  impl_ = std::make_unique<Impl>(std::move(loss_fn), optimizer, scaler, std::move(options));
}

TrainStep::~TrainStep() = default;
TrainStep::TrainStep(TrainStep&&) noexcept = default;
TrainStep& TrainStep::operator=(TrainStep&&) noexcept = default;

torch::Tensor TrainStep::operator()(const torch::Tensor& x, const torch::Tensor& y) {
  TORCH_CHECK(impl_ != nullptr, "fusetrain::TrainStep: used after being moved from");
  TORCH_CHECK(x.defined() && y.defined(), "fusetrain::TrainStep: x and y must be defined tensors");
  auto& m = *impl_;
  const bool do_step = (m.calls + 1) % m.options.accumulate() == 0;
  at::Tensor loss;
  if (m.options.mode() == StepMode::Eager) {
    loss = m.run(x, y, do_step, /*set_to_none=*/true);
  } else {
#ifdef FUSETRAIN_WITH_CUDA
    loss = m.run_captured(x, y, do_step);
#else
    TORCH_CHECK(false, "fusetrain::TrainStep: StepMode::CudaGraph needs CUDA, but this fusetrain library was built "
                "without CUDA");
#endif
  }
  ++m.calls;
  return loss;
}

void TrainStep::reset() {
  TORCH_CHECK(impl_ != nullptr, "fusetrain::TrainStep: used after being moved from");
#ifdef FUSETRAIN_WITH_CUDA
  impl_->drop_graphs();
#endif
  impl_->warm_steps = 0;
}

bool TrainStep::captured() const {
#ifdef FUSETRAIN_WITH_CUDA
  if (impl_ == nullptr) return false;
  return impl_->step_graph.graph != nullptr &&
         (impl_->options.accumulate() == 1 || impl_->micro_graph.graph != nullptr);
#else
  return false;
#endif
}

int64_t TrainStep::capture_count() const { return impl_ ? impl_->captures : 0; }
int64_t TrainStep::calls() const { return impl_ ? impl_->calls : 0; }
const TrainStepOptions& TrainStep::options() const {
  TORCH_CHECK(impl_ != nullptr, "fusetrain::TrainStep: used after being moved from");
  return impl_->options;
}

}  // namespace fusetrain
