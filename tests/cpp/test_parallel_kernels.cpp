// The CPU kernels' parallel paths (at::parallel_for over work items) on 4
// threads against the same calls on one thread: hundreds of tensors of odd
// sizes, several of them larger than a work item, so that every kernel's
// parallel region splits across threads. Each work item is computed the same
// way whichever thread runs it, so the results must match bit for bit.
// scripts/sanitize tsan runs these under ThreadSanitizer (NOTE [tsan and
// OpenMP] in csrc/cpu/parallel.h).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <fusetrain/fusetrain.h>

#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "../../csrc/ops/kind_registry.h"

namespace {

using TensorVec = std::vector<at::Tensor>;

constexpr int kThreads = 4;

// Runs f with at::get_num_threads() == n, then restores the setting.
void with_threads(int n, const std::function<void()>& f) {
  const int before = at::get_num_threads();
  at::set_num_threads(n);
  try {
    f();
  } catch (...) {
    at::set_num_threads(before);
    throw;
  }
  at::set_num_threads(before);
}

// 300 sizes: mostly odd and small (many work items of one tensor each), a few
// past the kernels' work item sizes (32768 and 65536 elements: several items
// of one tensor), an empty one and ones.
std::vector<int64_t> odd_sizes() {
  std::vector<int64_t> sizes;
  for (int i = 0; i < 300; ++i) sizes.push_back((i * 7919) % 1531 * 2 + 1);
  sizes[3] = 0;
  sizes[10] = 1;
  sizes[50] = 65537;
  sizes[150] = 32769;
  sizes[299] = 131075;
  return sizes;
}

TensorVec randn_list(const std::vector<int64_t>& sizes, at::ScalarType dt) {
  TensorVec out;
  for (int64_t n : sizes) out.push_back(at::randn({n}).to(dt));
  return out;
}

TensorVec clones(const TensorVec& ts) {
  TensorVec out;
  for (const auto& t : ts) out.push_back(t.clone());
  return out;
}

void expect_same(const TensorVec& a, const TensorVec& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << what << " tensor " << i;
}

TEST(ParallelKernels, GradStatsOnFourThreadsMatchesOneThread) {
  at::manual_seed(11);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const TensorVec gs = randn_list(odd_sizes(), dt);
    std::tuple<at::Tensor, at::Tensor> one, four;
    with_threads(1, [&] { one = fusetrain::grad_stats(gs, at::full({}, 0.5f)); });
    with_threads(kThreads, [&] { four = fusetrain::grad_stats(gs, at::full({}, 0.5f)); });
    EXPECT_TRUE(at::equal(std::get<0>(one), std::get<0>(four))) << dt;
    EXPECT_EQ(std::get<1>(four).item<float>(), 0.f) << dt;
    double ref = 0.0;
    for (const auto& g : gs) ref += g.to(at::kDouble).pow(2).sum().item<double>();
    EXPECT_NEAR(std::get<0>(four).item<float>(), 0.5 * std::sqrt(ref), 1e-5 * std::sqrt(ref)) << dt;
  }
}

TEST(ParallelKernels, EmaUpdateOnFourThreadsMatchesOneThread) {
  at::manual_seed(12);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const TensorVec ema = randn_list(odd_sizes(), dt), src = randn_list(odd_sizes(), dt);
    TensorVec one = clones(ema), four = clones(ema);
    const at::Tensor decay = at::full({}, 0.9f);
    with_threads(1, [&] { fusetrain::ema_update_(one, src, decay); });
    with_threads(kThreads, [&] { fusetrain::ema_update_(four, src, decay); });
    expect_same(one, four, "ema");
    EXPECT_FALSE(at::equal(four[299], ema[299])) << "the update changed nothing";
  }
}

