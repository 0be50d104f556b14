// update_scale_, ema_update_ and gated_copy_ on CPU against references written here.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <fusetrain/fusetrain.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

// GradScaler's rule, in plain C++.
void ref_update(double& scale, int& tracker, bool inf, double growth, double backoff, int interval) {
  if (inf) {
    scale *= backoff;
    tracker = 0;
    return;
  }
  if (++tracker == interval) {
    const float grown = static_cast<float>(scale * growth);
    if (std::isfinite(grown)) scale = grown;
    tracker = 0;
  }
}

TEST(UpdateScale, FollowsGradScalerRuleOverARandomSequence) {
  at::Tensor scale = at::full({}, 1024.f, at::kFloat);
  at::Tensor tracker = at::zeros({}, at::kInt);
  double rs = 1024.0;
  int rt = 0;
  std::srand(3);
  for (int i = 0; i < 200; ++i) {
    const bool inf = std::rand() % 7 == 0;
    at::Tensor fi = at::full({}, inf ? 1.f : 0.f, at::kFloat);
    fusetrain::update_scale_(scale, tracker, fi, 2.0, 0.5, 3);
    ref_update(rs, rt, inf, 2.0, 0.5, 3);
    ASSERT_EQ(scale.item<float>(), static_cast<float>(rs)) << "iteration " << i;
    ASSERT_EQ(tracker.item<int>(), rt) << "iteration " << i;
  }
}

TEST(UpdateScale, DoesNotGrowToInfinity) {
  at::Tensor scale = at::full({}, std::numeric_limits<float>::max() / 1.5f, at::kFloat);
  const float before = scale.item<float>();
  at::Tensor tracker = at::zeros({}, at::kInt);
  fusetrain::update_scale_(scale, tracker, at::zeros({}, at::kFloat), 2.0, 0.5, 1);
  EXPECT_EQ(scale.item<float>(), before);
  EXPECT_EQ(tracker.item<int>(), 0);
}

TEST(UpdateScale, RejectsBadArguments) {
  at::Tensor scale = at::full({}, 8.f, at::kFloat);
  at::Tensor tracker = at::zeros({}, at::kInt);
  at::Tensor fi = at::zeros({}, at::kFloat);
  EXPECT_THROW(fusetrain::update_scale_(scale.to(at::kDouble), tracker, fi, 2.0, 0.5, 10), c10::Error);
  EXPECT_THROW(fusetrain::update_scale_(scale, tracker.to(at::kLong), fi, 2.0, 0.5, 10), c10::Error);
  EXPECT_THROW(fusetrain::update_scale_(scale, tracker, fi, 0.5, 0.5, 10), c10::Error);
  EXPECT_THROW(fusetrain::update_scale_(scale, tracker, fi, 2.0, 1.5, 10), c10::Error);
  EXPECT_THROW(fusetrain::update_scale_(scale, tracker, fi, 2.0, 0.5, 0), c10::Error);
}

TEST(EmaUpdate, MatchesScalarReferenceAcrossDtypesAndSizes) {
  at::manual_seed(5);
  const float decay = 0.97f;
  for (at::ScalarType dt : {at::kFloat, at::kHalf, at::kBFloat16}) {
    std::vector<at::Tensor> ema, src, expect;
    for (int64_t n : {1, 7, 1031, 65537}) {
      ema.push_back(at::randn({n}).to(dt));
      src.push_back(at::randn({n}).to(dt));
      at::Tensor e = ema.back().to(at::kDouble), s = src.back().to(at::kDouble);
      const double w = 1.0 - static_cast<double>(decay);
      expect.push_back(e + w * (s - e));
    }
    fusetrain::ema_update_(ema, src, at::full({}, decay, at::kFloat));
    const double tol = dt == at::kFloat ? 1e-6 : (dt == at::kHalf ? 1e-3 : 8e-3);
    for (size_t i = 0; i < ema.size(); ++i) {
      EXPECT_TRUE(at::allclose(ema[i].to(at::kDouble), expect[i], tol, tol)) << dt << " tensor " << i;
    }
  }
}

TEST(EmaUpdate, SkipsOnFoundInfAndRejectsMismatches) {
  std::vector<at::Tensor> ema = {at::randn({33})}, src = {at::randn({33})};
  at::Tensor before = ema[0].clone();
  fusetrain::ema_update_(ema, src, at::full({}, 0.5f, at::kFloat), at::ones({}, at::kFloat));
  EXPECT_TRUE(at::equal(ema[0], before));
  std::vector<at::Tensor> half_src = {src[0].to(at::kHalf)};
  EXPECT_THROW(fusetrain::ema_update_(ema, half_src, at::full({}, 0.5f, at::kFloat)), c10::Error);
  std::vector<at::Tensor> short_src = {at::randn({32})};
  EXPECT_THROW(fusetrain::ema_update_(ema, short_src, at::full({}, 0.5f, at::kFloat)), c10::Error);
}

TEST(GatedCopy, CopiesEveryDtypeUnlessFlaggedAndRejectsMismatches) {
  std::vector<at::Tensor> dst = {at::randn({7, 5}), at::randint(-9, 9, {1031}, at::kLong),
                                 at::randn({2, 3, 4, 5}).contiguous(at::MemoryFormat::ChannelsLast).to(at::kBFloat16),
                                 at::zeros({0})};
  std::vector<at::Tensor> src;
  for (const auto& d : dst) src.push_back(at::empty_like(d).copy_(d.to(at::kFloat).add(1).to(d.scalar_type())));
  std::vector<at::Tensor> before;
  for (const auto& d : dst) before.push_back(d.clone());
  fusetrain::gated_copy_(dst, src, at::ones({}, at::kFloat));
  for (size_t i = 0; i < dst.size(); ++i) EXPECT_TRUE(at::equal(dst[i], before[i])) << "pair " << i;
  fusetrain::gated_copy_(dst, src, at::zeros({}, at::kFloat));
  for (size_t i = 0; i < dst.size(); ++i) {
    EXPECT_TRUE(at::equal(dst[i], src[i])) << "pair " << i;
    EXPECT_EQ(dst[i].strides(), src[i].strides()) << "pair " << i;
  }
  std::vector<at::Tensor> a = {at::zeros({4})}, wrong_dtype = {at::zeros({4}, at::kDouble)},
                          wrong_shape = {at::zeros({5})};
  EXPECT_THROW(fusetrain::gated_copy_(a, wrong_dtype, at::zeros({}, at::kFloat)), c10::Error);
  EXPECT_THROW(fusetrain::gated_copy_(a, wrong_shape, at::zeros({}, at::kFloat)), c10::Error);
  EXPECT_THROW(fusetrain::gated_copy_(a, a, at::zeros({2}, at::kFloat)), c10::Error);
}

}  // namespace
