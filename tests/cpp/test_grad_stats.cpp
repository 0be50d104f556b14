// grad_stats on CPU against a scalar double reference written here.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <fusetrain/fusetrain.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

double ref_sumsq(const std::vector<at::Tensor>& gs) {
  double s = 0.0;
  for (const auto& g : gs) {
    at::Tensor f = g.to(at::kDouble).contiguous();
    const double* p = f.data_ptr<double>();
    for (int64_t i = 0; i < f.numel(); ++i) s += p[i] * p[i];
  }
  return s;
}

TEST(GradStats, MatchesScalarReferenceAcrossDtypesAndOddSizes) {
  at::manual_seed(0);
  std::vector<at::Tensor> gs = {at::randn({1}), at::randn({7}).to(at::kHalf), at::randn({1031}).to(at::kBFloat16),
                                at::randn({65537}), at::randn({0}), at::randn({3, 5, 7}),
                                at::randn({4099}, at::kDouble)};
  auto [norm, found_inf] = fusetrain::grad_stats(gs);
  const double ref = std::sqrt(ref_sumsq(gs));
  EXPECT_NEAR(norm.item<float>(), ref, 1e-5 * ref);
  EXPECT_EQ(found_inf.item<float>(), 0.f);
  EXPECT_EQ(norm.dim(), 0);
  EXPECT_EQ(norm.scalar_type(), at::kFloat);
}

TEST(GradStats, AppliesInverseScale) {
  at::manual_seed(1);
  std::vector<at::Tensor> gs = {at::randn({513}) * 1024.0, at::randn({9}) * 1024.0};
  at::Tensor inv = at::full({}, 1.0 / 1024.0, at::kFloat);
  auto [norm, found_inf] = fusetrain::grad_stats(gs, inv);
  const double ref = std::sqrt(ref_sumsq(gs)) / 1024.0;
  EXPECT_NEAR(norm.item<float>(), ref, 1e-5 * ref);
}

TEST(GradStats, FlagsInfAndNaN) {
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<at::Tensor> gs = {at::randn({100}), at::randn({70001})};
    gs[1][70000] = bad;
    auto [norm, found_inf] = fusetrain::grad_stats(gs);
    EXPECT_EQ(found_inf.item<float>(), 1.f) << bad;
  }
}

TEST(GradStats, EmptyListGivesZeros) {
  auto [norm, found_inf] = fusetrain::grad_stats({});
  EXPECT_EQ(norm.item<float>(), 0.f);
  EXPECT_EQ(found_inf.item<float>(), 0.f);
}

TEST(GradStats, RejectsBadDtype) {
  for (auto dt : {at::kLong, at::kComplexFloat}) {
    std::vector<at::Tensor> gs = {at::ones({4}, dt)};
    EXPECT_THROW(fusetrain::grad_stats(gs), c10::Error) << dt;
  }
}

}  // namespace