// One Adam group through fusetrain::fused_step_: bfloat16 params with float32
// masters, an EMA, clipping (the grad_stats pass) and a loss scale.
struct AdamGroup {
  TensorVec params, grads, steps, m, v, masters, emas;
  void step() {
    std::vector<double> hyper = {1.0 /*max_grad_norm*/, 1.0 /*masters*/, 1.0 /*ema*/, 0.0 /*maximize*/};
    const std::map<std::string, double> fields = {{"beta1", 0.9}, {"beta2", 0.999}, {"weight_decay", 0.01},
                                                  {"eps", 1e-8}, {"amsgrad", 0.0}, {"decoupled_weight_decay", 1.0},
                                                  {"bias_correction", 1.0}};
    for (const auto& f : fusetrain::detail::find_kind("adam").fields) hyper.push_back(fields.at(f.name));
    fusetrain::fused_step_("adam", params, grads, steps, m, v, {}, masters, emas,
                           {static_cast<int64_t>(params.size())}, {at::full({}, 1e-3f)}, hyper,
                           at::full({}, 0.25f), std::nullopt, at::full({}, 0.99f), std::nullopt, std::nullopt);
  }
  AdamGroup copy() const {
    return {clones(params), grads, clones(steps), clones(m), clones(v), clones(masters), clones(emas)};
  }
};

TEST(ParallelKernels, FusedUpdateWithClippingAndEmaOnFourThreadsMatchesOneThread) {
  at::manual_seed(13);
  AdamGroup g;
  g.masters = randn_list(odd_sizes(), at::kFloat);
  for (const auto& w : g.masters) {
    g.params.push_back(w.to(at::kBFloat16));
    g.grads.push_back((at::randn_like(w) * 4.0).to(at::kBFloat16));
    g.steps.push_back(at::zeros({}, at::kFloat));
    g.m.push_back(at::zeros_like(w));
    g.v.push_back(at::zeros_like(w));
    g.emas.push_back(w.to(at::kBFloat16));
  }
  AdamGroup one = g.copy(), four = g.copy();
  with_threads(1, [&] {
    one.step();
    one.step();
  });
  with_threads(kThreads, [&] {
    four.step();
    four.step();
  });
  expect_same(one.params, four.params, "params");
  expect_same(one.masters, four.masters, "masters");
  expect_same(one.m, four.m, "exp_avg");
  expect_same(one.v, four.v, "exp_avg_sq");
  expect_same(one.emas, four.emas, "ema");
  EXPECT_FALSE(at::equal(four.masters[299], g.masters[299])) << "the step changed nothing";
}

template <typename R, typename... A>
R call_op(const char* name, A... args) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<R(A...)>();
  return op.call(args...);
}

using Stats = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Pair = std::tuple<at::Tensor, at::Tensor>;

// Every SyncBatchNorm op on one input, in its layout.
TensorVec syncbn_pass(const at::Tensor& x, const at::Tensor& dy) {
  const auto [count, mean, m2] = call_op<Stats, const at::Tensor&>("fusetrain::bn_stats", x);
  const at::Tensor invstd = (m2 / count + 1e-5).rsqrt();
  const at::Tensor w = at::linspace(0.5, 1.5, x.size(1)), b = at::linspace(-1.0, 1.0, x.size(1));
  const at::Tensor y =
      call_op<at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
              const std::optional<at::Tensor>&>("fusetrain::bn_elemt", x, mean, invstd, w, b);
  const auto [sum_dy, sum_dy_xmu] = call_op<Pair, const at::Tensor&, const at::Tensor&, const at::Tensor&>(
      "fusetrain::bn_backward_reduce", dy, x, mean);
  const at::Tensor dx =
      call_op<at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&>(
          "fusetrain::bn_backward_elemt", dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, count);
  return {count, mean, m2, y, sum_dy, sum_dy_xmu, dx};
}

TEST(ParallelKernels, SyncBatchNormOpsOnFourThreadsMatchOneThread) {
  at::manual_seed(14);
  // Odd channel counts and spatial sizes, contiguous (one row per channel) and
  // channels-last (channels innermost, tiles of 64), each past a work item.
  const std::vector<std::vector<int64_t>> shapes = {{8, 67, 13, 11}, {5, 131, 9, 7}, {2, 3, 181, 97}};
  for (const auto& shape : shapes) {
    for (bool channels_last : {false, true}) {
      for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
        at::Tensor x = at::randn(shape).to(dt), dy = at::randn(shape).to(dt);
        if (channels_last) {
          x = x.contiguous(at::MemoryFormat::ChannelsLast);
          dy = dy.contiguous(at::MemoryFormat::ChannelsLast);
        }
        TensorVec one, four;
        with_threads(1, [&] { one = syncbn_pass(x, dy); });
        with_threads(kThreads, [&] { four = syncbn_pass(x, dy); });
        expect_same(one, four, "syncbn " + std::to_string(shape[1]) + (channels_last ? " channels-last" : ""));
      }
    }
  }
}

}  // namespace
