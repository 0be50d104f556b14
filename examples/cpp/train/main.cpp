// Trains a small MLP on synthetic regression data with fusetrain::AdamW,
// dynamic loss scaling and an EMA of the weights, all in the fused step.
//
//   train                      hand-written loop (the default)
//   train --mode eager         the same step through fusetrain::TrainStep
//   train --mode cuda_graph    TrainStep captured as a CUDA graph and replayed
//                              (eager when CUDA is not available)
#include <fusetrain/fusetrain.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <string>

int main(int argc, char** argv) {
  std::string mode = "loop";
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--mode") == 0 && i + 1 < argc) {
      mode = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--mode loop|eager|cuda_graph]\n", argv[0]);
      return 2;
    }
  }
  if (mode != "loop" && mode != "eager" && mode != "cuda_graph") {
    std::fprintf(stderr, "--mode must be one of loop, eager, cuda_graph; got '%s'\n", mode.c_str());
    return 2;
  }
  torch::manual_seed(0);
  const bool cuda = torch::cuda::is_available();
  const auto device = cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  if (mode == "cuda_graph" && !(cuda && fusetrain::built_with_cuda())) {
    std::printf("CUDA not available: running --mode eager instead of cuda_graph\n");
    mode = "eager";
  }
  std::printf("mode %s on %s\n", mode.c_str(), device.str().c_str());

  // y = sin(x . w) + noise
  auto x = torch::randn({1024, 16}, device);
  auto w = torch::randn({16, 1}, device) / 4.0;
  auto y = torch::sin(x.matmul(w)) + 0.01 * torch::randn({1024, 1}, device);

  torch::nn::Sequential model(torch::nn::Linear(16, 64), torch::nn::ReLU(), torch::nn::Linear(64, 1));
  model->to(device);

  const int64_t steps = 400;
  fusetrain::AdamW optimizer(model->parameters(), fusetrain::AdamWOptions(1e-2).weight_decay(1e-4).max_grad_norm(1.0));
  fusetrain::LossScaler scaler;  // GradScaler semantics, scale kept on the device
  fusetrain::ModelEMA ema(model, fusetrain::ModelEMAOptions().decay(0.99).decay_type("exp").total_steps(steps));
  ema.attach(optimizer);  // the EMA rides in the optimizer's update pass

  // forward + loss; TrainStep adds backward (scaled) and the fused tail.
  auto loss_fn = [model](const torch::Tensor& xb, const torch::Tensor& yb) mutable {
    return torch::mse_loss(model->forward(xb), yb);
  };
  fusetrain::TrainStep train_step(
      loss_fn, optimizer, &scaler,
      fusetrain::TrainStepOptions().mode(mode == "cuda_graph" ? fusetrain::StepMode::CudaGraph
                                                               : fusetrain::StepMode::Eager));

  double initial_loss = 0.0;
  for (int64_t step = 0; step < steps; ++step) {
    auto idx = torch::randint(0, x.size(0), {128}, torch::TensorOptions().dtype(torch::kLong).device(device));
    auto xb = x.index_select(0, idx), yb = y.index_select(0, idx);
    torch::Tensor loss;
    if (mode == "loop") {
      optimizer.zero_grad();
      loss = loss_fn(xb, yb);
      scaler.scale(loss).backward();
      fusetrain::fused_step(optimizer, scaler, ema);  // unscale, inf check, clip, update, EMA, scale update
    } else {
      loss = train_step(xb, yb);  // in cuda_graph mode: a replay after 3 warm-up steps
    }
    // .item() syncs with the host; it is outside the step, so the graph is unaffected
    if (step == 0) initial_loss = loss.item<double>();
    if (step % 100 == 0 || step == steps - 1) std::printf("step %3lld  loss %.5f\n", (long long)step, loss.item<double>());
  }
  if (mode == "cuda_graph") std::printf("captured: %s\n", train_step.captured() ? "yes" : "no");

  torch::NoGradGuard no_grad;
  auto ema_model = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(ema.module());
  const double final_loss = torch::mse_loss(model->forward(x), y).item<double>();
  const double ema_loss = torch::mse_loss(ema_model->forward(x), y).item<double>();
  std::printf("final loss %.5f  ema loss %.5f  loss scale %.0f\n", final_loss, ema_loss, scaler.get_scale());
  // Exit status for CI: the loss must have dropped well below its start.
  return final_loss < 0.5 * initial_loss ? 0 : 1;
}
