// Trains a small MLP on synthetic regression data with fusetrain::AdamW,
// dynamic loss scaling and an EMA of the weights, all in the fused step.
#include <fusetrain/fusetrain.h>
#include <torch/torch.h>

#include <cstdio>

int main() {
  torch::manual_seed(0);
  const auto device = torch::cuda::is_available() ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);

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

  double initial_loss = 0.0;
  for (int64_t step = 0; step < steps; ++step) {
    auto idx = torch::randint(0, x.size(0), {128}, torch::TensorOptions().dtype(torch::kLong).device(device));
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model->forward(x.index_select(0, idx)), y.index_select(0, idx));
    if (step == 0) initial_loss = loss.item<double>();
    scaler.scale(loss).backward();
    fusetrain::fused_step(optimizer, scaler, ema);  // unscale, inf check, clip, update, EMA, scale update
    if (step % 100 == 0 || step == steps - 1) std::printf("step %3lld  loss %.5f\n", (long long)step, loss.item<double>());
  }

  torch::NoGradGuard no_grad;
  auto ema_model = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(ema.module());
  const double final_loss = torch::mse_loss(model->forward(x), y).item<double>();
  const double ema_loss = torch::mse_loss(ema_model->forward(x), y).item<double>();
  std::printf("final loss %.5f  ema loss %.5f  loss scale %.0f\n", final_loss, ema_loss, scaler.get_scale());
  // Exit status for CI: the loss must have dropped well below its start.
  return final_loss < 0.5 * initial_loss ? 0 : 1;
}
