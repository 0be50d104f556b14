// What a CUDA-graph capture of the C++ step relies on: the driver requirement,
// state created before the capture (FusedOptimizer::prepare_capture), a scaler
// that forgets the flags of a failed capture, persistent result tensors; on a
// GPU (skipped otherwise), a capture while another thread uses CUDA, a
// parameter whose first gradient comes after the warm-up, and step results
// that survive the micro-step graph's replays.
#include <gtest/gtest.h>

#include <fusetrain/fusetrain.h>
#include <torch/torch.h>

#include <atomic>
#include <limits>
#include <memory>
#include <string>
#include <thread>

#include "../../csrc/common/cuda_requirements.h"
#include "test_util.h"

namespace {

using fusetrain_test::expect_error;

// Two layers; the second is used only when `late` is set.
struct Net : torch::nn::Cloneable<Net> {
  torch::nn::Linear a{nullptr}, b{nullptr};
  bool late = false;
  Net() { reset(); }
  void reset() override {
    a = register_module("a", torch::nn::Linear(6, 5));
    b = register_module("b", torch::nn::Linear(5, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = a->forward(x);
    return late ? b->forward(h) : h;
  }
};

struct Rig {
  std::shared_ptr<Net> net;
  std::unique_ptr<fusetrain::AdamW> opt;
  std::unique_ptr<fusetrain::LossScaler> scaler;
  explicit Rig(torch::Device device, double init_scale = 256.0) {
    torch::manual_seed(0);
    net = std::make_shared<Net>();
    net->to(device);
    opt = std::make_unique<fusetrain::AdamW>(net->parameters(), fusetrain::AdamWOptions(1e-2).max_grad_norm(1.0));
    scaler = std::make_unique<fusetrain::LossScaler>(fusetrain::LossScalerOptions().init_scale(init_scale));
  }
  fusetrain::TrainStep::LossFn loss_fn() const {
    auto n = net;
    return [n](const torch::Tensor& x, const torch::Tensor& y) { return torch::mse_loss(n->forward(x), y); };
  }
  size_t state_count() const { return opt->state().size(); }
};

std::pair<torch::Tensor, torch::Tensor> batch(int64_t i, torch::Device device) {
  torch::manual_seed(50 + i);
  return {torch::randn({4, 6}).to(device), torch::randn({4, 5}).to(device)};
}

}  // namespace

TEST(CudaRequirements, DriverVersionProblem) {
  EXPECT_TRUE(fusetrain::driver_version_problem(12010).empty());
  EXPECT_TRUE(fusetrain::driver_version_problem(13000).empty());
  const auto old = fusetrain::driver_version_problem(12000);
  EXPECT_NE(old.find("a driver for CUDA 12.0"), std::string::npos) << old;
  EXPECT_NE(old.find("CUDA 12.1 or newer (R530+"), std::string::npos) << old;
  EXPECT_NE(fusetrain::driver_version_problem(0).find("found no CUDA driver"), std::string::npos);
}

TEST(PrepareCapture, CreatesStateOfEveryTrainableParamAndChangesNoStep) {
  Rig a(torch::kCPU), b(torch::kCPU);
  b.net->b->bias.set_requires_grad(false);  // frozen: no state
  a.net->b->bias.set_requires_grad(false);
  b.opt->prepare_capture();
  EXPECT_EQ(b.state_count(), 3u) << "a.weight, a.bias, b.weight (b.bias is frozen)";
  for (int64_t i = 0; i < 3; ++i) {
    auto [x, y] = batch(i, torch::kCPU);
    for (auto* r : {&a, &b}) {
      r->opt->zero_grad();
      r->loss_fn()(x, y).backward();  // layer b gets no gradient
      r->opt->step();
    }
  }
  auto pa = a.net->parameters(), pb = b.net->parameters();
  for (size_t k = 0; k < pa.size(); ++k) EXPECT_TRUE(torch::equal(pa[k], pb[k])) << "param " << k;
  EXPECT_EQ(a.state_count(), 2u);
  const auto& st = static_cast<fusetrain::FusedParamState&>(*b.opt->state().at(b.net->b->weight.unsafeGetTensorImpl()));
  EXPECT_EQ(st.step().item<float>(), 0.0f) << "prepared, never stepped";
}

TEST(PrepareCapture, ScalerForgetsPendingFlags) {
  Rig r(torch::kCPU);
  auto [x, y] = batch(0, torch::kCPU);
  auto inf_step = [&] {
    r.opt->zero_grad();
    r.scaler->scale(r.loss_fn()(x, y) * std::numeric_limits<float>::infinity()).backward();
    r.scaler->step(*r.opt);
  };
  inf_step();
  r.scaler->update();
  EXPECT_EQ(r.scaler->get_scale(), 128.0) << "a non-finite step backs off";
  inf_step();
  r.scaler->reset_pending();  // as after a failed capture: that step's flag was never computed
  r.scaler->update();
  EXPECT_EQ(r.scaler->get_scale(), 128.0);
  EXPECT_EQ(r.scaler->growth_tracker().item<int>(), 1);
}

TEST(PrepareCapture, EmaDecayTensorIsPersistent) {
  Rig r(torch::kCPU);
  fusetrain::ModelEMA ema(std::static_pointer_cast<torch::nn::Module>(r.net),
                          fusetrain::ModelEMAOptions().decay(0.9).decay_type("threshold"));
  ema.attach(*r.opt);
  const void* ptr = ema.decay_tensor().data_ptr();
  for (int64_t i = 0; i < 3; ++i) {
    auto [x, y] = batch(i, torch::kCPU);
    r.opt->zero_grad();
    r.loss_fn()(x, y).backward();
    fusetrain::fused_step(*r.opt, nullptr, &ema);
  }
  EXPECT_EQ(ema.decay_tensor().data_ptr(), ptr) << "written in place, never replaced";
  EXPECT_FLOAT_EQ(ema.decay_tensor().item<float>(), 4.0f / 13.0f);  // threshold schedule, third update
}

// ---- GPU ------------------------------------------------------------------------

namespace {

// Runs `calls` calls of an eager and a captured step over the same batches.
void run_pair(Rig& eager, Rig& graph, int64_t calls, int64_t accumulate, int64_t late_from) {
  auto opts = fusetrain::TrainStepOptions().accumulate(accumulate).warmup_steps(1);
  fusetrain::TrainStep se(eager.loss_fn(), *eager.opt, eager.scaler.get(), opts);
  fusetrain::TrainStep sg(graph.loss_fn(), *graph.opt, graph.scaler.get(),
                          fusetrain::TrainStepOptions(opts).mode(fusetrain::StepMode::CudaGraph));
  for (int64_t i = 0; i < calls; ++i) {
    eager.net->late = graph.net->late = late_from >= 0 && i >= late_from;
    auto [x, y] = batch(i, torch::kCUDA);
    se(x, y);
    sg(x, y);
  }
  torch::cuda::synchronize();
  auto pa = eager.net->parameters(), pb = graph.net->parameters();
  for (size_t k = 0; k < pa.size(); ++k)
    EXPECT_TRUE(torch::allclose(pa[k], pb[k], 1e-5, 1e-6)) << "param " << k;
}

}  // namespace

TEST(CaptureCuda, SurvivesAnotherThreadUsingCuda) {
  SKIP_WITHOUT_CUDA();
  std::atomic<bool> stop{false};
  std::string pinner_error;  // an exception escaping a std::thread would end the whole test program
  std::thread pinner([&] {  // what a data loader's pin-memory thread does
    try {
      while (!stop) {
        // Not randn: a draw from the global generator here would change the rigs' seeded weights.
        auto t = torch::ones({1 << 16}).pin_memory();
        t.to(torch::kCUDA, /*non_blocking=*/true);
        // Then waits for its own stream (a blocking copy does), as the Python test does; a device-wide
        // sync while another thread captures is outside what a loader thread does.
        t.to(torch::kCUDA);
      }
    } catch (const std::exception& e) {
      pinner_error = e.what();
    }
  });
  std::string step_error;
  try {
    Rig eager(torch::kCUDA), graph(torch::kCUDA);
    run_pair(eager, graph, 10, 1, -1);
  } catch (const std::exception& e) {
    step_error = e.what();
  }
  stop = true;
  pinner.join();  // before any failure is reported: a joinable thread must not be destroyed
  EXPECT_EQ(step_error.substr(0, step_error.find('\n')), "") << step_error;
  EXPECT_EQ(pinner_error.substr(0, pinner_error.find('\n')), "") << pinner_error;
}

TEST(CaptureCuda, ParamWithFirstGradientAfterWarmup) {
  SKIP_WITHOUT_CUDA();
  {
    Rig eager(torch::kCUDA), graph(torch::kCUDA);
    // Layer b first gets a gradient in the captured call (the call after the warm-up); its state was
    // made by prepare_capture, and the replays match the eager steps.
    run_pair(eager, graph, 6, 1, 1);
  }
  // With accumulation, b's first gradient inside the step's capture (call 3; call 2 captured the
  // micro-step without b) would be overwritten by every replay: refused.
  Rig eager(torch::kCUDA), graph(torch::kCUDA);
  expect_error([&] { run_pair(eager, graph, 8, 2, 3); }, "got their first gradient inside the CUDA-graph capture");
}

TEST(CaptureCuda, StepResultsSurviveMicroStepReplays) {
  SKIP_WITHOUT_CUDA();
  Rig r(torch::kCUDA);
  fusetrain::TrainStep step(r.loss_fn(), *r.opt, r.scaler.get(),
                            fusetrain::TrainStepOptions().mode(fusetrain::StepMode::CudaGraph).accumulate(2)
                                .warmup_steps(1).autocast_dtype(torch::kHalf));
  for (int64_t i = 0; i < 6; ++i) {
    auto [x, y] = batch(i, torch::kCUDA);
    step(x, y);
  }
  ASSERT_TRUE(step.captured());
  auto norm = r.opt->last_grad_norm().clone();
  auto [x, y] = batch(6, torch::kCUDA);
  step(x, y);  // a micro-step replay, same pool
  EXPECT_TRUE(torch::equal(r.opt->last_grad_norm(), norm));
}
