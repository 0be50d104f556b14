// The batch-norm ops' CPU kernels against scalar double references written
// here, called through the dispatcher as a C++ user would.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <fusetrain/fusetrain.h>

#include <cmath>
#include <tuple>
#include <vector>

namespace {

using Stats = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

Stats bn_stats(const at::Tensor& x) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fusetrain::bn_stats", "").typed<Stats(const at::Tensor&)>();
  return op.call(x);
}

std::tuple<at::Tensor, at::Tensor> bn_backward_reduce(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusetrain::bn_backward_reduce", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(dy, x, mean);
}

at::Tensor bn_elemt(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                    const std::optional<at::Tensor>& w, const std::optional<at::Tensor>& b) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusetrain::bn_elemt", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  return op.call(x, mean, invstd, w, b);
}

at::Tensor bn_backward_elemt(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                             const std::optional<at::Tensor>& w, const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu,
                             const at::Tensor& count) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fusetrain::bn_backward_elemt", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, count);
}

// x as a double (N, C, S) array in logical order.
std::vector<double> logical(const at::Tensor& x) {
  at::Tensor d = x.to(at::kDouble).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

void ref_stats(const at::Tensor& x, std::vector<double>& mean, std::vector<double>& m2) {
  const int64_t N = x.size(0), C = x.size(1), S = x.numel() / std::max<int64_t>(N * C, 1);
  std::vector<double> v = logical(x);
  mean.assign(C, 0.0);
  m2.assign(C, 0.0);
  for (int64_t c = 0; c < C; ++c) {
    double s = 0.0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < S; ++k) s += v[(n * C + c) * S + k];
    mean[c] = N * S > 0 ? s / static_cast<double>(N * S) : 0.0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < S; ++k) {
        const double d = v[(n * C + c) * S + k] - mean[c];
        m2[c] += d * d;
      }
  }
}

at::Tensor input(std::vector<int64_t> shape, at::ScalarType dt, bool channels_last) {
  at::Tensor x = (at::randn(shape, at::kDouble) * 2.0 + 5.0).to(dt);
  if (channels_last) x = x.contiguous(shape.size() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d);
  return x;
}

TEST(SyncBNOps, StatsMatchScalarReference) {
  at::manual_seed(0);
  for (auto dt : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (bool cl : {false, true}) {
      for (std::vector<int64_t> shape : std::vector<std::vector<int64_t>>{{1, 3, 7, 13}, {5, 67, 3, 3}, {9, 2, 40, 41}, {2, 3, 4, 5, 6}}) {
        at::Tensor x = input(shape, dt, cl);
        auto [count, mean, m2] = bn_stats(x);
        std::vector<double> rm, rq;
        ref_stats(x, rm, rq);
        EXPECT_EQ(count.item<float>(), static_cast<float>(x.numel() / shape[1]));
        for (int64_t c = 0; c < shape[1]; ++c) {
          EXPECT_NEAR(mean[c].item<float>(), rm[c], 1e-6 * std::abs(rm[c]) + 1e-6) << c;
          EXPECT_NEAR(m2[c].item<float>(), rq[c], 1e-5 * rq[c] + 1e-6) << c;
        }
      }
    }
  }
}

TEST(SyncBNOps, EmptyBatchGivesZeros) {
  auto [count, mean, m2] = bn_stats(at::empty({0, 4, 3, 3}));
  EXPECT_EQ(count.item<float>(), 0.f);
  EXPECT_TRUE(mean.eq(0).all().item<bool>());
  EXPECT_TRUE(m2.eq(0).all().item<bool>());
  auto [s1, s2] = bn_backward_reduce(at::empty({0, 4}), at::empty({0, 4}), mean);
  EXPECT_TRUE(s1.eq(0).all().item<bool>());
  EXPECT_TRUE(s2.eq(0).all().item<bool>());
}

TEST(SyncBNOps, BackwardReduceMatchesScalarReference) {
  at::manual_seed(1);
  for (bool cl : {false, true}) {
    at::Tensor x = input({6, 5, 7, 9}, at::kFloat, cl);
    at::Tensor dy = input({6, 5, 7, 9}, at::kFloat, cl);
    at::Tensor mean = at::randn({5});
    auto [sum_dy, sum_dy_xmu] = bn_backward_reduce(dy, x, mean);
    std::vector<double> vx = logical(x), vg = logical(dy);
    for (int64_t c = 0; c < 5; ++c) {
      double a = 0.0, b = 0.0;
      const double m = mean[c].item<double>();
      for (int64_t n = 0; n < 6; ++n)
        for (int64_t s = 0; s < 63; ++s) {
          const int64_t i = (n * 5 + c) * 63 + s;
          a += vg[i];
          b += vg[i] * (vx[i] - m);
        }
      EXPECT_NEAR(sum_dy[c].item<float>(), a, 1e-4 * std::abs(a) + 1e-3);
      EXPECT_NEAR(sum_dy_xmu[c].item<float>(), b, 1e-4 * std::abs(b) + 1e-3);
    }
  }
}

TEST(SyncBNOps, ElementwiseMatchesScalarReference) {
  at::manual_seed(2);
  for (bool cl : {false, true}) {
    at::Tensor x = input({3, 6, 5, 4}, at::kFloat, cl);
    at::Tensor dy = input({3, 6, 5, 4}, at::kFloat, cl);
    at::Tensor mean = at::randn({6}), invstd = at::rand({6}) + 0.5, w = at::randn({6}), b = at::randn({6});
    at::Tensor sum_dy = at::randn({6}), sum_dy_xmu = at::randn({6}), count = at::full({}, 120.0, at::kFloat);
    at::Tensor y = bn_elemt(x, mean, invstd, w, b);
    at::Tensor dx = bn_backward_elemt(dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, count);
    EXPECT_EQ(y.strides(), x.strides());
    EXPECT_EQ(dx.strides(), x.strides());
    std::vector<double> vx = logical(x), vg = logical(dy), vy = logical(y), vdx = logical(dx);
    for (int64_t i = 0; i < x.numel(); ++i) {
      const int64_t c = (i / 20) % 6;
      const double m = mean[c].item<double>(), is = invstd[c].item<double>(), wc = w[c].item<double>();
      const double ry = (vx[i] - m) * is * wc + b[c].item<double>();
      const double rdx = is * wc *
                         (vg[i] - sum_dy[c].item<double>() / 120.0 - (vx[i] - m) * is * is * sum_dy_xmu[c].item<double>() / 120.0);
      EXPECT_NEAR(vy[i], ry, 1e-5 * (std::abs(ry) + 1.0));
      EXPECT_NEAR(vdx[i], rdx, 1e-5 * (std::abs(rdx) + 1.0));
    }
  }
}

TEST(SyncBNOps, RejectsBadArguments) {
  EXPECT_THROW(bn_stats(at::randn({5})), c10::Error);
  EXPECT_THROW(bn_stats(at::randn({2, 3}, at::kDouble)), c10::Error);
  EXPECT_THROW(bn_elemt(at::randn({2, 3}), at::zeros({4}), at::ones({3}), std::nullopt, std::nullopt), c10::Error);
}

}  // namespace
