// Tests of fusetrain::TrainStep (fusetrain/step.h): the eager step against a
// hand-written loop, gradient accumulation, autocast, option checks, and on a
// GPU the captured CUDA-graph step against the eager one.
#include <gtest/gtest.h>

#include <ATen/autocast_mode.h>
#include <fusetrain/fusetrain.h>
#include <torch/torch.h>

#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>

#include "test_util.h"

namespace {

using fusetrain_test::expect_error;

// A small model with AdamW (clipping on), a loss scaler and an attached EMA.
struct Rig {
  torch::nn::Sequential model;
  std::unique_ptr<fusetrain::AdamW> opt;
  std::unique_ptr<fusetrain::LossScaler> scaler;
  std::unique_ptr<fusetrain::ModelEMA> ema;

  explicit Rig(torch::Device device) {
    torch::manual_seed(7);
    model = torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(), torch::nn::Linear(32, 4));
    model->to(device);
    opt = std::make_unique<fusetrain::AdamW>(model->parameters(),
                                             fusetrain::AdamWOptions(1e-2).weight_decay(0.01).max_grad_norm(1.0));
    scaler = std::make_unique<fusetrain::LossScaler>(
        fusetrain::LossScalerOptions().init_scale(1024.0).growth_interval(3));
    ema = std::make_unique<fusetrain::ModelEMA>(model,
                                                fusetrain::ModelEMAOptions().decay(0.9).decay_type("threshold"));
    ema->attach(*opt);
  }
  fusetrain::TrainStep::LossFn loss_fn() const {
    auto m = model;
    return [m](const torch::Tensor& x, const torch::Tensor& y) mutable { return torch::mse_loss(m->forward(x), y); };
  }
  // The hand-written step the TrainStep must reproduce.
  torch::Tensor hand_step(const torch::Tensor& x, const torch::Tensor& y, int64_t accumulate, bool do_step) {
    auto loss = loss_fn()(x, y);
    scaler->scale(accumulate > 1 ? loss / static_cast<double>(accumulate) : loss).backward();
    if (do_step) {
      fusetrain::fused_step(*opt, *scaler, *ema);
      opt->zero_grad();
    }
    return loss.detach();
  }
  std::vector<torch::Tensor> snapshot() const {
    std::vector<torch::Tensor> out;
    for (const auto& p : model->parameters()) out.push_back(p.detach().clone());
    return out;
  }
};

std::pair<torch::Tensor, torch::Tensor> batch(int64_t i, torch::Device device, int64_t n = 16) {
  torch::manual_seed(100 + i);
  auto x = torch::randn({n, 8});
  auto y = torch::randn({n, 4});
  return {x.to(device), y.to(device)};
}

// exact: bit-identical; otherwise allclose(rtol, atol).
void expect_same(const Rig& a, const Rig& b, bool exact, double rtol = 1e-5, double atol = 1e-6) {
  auto pa = a.model->parameters(), pb = b.model->parameters();
  auto ea = a.ema->module()->parameters(), eb = b.ema->module()->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    if (exact) {
      EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "param " << i;
      EXPECT_TRUE(torch::equal(ea[i], eb[i])) << "ema param " << i;
    } else {
      EXPECT_TRUE(torch::allclose(pa[i], pb[i], rtol, atol))
          << "param " << i << " max diff " << (pa[i] - pb[i]).abs().max().item<double>();
      EXPECT_TRUE(torch::allclose(ea[i], eb[i], rtol, atol))
          << "ema param " << i << " max diff " << (ea[i] - eb[i]).abs().max().item<double>();
    }
  }
  EXPECT_EQ(a.scaler->get_scale(), b.scaler->get_scale());
  EXPECT_EQ(a.ema->step_tensor().item<float>(), b.ema->step_tensor().item<float>());
}

}  // namespace

