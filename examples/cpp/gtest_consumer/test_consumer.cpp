// A downstream test suite: checks a training step of the project's model
// with fusetrain's optimizer against plain LibTorch.
#include <fusetrain/fusetrain.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

TEST(Consumer, FusedAdamWMatchesLibTorch) {
  torch::manual_seed(0);
  torch::nn::Linear a(8, 4), b(8, 4);
  {
    torch::NoGradGuard g;
    b->weight.copy_(a->weight);
    b->bias.copy_(a->bias);
  }
  fusetrain::AdamW ours(a->parameters(), fusetrain::AdamWOptions(1e-2));
  torch::optim::AdamW ref(b->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int i = 0; i < 10; ++i) {
    auto x = torch::randn({16, 8});
    ours.zero_grad();
    ref.zero_grad();
    a(x).pow(2).mean().backward();
    b(x).pow(2).mean().backward();
    ours.step();
    ref.step();
  }
  EXPECT_TRUE(torch::allclose(a->weight, b->weight, 1e-5, 1e-6));
}

TEST(Consumer, SkipsNonFiniteStep) {
  torch::nn::Linear m(3, 3);
  fusetrain::SGD opt(m->parameters(), fusetrain::SGDOptions(0.1));
  m(torch::randn({2, 3})).sum().backward();
  m->weight.mutable_grad()[0][0] = std::numeric_limits<float>::infinity();
  auto before = m->weight.detach().clone();
  fusetrain::LossScaler scaler;
  scaler.scale(torch::ones({}));
  fusetrain::fused_step(opt, &scaler);
  EXPECT_TRUE(torch::equal(m->weight, before));
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 32768.0);
}