TEST(TrainStepEager, MatchesHandWrittenLoop) {
  Rig a(torch::kCPU), b(torch::kCPU);
  fusetrain::TrainStep step(a.loss_fn(), *a.opt, a.scaler.get());
  for (int64_t i = 0; i < 7; ++i) {
    auto [x, y] = batch(i, torch::kCPU);
    if (i == 3) x[2][5] = std::numeric_limits<float>::infinity();  // non-finite grads: step skipped
    auto before = a.snapshot();
    auto la = step(x, y);
    auto lb = b.hand_step(x, y, 1, true);
    EXPECT_TRUE(torch::allclose(la, lb, 0.0, 0.0, /*equal_nan=*/true)) << "step " << i;
    EXPECT_FALSE(la.requires_grad());
    if (i == 3) {
      auto now = a.snapshot();
      for (size_t k = 0; k < now.size(); ++k) EXPECT_TRUE(torch::equal(now[k], before[k])) << "param " << k;
    }
  }
  expect_same(a, b, /*exact=*/true);
  EXPECT_EQ(a.ema->step_tensor().item<float>(), 6.0f);  // one of 7 steps skipped
  EXPECT_EQ(step.calls(), 7);
  EXPECT_FALSE(step.captured());
  EXPECT_EQ(step.capture_count(), 0);
  for (const auto& p : a.model->parameters()) EXPECT_FALSE(p.grad().defined());  // zero_grad(set_to_none)
}

TEST(TrainStepEager, AccumulateMatchesHandWrittenLoop) {
  Rig a(torch::kCPU), b(torch::kCPU);
  fusetrain::TrainStep step(a.loss_fn(), *a.opt, a.scaler.get(), fusetrain::TrainStepOptions().accumulate(2));
  for (int64_t i = 0; i < 8; ++i) {
    auto [x, y] = batch(i, torch::kCPU);
    const bool do_step = i % 2 == 1;
    auto before = a.snapshot();
    auto la = step(x, y);
    auto lb = b.hand_step(x, y, 2, do_step);
    EXPECT_TRUE(torch::equal(la, lb)) << "call " << i;
    auto now = a.snapshot();
    for (size_t k = 0; k < now.size(); ++k)  // params move on every second call only
      EXPECT_EQ(torch::equal(now[k], before[k]), !do_step) << "call " << i << " param " << k;
  }
  expect_same(a, b, /*exact=*/true);
  EXPECT_EQ(a.ema->step_tensor().item<float>(), 4.0f);
}

TEST(TrainStepEager, AutocastBFloat16MatchesHandWrittenLoop) {
  Rig a(torch::kCPU), b(torch::kCPU);
  std::vector<torch::ScalarType> seen;
  auto m = a.model;
  auto loss_fn = [m, &seen](const torch::Tensor& x, const torch::Tensor& y) mutable {
    auto out = m->forward(x);
    seen.push_back(out.scalar_type());
    return torch::mse_loss(out.to(torch::kFloat), y);
  };
  fusetrain::TrainStep step(loss_fn, *a.opt, a.scaler.get(),
                            fusetrain::TrainStepOptions().autocast_dtype(torch::kBFloat16));
  for (int64_t i = 0; i < 4; ++i) {
    auto [x, y] = batch(i, torch::kCPU);
    auto la = step(x, y);
    EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));  // restored after the step
    // the same step by hand, autocast around the forward only
    at::autocast::set_autocast_enabled(c10::DeviceType::CPU, true);
    at::autocast::set_autocast_dtype(c10::DeviceType::CPU, torch::kBFloat16);
    at::autocast::increment_nesting();
    auto loss = torch::mse_loss(b.model->forward(x).to(torch::kFloat), y);
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(c10::DeviceType::CPU, false);
    b.scaler->scale(loss).backward();
    fusetrain::fused_step(*b.opt, *b.scaler, *b.ema);
    b.opt->zero_grad();
    EXPECT_TRUE(torch::equal(la, loss.detach())) << "step " << i;
  }
  ASSERT_EQ(seen.size(), 4u);
  for (auto t : seen) EXPECT_EQ(t, torch::kBFloat16);
  expect_same(a, b, /*exact=*/true);
}

TEST(TrainStepEager, WithoutScalerOrEmaMatchesPlainStep) {
  torch::manual_seed(3);
  torch::nn::Linear ma(6, 2), mb(6, 2);
  {
    torch::NoGradGuard ng;
    mb->weight.copy_(ma->weight);
    mb->bias.copy_(ma->bias);
  }
  fusetrain::SGD oa(ma->parameters(), fusetrain::SGDOptions(0.1).momentum(0.9));
  fusetrain::SGD ob(mb->parameters(), fusetrain::SGDOptions(0.1).momentum(0.9));
  fusetrain::TrainStep step([ma](const torch::Tensor& x, const torch::Tensor& y) mutable {
                              return torch::nn::functional::cross_entropy(ma->forward(x), y);
                            },
                            oa);
  for (int64_t i = 0; i < 5; ++i) {
    torch::manual_seed(200 + i);
    auto x = torch::randn({10, 6});
    auto y = torch::randint(0, 2, {10}, torch::kLong);
    step(x, y);
    torch::nn::functional::cross_entropy(mb->forward(x), y).backward();
    ob.step();
    ob.zero_grad();
  }
  EXPECT_TRUE(torch::equal(ma->weight, mb->weight));
  EXPECT_TRUE(torch::equal(ma->bias, mb->bias));
}

TEST(TrainStepOptionsCheck, BadOptionsRaise) {
  Rig a(torch::kCPU);
  using fusetrain::StepMode;
  using fusetrain::TrainStepOptions;
  expect_error([&] { fusetrain::TrainStep(a.loss_fn(), *a.opt, nullptr, TrainStepOptions().accumulate(0)); },
               "accumulate must be >= 1, got 0");
  expect_error([&] { fusetrain::TrainStep(a.loss_fn(), *a.opt, nullptr, TrainStepOptions().warmup_steps(-1)); },
               "warmup_steps must be >= 0, got -1");
  expect_error(
      [&] { fusetrain::TrainStep(a.loss_fn(), *a.opt, nullptr, TrainStepOptions().autocast_dtype(torch::kFloat)); },
      "autocast_dtype must be Half or BFloat16");
  expect_error([&] { fusetrain::TrainStep(nullptr, *a.opt); }, "loss_fn is empty");
  expect_error(
      [&] {
        fusetrain::TrainStep(a.loss_fn(), *a.opt, nullptr,
                             TrainStepOptions().mode(StepMode::CudaGraph).warmup_steps(0));
      },
      fusetrain::built_with_cuda() ? "warmup_steps must be >= 1 with StepMode::CudaGraph" : "needs CUDA");
  // a loss that is not a scalar, or that no parameter reached
  fusetrain::TrainStep vec([](const torch::Tensor& x, const torch::Tensor&) { return x * 2; }, *a.opt);
  auto [x, y] = batch(0, torch::kCPU);
  expect_error([&] { vec(x, y); }, "single-element loss");
  fusetrain::TrainStep detached([](const torch::Tensor& x, const torch::Tensor&) { return x.sum(); }, *a.opt);
  expect_error([&] { detached(x, y); }, "does not require grad");
}

TEST(TrainStepCudaGraph, CpuTensorsRaiseNamingCuda) {
  Rig a(torch::kCPU);
  auto [x, y] = batch(0, torch::kCPU);
  auto before = a.snapshot();
  expect_error(
      [&] {
        fusetrain::TrainStep step(a.loss_fn(), *a.opt, a.scaler.get(),
                                  fusetrain::TrainStepOptions().mode(fusetrain::StepMode::CudaGraph));
        step(x, y);
      },
      "CUDA");
  if (fusetrain::built_with_cuda()) {
    fusetrain::TrainStep step(a.loss_fn(), *a.opt, a.scaler.get(),
                              fusetrain::TrainStepOptions().mode(fusetrain::StepMode::CudaGraph));
    expect_error([&] { step(x, y); }, "needs CUDA tensors, got x on cpu");
  }
  auto now = a.snapshot();
  for (size_t k = 0; k < now.size(); ++k) EXPECT_TRUE(torch::equal(now[k], before[k]));
}

// ---- CUDA: captured step -------------------------------------------------------

TEST(TrainStepCudaGraph, CapturedMatchesEager) {
  SKIP_WITHOUT_CUDA();
  const torch::Device dev(torch::kCUDA);
  Rig a(dev), b(dev);
  fusetrain::TrainStep graph(a.loss_fn(), *a.opt, a.scaler.get(),
                             fusetrain::TrainStepOptions().mode(fusetrain::StepMode::CudaGraph).warmup_steps(2));
  fusetrain::TrainStep eager(b.loss_fn(), *b.opt, b.scaler.get());
  torch::Tensor prev;
  for (int64_t i = 0; i < 10; ++i) {
    auto [x, y] = batch(i, dev, i == 7 ? 5 : 16);  // call 7: a partial batch runs eagerly
    auto la = graph(x, y);
    auto lb = eager(x, y);
    EXPECT_TRUE(torch::allclose(la, lb, 1e-5, 1e-6)) << "step " << i;
    if (i >= 3 && i != 7) {
      EXPECT_EQ(la.data_ptr(), prev.data_ptr()) << "replays return the static loss";
    }
    if (i != 7) prev = la;
    EXPECT_EQ(graph.captured(), i >= 2);
  }
  expect_same(a, b, /*exact=*/false);
  EXPECT_EQ(graph.capture_count(), 1);
  graph.reset();
  EXPECT_FALSE(graph.captured());
  for (int64_t i = 10; i < 14; ++i) {  // warm-up again, recapture, replay
    auto [x, y] = batch(i, dev);
    graph(x, y);
    eager(x, y);
  }
  EXPECT_EQ(graph.capture_count(), 2);
  expect_same(a, b, /*exact=*/false);
}

TEST(TrainStepCudaGraph, LrChangeAppliesWithoutRecapture) {
  SKIP_WITHOUT_CUDA();
  const torch::Device dev(torch::kCUDA);
  Rig a(dev), b(dev);
  fusetrain::TrainStep graph(a.loss_fn(), *a.opt, a.scaler.get(),
                             fusetrain::TrainStepOptions().mode(fusetrain::StepMode::CudaGraph).warmup_steps(1));
  fusetrain::TrainStep eager(b.loss_fn(), *b.opt, b.scaler.get());
  for (int64_t i = 0; i < 8; ++i) {
    const double lr = i == 5 ? 0.0 : 1e-2 / (1 + i);
    for (auto* o : {a.opt.get(), b.opt.get()})
      for (auto& g : o->param_groups()) g.options().set_lr(lr);
    auto [x, y] = batch(i, dev);
    auto before = a.snapshot();
    graph(x, y);
    eager(x, y);
    if (i == 5) {  // lr 0 in a replay: the weights stay put
      auto now = a.snapshot();
      for (size_t k = 0; k < now.size(); ++k) EXPECT_TRUE(torch::equal(now[k], before[k])) << "param " << k;
    }
  }
  EXPECT_EQ(graph.capture_count(), 1);
  expect_same(a, b, /*exact=*/false);
}

TEST(TrainStepCudaGraph, InfGradientSkippedInsideTheGraphFp16) {
  SKIP_WITHOUT_CUDA();
  const torch::Device dev(torch::kCUDA);
  Rig a(dev), b(dev);
  auto opts = fusetrain::TrainStepOptions().autocast_dtype(torch::kHalf).warmup_steps(1);
  fusetrain::TrainStep graph(a.loss_fn(), *a.opt, a.scaler.get(),
                             fusetrain::TrainStepOptions(opts).mode(fusetrain::StepMode::CudaGraph));
  fusetrain::TrainStep eager(b.loss_fn(), *b.opt, b.scaler.get(), opts);
  for (int64_t i = 0; i < 3; ++i) {
    auto [x, y] = batch(i, dev);
    graph(x, y);
    eager(x, y);
  }
  ASSERT_TRUE(graph.captured());
  const double scale = a.scaler->get_scale();
  auto before = a.snapshot();
  auto ema_step = a.ema->step_tensor().item<float>();
  auto [x, y] = batch(3, dev);
  x[0][0] = std::numeric_limits<float>::infinity();
  graph(x, y);
  eager(x, y);
  auto now = a.snapshot();
  for (size_t k = 0; k < now.size(); ++k) EXPECT_TRUE(torch::equal(now[k], before[k])) << "param " << k;
  EXPECT_EQ(a.scaler->last_step_skipped().item<float>(), 1.0f);
  EXPECT_EQ(a.scaler->get_scale(), scale * 0.5);
  EXPECT_EQ(a.ema->step_tensor().item<float>(), ema_step);
  for (int64_t i = 4; i < 7; ++i) {  // and it trains on afterwards
    auto [x2, y2] = batch(i, dev);
    graph(x2, y2);
    eager(x2, y2);
  }
  EXPECT_EQ(a.scaler->last_step_skipped().item<float>(), 0.0f);
  EXPECT_FALSE(torch::equal(a.model->parameters()[0], before[0]));
  EXPECT_EQ(graph.capture_count(), 1);
  expect_same(a, b, /*exact=*/false, 1e-3, 1e-4);
}

TEST(TrainStepCudaGraph, AccumulateTwoMatchesEager) {
  SKIP_WITHOUT_CUDA();
  const torch::Device dev(torch::kCUDA);
  Rig a(dev), b(dev);
  auto opts = fusetrain::TrainStepOptions().accumulate(2).warmup_steps(1);
  fusetrain::TrainStep graph(a.loss_fn(), *a.opt, a.scaler.get(),
                             fusetrain::TrainStepOptions(opts).mode(fusetrain::StepMode::CudaGraph));
  fusetrain::TrainStep eager(b.loss_fn(), *b.opt, b.scaler.get(), opts);
  for (int64_t i = 0; i < 12; ++i) {
    auto [x, y] = batch(i, dev);
    auto la = graph(x, y);
    auto lb = eager(x, y);
    EXPECT_TRUE(torch::allclose(la, lb, 1e-5, 1e-6)) << "call " << i;
  }
  EXPECT_TRUE(graph.captured());
  EXPECT_EQ(graph.capture_count(), 2);  // the accumulating call and the stepping call
  expect_same(a, b, /*exact=*/false);
  EXPECT_EQ(a.ema->step_tensor().item<float>(), 6.0f);
}

TEST(TrainStepCudaGraph, HostSyncInLossFnRaisesClearError) {
  SKIP_WITHOUT_CUDA();
  const torch::Device dev(torch::kCUDA);
  Rig a(dev);
  auto m = a.model;
  auto syncing = [m](const torch::Tensor& x, const torch::Tensor& y) mutable {
    auto loss = torch::mse_loss(m->forward(x), y);
    if (loss.item<float>() < 0) return loss * 2;  // a host sync: fine eagerly, not capturable
    return loss;
  };
  fusetrain::TrainStep step(syncing, *a.opt, a.scaler.get(),
                            fusetrain::TrainStepOptions().mode(fusetrain::StepMode::CudaGraph).warmup_steps(1));
  auto [x, y] = batch(0, dev);
  step(x, y);  // warm-up, eager
  auto before = a.snapshot();
  expect_error([&] { step(x, y); }, "could not be captured as a CUDA graph");
  EXPECT_FALSE(step.captured());
  // a second attempt fails the same way (the failed capture was cleaned up)
  expect_error([&] { step(x, y); }, "could not be captured as a CUDA graph");
  EXPECT_EQ(step.capture_count(), 0);
  auto now = a.snapshot();
  for (size_t k = 0; k < now.size(); ++k) EXPECT_TRUE(torch::equal(now[k], before[k]));
  // the device is still usable, eagerly
  fusetrain::TrainStep eager(a.loss_fn(), *a.opt, a.scaler.get());
  eager(x, y);
  EXPECT_FALSE(torch::equal(a.model->parameters()[0], before[0]));
}

TEST(TrainStepCudaGraph, GradsResetOutsideTheStepAreRejected) {
  SKIP_WITHOUT_CUDA();
  const torch::Device dev(torch::kCUDA);
  Rig a(dev);
  fusetrain::TrainStep step(a.loss_fn(), *a.opt, a.scaler.get(),
                            fusetrain::TrainStepOptions().mode(fusetrain::StepMode::CudaGraph).warmup_steps(1));
  auto [x, y] = batch(0, dev);
  step(x, y);
  step(x, y);
  ASSERT_TRUE(step.captured());
  a.opt->zero_grad();  // set_to_none: the graph's gradient buffers are no longer the params' .grad
  expect_error([&] { step(x, y); }, "was replaced or reset since the step was captured");
  step.reset();  // warm up and capture again
  for (int i = 0; i < 3; ++i) step(x, y);
  EXPECT_TRUE(step.captured());
  EXPECT_EQ(step.capture_count(), 2);
}
