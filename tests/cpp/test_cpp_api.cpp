// Tests of the C++ API (fusetrain/optim.h, fusetrain/amp.h): fused optimizers
// against torch::optim, state round trips, skipped steps, EMA schedules and
// option validation.
#include <gtest/gtest.h>

#include <fusetrain/fusetrain.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <sstream>

namespace {

std::vector<torch::Tensor> make_params(int64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({7}), torch::randn({33, 5}), torch::randn({1}), torch::randn({1031})};
}
std::vector<torch::Tensor> clone_params(const std::vector<torch::Tensor>& ps) {
  std::vector<torch::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone().set_requires_grad(true));
  return out;
}
void set_grads(std::vector<torch::Tensor>& a, std::vector<torch::Tensor>& b, int64_t step) {
  torch::manual_seed(1000 + step);
  for (size_t i = 0; i < a.size(); ++i) {
    auto g = torch::randn_like(a[i]);
    a[i].mutable_grad() = g.clone();
    b[i].mutable_grad() = g.clone();
  }
}
void expect_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, double rtol = 1e-5,
                  double atol = 1e-6) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::allclose(a[i], b[i], rtol, atol)) << "param " << i << " max diff "
                                                         << (a[i] - b[i]).abs().max().item<double>();
}

template <typename Ours, typename Ref>
void compare(Ours& ours, Ref& ref, std::vector<torch::Tensor>& a, std::vector<torch::Tensor>& b, int steps = 20) {
  for (int s = 0; s < steps; ++s) {
    set_grads(a, b, s);
    ours.step();
    ref.step();
  }
  expect_close(a, b);
}

}  // namespace

TEST(CppApiOptim, AdamWMatchesTorch) {
  for (bool amsgrad : {false, true}) {
    auto init = make_params(1);
    auto a = clone_params(init), b = clone_params(init);
    fusetrain::AdamW ours(a, fusetrain::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(amsgrad));
    torch::optim::AdamW ref(b, torch::optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(amsgrad));
    compare(ours, ref, a, b);
  }
}

// An optimizer whose record fields differ from its kind table entry.
struct AdamMissingAField : fusetrain::Adam {
  using fusetrain::Adam::Adam;
  bool drop = true;
  void kind_fields(const torch::optim::OptimizerOptions& o, fusetrain::KindValues& v) const override {
    fusetrain::Adam::kind_fields(o, v);
    if (drop) v.pop_back();
    else v.emplace_back("momentum", 0.9);
  }
  void recheck() { check_kind("Adam"); }
};

TEST(CppApiOptim, RecordFieldsAreCheckedAgainstTheKindTable) {
  AdamMissingAField opt(clone_params(make_params(0)));
  try {
    opt.recheck();
    FAIL() << "a missing field passed";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("no value for the record field 'bias_correction'"),
              std::string::npos) << e.what_without_backtrace();
  }
  opt.drop = false;
  try {
    opt.recheck();
    FAIL() << "an unknown field passed";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("record field 'momentum' that its entry in the kind table "
                                                           "lacks"),
              std::string::npos) << e.what_without_backtrace();
  }
}

TEST(CppApiOptim, AdamMatchesTorch) {
  auto init = make_params(2);
  auto a = clone_params(init), b = clone_params(init);
  fusetrain::Adam ours(a, fusetrain::AdamOptions(3e-3).betas({0.8, 0.95}).weight_decay(0.05));
  torch::optim::Adam ref(b, torch::optim::AdamOptions(3e-3).betas({0.8, 0.95}).weight_decay(0.05));
  compare(ours, ref, a, b);
}

// NOTE [device values]: betas and weight decay changed through the options between steps (a schedule)
// reach the kernels through the group's values tensor, as torch's reads them from its options.
TEST(CppApiOptim, ScheduledBetasAndWeightDecayMatchTorch) {
  auto init = make_params(2);
  auto a = clone_params(init), b = clone_params(init);
  fusetrain::AdamW ours(a, fusetrain::AdamWOptions(3e-3).weight_decay(0.05));
  torch::optim::AdamW ref(b, torch::optim::AdamWOptions(3e-3).weight_decay(0.05));
  for (int s = 0; s < 12; ++s) {
    const double beta1 = 0.95 - 0.01 * s, wd = 0.05 * (1 + s) / 12.0;
    static_cast<fusetrain::AdamWOptions&>(ours.param_groups()[0].options()).betas({beta1, 0.99}).weight_decay(wd);
    static_cast<torch::optim::AdamWOptions&>(ref.param_groups()[0].options()).betas({beta1, 0.99}).weight_decay(wd);
    set_grads(a, b, s);
    ours.step();
    ref.step();
  }
  expect_close(a, b);
  // refresh_device_values (what a captured TrainStep calls before a replay) checks new values first.
  static_cast<fusetrain::AdamWOptions&>(ours.param_groups()[0].options()).betas({1.5, 0.99});
  try {
    ours.refresh_device_values();
    ADD_FAILURE() << "no error for beta1 = 1.5";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("beta1 must be in [0, 1), got 1.5"), std::string::npos) << e.what();
  }
}

TEST(CppApiOptim, SGDMatchesTorch) {
  struct Case {
    double momentum, dampening, wd;
    bool nesterov;
  };
  for (auto c : {Case{0, 0, 0, false}, Case{0.9, 0, 1e-2, false}, Case{0.9, 0, 0, true}, Case{0.5, 0.1, 0, false}}) {
    auto init = make_params(3);
    auto a = clone_params(init), b = clone_params(init);
    fusetrain::SGD ours(a, fusetrain::SGDOptions(0.05).momentum(c.momentum).dampening(c.dampening)
                               .weight_decay(c.wd).nesterov(c.nesterov));
    torch::optim::SGD ref(b, torch::optim::SGDOptions(0.05).momentum(c.momentum).dampening(c.dampening)
                                 .weight_decay(c.wd).nesterov(c.nesterov));
    compare(ours, ref, a, b);
  }
}

TEST(CppApiOptim, RMSpropMatchesTorch) {
  struct Case {
    double momentum, wd;
    bool centered;
  };
  for (auto c : {Case{0, 0, false}, Case{0.9, 0.01, false}, Case{0, 0, true}, Case{0.5, 0.1, true}}) {
    auto init = make_params(5);
    auto a = clone_params(init), b = clone_params(init);
    fusetrain::RMSprop ours(a, fusetrain::RMSpropOptions(1.0 / 256).alpha(0.9).momentum(c.momentum)
                                   .weight_decay(c.wd).centered(c.centered));
    torch::optim::RMSprop ref(b, torch::optim::RMSpropOptions(1.0 / 256).alpha(0.9).momentum(c.momentum)
                                     .weight_decay(c.wd).centered(c.centered));
    compare(ours, ref, a, b);
    const auto& st = static_cast<const fusetrain::FusedParamState&>(*ours.state().at(a[0].unsafeGetTensorImpl()));
    EXPECT_TRUE(st.square_avg().defined());
    EXPECT_EQ(st.momentum_buffer().defined(), c.momentum > 0);
    EXPECT_EQ(st.grad_avg().defined(), c.centered);
  }
}

// timm's RMSpropTF (NOTE [rmsprop tf] in csrc/common/rms_math.h) in plain ops, one tensor at a time.
struct RMSpropTFReference {
  std::vector<torch::Tensor>& params;
  double lr, alpha, eps, wd, momentum;
  bool centered, lr_in_momentum, decoupled;
  std::vector<torch::Tensor> sq, buf, ga;
  void step() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      auto& p = params[i];
      if (sq.size() <= i) {
        sq.push_back(torch::ones_like(p));
        buf.push_back(torch::zeros_like(p));
        ga.push_back(torch::zeros_like(p));
      }
      auto g = p.grad();
      if (wd != 0) {
        if (decoupled) {
          p.mul_(1.0 - lr * wd);
        } else {
          g = g.add(p, wd);
        }
      }
      sq[i].add_(g.pow(2) - sq[i], 1.0 - alpha);
      torch::Tensor avg;
      if (centered) {
        ga[i].add_(g - ga[i], 1.0 - alpha);
        avg = sq[i].addcmul(ga[i], ga[i], -1).add(eps).sqrt_();
      } else {
        avg = sq[i].add(eps).sqrt_();
      }
      if (momentum > 0 && lr_in_momentum) {
        buf[i].mul_(momentum).addcdiv_(g, avg, lr);
        p.sub_(buf[i]);
      } else if (momentum > 0) {
        buf[i].mul_(momentum).addcdiv_(g, avg);
        p.add_(buf[i], -lr);
      } else {
        p.addcdiv_(g, avg, -lr);
      }
    }
  }
};

TEST(CppApiOptim, RMSpropTFStyleMatchesAReference) {
  struct Case {
    double momentum, wd;
    bool centered, lr_in_momentum, decoupled;
  };
  for (auto c : {Case{0, 0, false, true, false}, Case{0.9, 0.01, false, true, false},
                 Case{0.9, 0.05, true, false, true}, Case{0.5, 0.1, true, true, true}}) {
    auto init = make_params(6);
    auto a = clone_params(init), b = clone_params(init);
    const double lr = 1.0 / 256;
    fusetrain::RMSpropTF ours(a, fusetrain::RMSpropTFOptions(lr).alpha(0.9).eps(1e-3).momentum(c.momentum)
                                     .weight_decay(c.wd).centered(c.centered).lr_in_momentum(c.lr_in_momentum)
                                     .decoupled_decay(c.decoupled));
    RMSpropTFReference ref{b, lr, 0.9, 1e-3, c.wd, c.momentum, c.centered, c.lr_in_momentum, c.decoupled};
    compare(ours, ref, a, b);
    const auto& st = static_cast<const fusetrain::FusedParamState&>(*ours.state().at(a[0].unsafeGetTensorImpl()));
    EXPECT_TRUE(torch::allclose(st.square_avg(), ref.sq[0]));
  }
  // timm's defaults: alpha 0.9, eps 1e-10, lr_in_momentum.
  const fusetrain::RMSpropTFOptions d;
  EXPECT_EQ(d.alpha(), 0.9);
  EXPECT_EQ(d.eps(), 1e-10);
  EXPECT_TRUE(d.lr_in_momentum());
}

TEST(CppApiOptim, MuonGroupsAndChecks) {
  auto p = make_params(8);  // {7}, {33, 5}, {1}, {1031}
  // A vector in a use_muon group is refused with the way out in the message.
  EXPECT_THROW(fusetrain::Muon(p, fusetrain::MuonOptions(0.02)), c10::ValueError);
  EXPECT_THROW(fusetrain::Muon({p[1]}, fusetrain::MuonOptions(0.02).adjust_lr_fn("rms")), c10::ValueError);
  EXPECT_THROW(fusetrain::Muon({p[1]}, fusetrain::MuonOptions(0.02).momentum(1.0)), c10::Error);
  auto a = clone_params(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{a[1]}, std::make_unique<fusetrain::MuonOptions>(0.02));
  groups.emplace_back(std::vector<torch::Tensor>{a[0], a[2], a[3]},
                      std::make_unique<fusetrain::MuonOptions>(fusetrain::MuonOptions(0.02).use_muon(false)));
  fusetrain::Muon opt(groups, fusetrain::MuonOptions(0.02));
  auto before = a[1].detach().clone();
  for (auto& t : a) t.mutable_grad() = torch::randn_like(t);
  opt.step();
  const auto& mat = static_cast<const fusetrain::FusedParamState&>(*opt.state().at(a[1].unsafeGetTensorImpl()));
  const auto& vec = static_cast<const fusetrain::FusedParamState&>(*opt.state().at(a[0].unsafeGetTensorImpl()));
  EXPECT_TRUE(mat.momentum_buffer().defined() && !mat.exp_avg().defined());
  EXPECT_TRUE(vec.exp_avg().defined() && vec.exp_avg_sq().defined() && !vec.momentum_buffer().defined());
  // The first step from a zero buffer: the update is lr * sqrt(max(1, 33/5)) * NS(0.05 * g) after the decay.
  EXPECT_FALSE(torch::equal(before, a[1]));
  EXPECT_TRUE(torch::allclose(mat.momentum_buffer(), 0.05 * a[1].grad(), 1e-6, 1e-7));
}

TEST(CppApiOptim, Float64ParamsKeepFloat64StateAndMatchTorch) {
  // NOTE [float64 params]: updated in double precision, state in float64, no
  // master copy even with master_weights. lr = 2^-7 is exact in the float32
  // device copy, so the comparison is at float64 rounding.
  auto init = make_params(4);
  for (auto& p : init) p = p.to(torch::kDouble);
  auto a = clone_params(init), b = clone_params(init);
  fusetrain::AdamW ours(a, fusetrain::AdamWOptions(1.0 / 128).weight_decay(0.1).master_weights(true));
  torch::optim::AdamW ref(b, torch::optim::AdamWOptions(1.0 / 128).weight_decay(0.1));
  for (int s = 0; s < 12; ++s) {
    set_grads(a, b, s);
    ours.step();
    ref.step();
  }
  expect_close(a, b, 1e-12, 1e-13);
  for (const auto& p : a) {
    const auto& st = static_cast<const fusetrain::FusedParamState&>(*ours.state().at(p.unsafeGetTensorImpl()));
    EXPECT_EQ(st.exp_avg().scalar_type(), torch::kDouble);
    EXPECT_EQ(st.exp_avg_sq().scalar_type(), torch::kDouble);
    EXPECT_FALSE(st.master().defined());
  }
}

TEST(CppApiOptim, LionMatchesHandWrittenReference) {
  auto init = make_params(4);
  auto a = clone_params(init), b = clone_params(init);
  const double lr = 1e-3, b1 = 0.9, b2 = 0.99, wd = 0.1;
  fusetrain::Lion ours(a, fusetrain::LionOptions(lr).weight_decay(wd));
  std::vector<torch::Tensor> m;
  for (auto& p : b) m.push_back(torch::zeros_like(p));
  for (int s = 0; s < 20; ++s) {
    set_grads(a, b, s);
    ours.step();
    torch::NoGradGuard ng;
    for (size_t i = 0; i < b.size(); ++i) {
      auto g = b[i].grad();
      auto u = m[i] * b1 + g * (1 - b1);
      b[i].mul_(1 - lr * wd);
      b[i].sub_(u.sign() * lr);
      m[i].mul_(b2).add_(g * (1 - b2));
    }
  }
  expect_close(a, b);
}

TEST(CppApiOptim, ClippingMatchesClipGradNorm) {
  auto init = make_params(5);
  auto a = clone_params(init), b = clone_params(init);
  fusetrain::SGD ours(a, fusetrain::SGDOptions(0.1).max_grad_norm(0.5));
  torch::optim::SGD ref(b, torch::optim::SGDOptions(0.1));
  for (int s = 0; s < 5; ++s) {
    set_grads(a, b, s);
    double total = torch::nn::utils::clip_grad_norm_(b, 0.5);
    ours.step();
    ref.step();
    EXPECT_NEAR(ours.last_grad_norm().item<double>(), total, 1e-4 * total);
  }
  expect_close(a, b);
}

TEST(CppApiOptim, LrSchedulerAndSetLrApply) {
  auto init = make_params(6);
  auto a = clone_params(init), b = clone_params(init);
  fusetrain::AdamW ours(a, fusetrain::AdamWOptions(1e-2));
  torch::optim::AdamW ref(b, torch::optim::AdamWOptions(1e-2));
  torch::optim::StepLR s1(ours, 3, 0.5), s2(ref, 3, 0.5);
  for (int s = 0; s < 10; ++s) {
    set_grads(a, b, s);
    ours.step();
    ref.step();
    s1.step();
    s2.step();
  }
  EXPECT_DOUBLE_EQ(ours.param_groups()[0].options().get_lr(), ref.param_groups()[0].options().get_lr());
  expect_close(a, b);
}

TEST(CppApiOptim, StateSaveLoadRoundTrip) {
  auto init = make_params(7);
  auto a = clone_params(init), b = clone_params(init);
  auto opts = fusetrain::AdamWOptions(5e-3).amsgrad(true).weight_decay(0.02);
  fusetrain::AdamW first(a, opts);
  for (int s = 0; s < 5; ++s) {
    set_grads(a, b, s);
    first.step();
  }
  // b continues from a's params with a fresh optimizer loaded from the archive.
  for (size_t i = 0; i < a.size(); ++i) b[i].detach().copy_(a[i].detach());
  std::stringstream buf;
  torch::save(first, buf);
  fusetrain::AdamW second(b, fusetrain::AdamWOptions(1.0));  // options come from the archive
  torch::load(second, buf);
  const auto& lo = static_cast<const fusetrain::AdamWOptions&>(second.param_groups()[0].options());
  EXPECT_DOUBLE_EQ(lo.lr(), 5e-3);
  EXPECT_TRUE(lo.amsgrad());
  auto& st = static_cast<fusetrain::FusedParamState&>(*second.state().at(b[1].unsafeGetTensorImpl()));
  EXPECT_EQ(st.step().item<float>(), 5.0f);
  EXPECT_TRUE(st.max_exp_avg_sq().defined());
  for (int s = 5; s < 12; ++s) {
    set_grads(a, b, s);
    first.step();
    second.step();
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "param " << i;
}

// NOTE [lean state] (csrc/common/lean_state.h): the C++ options take the lean
// forms; a remainder is the fp32 master bit for bit, the state is bfloat16, the
// options round-trip through an archive, and kinds that cannot take them refuse.
TEST(CppApiOptim, LeanStateOptions) {
  auto init = make_params(5);
  for (auto& p : init) p = p.detach().to(torch::kBFloat16).set_requires_grad(true);
  auto a = clone_params(init), b = clone_params(init), c = clone_params(init);
  auto base = fusetrain::AdamWOptions(1e-2).weight_decay(0.1).master_weights(true).state_dtype(torch::kBFloat16);
  fusetrain::AdamW full(a, base);
  fusetrain::AdamW lean(b, fusetrain::AdamWOptions(base).master_form(fusetrain::MasterForm::Remainder));
  fusetrain::AdamW none(c, fusetrain::AdamWOptions(base).master_form(fusetrain::MasterForm::Stochastic));
  for (int s = 0; s < 6; ++s) {
    set_grads(a, b, s);
    for (size_t i = 0; i < c.size(); ++i) c[i].mutable_grad() = a[i].grad().clone();
    full.step();
    lean.step();
    none.step();
  }
  auto state = [](fusetrain::AdamW& o, const torch::Tensor& p) -> fusetrain::FusedParamState& {
    return static_cast<fusetrain::FusedParamState&>(*o.state().at(p.unsafeGetTensorImpl()));
  };
  for (size_t i = 0; i < a.size(); ++i) {
    const auto& rem = state(lean, b[i]).master();
    ASSERT_EQ(rem.scalar_type(), torch::kShort);
    const auto joined = b[i].detach().view(torch::kShort).to(torch::kInt).bitwise_and(0xFFFF).__lshift__(16).add(
        rem.to(torch::kInt));
    EXPECT_TRUE(torch::equal(joined, state(full, a[i]).master().view(torch::kInt))) << "param " << i;
    EXPECT_EQ(state(lean, b[i]).exp_avg_sq().scalar_type(), torch::kBFloat16);
    EXPECT_FALSE(state(none, c[i]).master().defined());
  }
  std::stringstream buf;
  torch::save(lean, buf);
  auto d = clone_params(b);
  fusetrain::AdamW loaded(d, fusetrain::AdamWOptions(1.0));
  torch::load(loaded, buf);
  const auto& lo = static_cast<const fusetrain::AdamWOptions&>(loaded.param_groups()[0].options());
  EXPECT_EQ(lo.master_form(), fusetrain::MasterForm::Remainder);
  EXPECT_EQ(lo.state_dtype(), torch::kBFloat16);
  for (int s = 6; s < 9; ++s) {
    set_grads(b, d, s);
    lean.step();
    loaded.step();
  }
  for (size_t i = 0; i < b.size(); ++i) EXPECT_TRUE(torch::equal(b[i], d[i])) << "param " << i;
  auto e = clone_params(init);
  EXPECT_THROW(fusetrain::Lamb(e, fusetrain::LambOptions(1e-3).state_dtype(torch::kBFloat16)), c10::ValueError);
  EXPECT_THROW(fusetrain::AdamW(e, fusetrain::AdamWOptions(1e-3).state_dtype(torch::kHalf)), c10::ValueError);
}

TEST(CppApiOptim, NewStateFieldsSaveAndLoad) {
  // RMSprop (square_avg, momentum_buffer, grad_avg) and Adadelta (square_avg, acc_delta).
  auto init = make_params(8);
  for (int which = 0; which < 2; ++which) {
    auto a = clone_params(init), b = clone_params(init);
    std::unique_ptr<fusetrain::FusedOptimizer> first, second;
    if (which == 0) {
      first = std::make_unique<fusetrain::RMSprop>(a, fusetrain::RMSpropOptions(1e-3).momentum(0.9).centered(true));
      second = std::make_unique<fusetrain::RMSprop>(b, fusetrain::RMSpropOptions(1.0));
    } else {
      first = std::make_unique<fusetrain::Adadelta>(a, fusetrain::AdadeltaOptions(0.5).rho(0.8));
      second = std::make_unique<fusetrain::Adadelta>(b, fusetrain::AdadeltaOptions(1.0));
    }
    for (int s = 0; s < 4; ++s) {
      set_grads(a, b, s);
      first->step();
    }
    for (size_t i = 0; i < a.size(); ++i) b[i].detach().copy_(a[i].detach());
    std::stringstream buf;
    torch::serialize::OutputArchive out;
    first->save(out);
    out.save_to(buf);
    torch::serialize::InputArchive in;
    in.load_from(buf);
    second->load(in);
    for (int s = 4; s < 9; ++s) {
      set_grads(a, b, s);
      first->step();
      second->step();
    }
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << which << " param " << i;
  }
}

TEST(CppApiOptim, InfGradientSkipsStep) {
  auto init = make_params(8);
  auto a = clone_params(init), b = clone_params(init);
  fusetrain::AdamW opt(a, fusetrain::AdamWOptions(1e-2).max_grad_norm(1.0));
  set_grads(a, b, 0);
  opt.step();
  std::vector<torch::Tensor> before;
  for (auto& p : a) before.push_back(p.detach().clone());
  auto& st = static_cast<fusetrain::FusedParamState&>(*opt.state().at(a[0].unsafeGetTensorImpl()));
  auto m_before = st.exp_avg().clone();
  set_grads(a, b, 1);
  a[3].mutable_grad()[17] = std::numeric_limits<float>::infinity();
  opt.step();
  EXPECT_EQ(opt.last_found_inf().item<float>(), 1.0f);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], before[i]));
  EXPECT_TRUE(torch::equal(st.exp_avg(), m_before));
  EXPECT_EQ(st.step().item<float>(), 1.0f);
}

TEST(CppApiOptim, BadOptionsRaise) {
  auto ps = clone_params(make_params(9));
  auto expect_msg = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no error, expected: " << needle;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // The table's checks, named by the class (NOTE [optimizer table]).
  expect_msg([&] { fusetrain::AdamW(ps, fusetrain::AdamWOptions(-1.0)); }, "fusetrain::AdamW: lr must be >= 0, got -1");
  expect_msg([&] { fusetrain::Adam(ps, fusetrain::AdamOptions().betas({1.0, 0.9})); },
             "fusetrain::Adam: beta1 must be in [0, 1), got 1");
  expect_msg([&] { fusetrain::Lion(ps, fusetrain::LionOptions().betas({0.9, -0.1})); },
             "fusetrain::Lion: beta2 must be in [0, 1), got -0.1");
  expect_msg([&] { fusetrain::SGD(ps, fusetrain::SGDOptions(-0.1)); }, "fusetrain::SGD: lr must be >= 0, got -0.1");
  expect_msg([&] { fusetrain::SGD(ps, fusetrain::SGDOptions(0.1).nesterov(true)); },
             "fusetrain::SGD: nesterov needs momentum > 0, got momentum=0");
  expect_msg([&] { fusetrain::RMSprop(ps, fusetrain::RMSpropOptions(0.1).eps(std::nan(""))); },
             "fusetrain::RMSprop: eps must be >= 0, got nan");
  expect_msg([&] { fusetrain::Muon({ps[1]}, fusetrain::MuonOptions(0.02).adjust_lr_fn("rms")); },
             "fusetrain::Muon: adjust_lr_fn must be one of 'original', 'match_rms_adamw', got 'rms'");
  expect_msg([&] { fusetrain::Muon({ps[1]}, fusetrain::MuonOptions().maximize(true)); },
             "fusetrain::Muon: maximize is not supported");
  expect_msg([&] { fusetrain::LossScaler(fusetrain::LossScalerOptions().backoff_factor(2.0)); }, "backoff_factor");
  // mismatched dtype between a param and its grad's shape is rejected by the op
  auto p = torch::randn({4}).set_requires_grad(true);
  p.mutable_grad() = torch::randn({5});
  fusetrain::SGD bad({p}, fusetrain::SGDOptions(0.1));
  EXPECT_THROW(bad.step(), c10::Error);
}

TEST(CppApiAmp, LossScalerMatchesUnscaledStepAndBacksOff) {
  auto init = make_params(10);
  auto a = clone_params(init), b = clone_params(init);
  fusetrain::AdamW ours(a, fusetrain::AdamWOptions(1e-2));
  torch::optim::AdamW ref(b, torch::optim::AdamWOptions(1e-2));
  fusetrain::LossScaler scaler(fusetrain::LossScalerOptions().init_scale(1024.0).growth_interval(2));
  for (int s = 0; s < 6; ++s) {
    set_grads(a, b, s);
    auto loss = scaler.scale(torch::ones({}));
    const float sc = loss.item<float>();
    for (auto& p : a) p.mutable_grad().mul_(sc);  // as if backward ran on the scaled loss
    fusetrain::fused_step(ours, &scaler, nullptr);
    ref.step();
  }
  expect_close(a, b);
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 1024.0 * 8);  // grew every 2 steps
  // an inf step: skipped, scale halves
  std::vector<torch::Tensor> before;
  for (auto& p : a) before.push_back(p.detach().clone());
  set_grads(a, b, 99);
  a[0].mutable_grad()[0] = std::nan("");
  scaler.scale(torch::ones({}));
  scaler.step(ours);
  EXPECT_EQ(ours.last_found_inf().item<float>(), 1.0f);
  scaler.update();
  EXPECT_EQ(scaler.last_step_skipped().item<float>(), 1.0f);
  EXPECT_EQ(scaler.skipped_steps().item<float>(), 1.0f);
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 1024.0 * 4);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], before[i]));
  // save / load
  std::stringstream buf;
  {
    torch::serialize::OutputArchive ar;
    scaler.save(ar);
    ar.save_to(buf);
  }
  fusetrain::LossScaler other;
  torch::serialize::InputArchive in;
  in.load_from(buf);
  other.load(in);
  EXPECT_DOUBLE_EQ(other.get_scale(), 1024.0 * 4);
  EXPECT_EQ(other.growth_tracker().item<int>(), 0);
}

namespace {
double ref_decay(const fusetrain::ModelEMAOptions& o, double t) {
  double d = o.decay();
  if (o.decay_type() == "threshold") d = std::min(d, (1 + t) / (10 + t));
  if (o.decay_type() == "exp") d = d * (1 - std::exp(-o.beta() * t / o.total_steps()));
  if (o.warmup()) d = std::min(d, 1 - std::pow(1 + t / o.warmup_gamma(), -o.warmup_power()));
  return d;
}
}  // namespace

TEST(CppApiEma, SchedulesStandaloneAndAttached) {
  std::vector<fusetrain::ModelEMAOptions> cases = {
      fusetrain::ModelEMAOptions().decay(0.9).decay_type("constant"),
      fusetrain::ModelEMAOptions().decay(0.99).decay_type("threshold"),
      fusetrain::ModelEMAOptions().decay(0.999).decay_type("exp").total_steps(10).beta(5),
      fusetrain::ModelEMAOptions().decay(0.99).decay_type("threshold").warmup(true).warmup_gamma(2.0)};
  for (const auto& o : cases) {
    for (bool attached : {false, true}) {
      torch::manual_seed(11);
      torch::nn::Linear model(5, 3);
      fusetrain::ModelEMA ema(model, o);
      fusetrain::SGD opt(model->parameters(), fusetrain::SGDOptions(0.1));
      if (attached) ema.attach(opt);
      std::vector<torch::Tensor> ref;
      for (auto& p : model->parameters()) ref.push_back(p.detach().clone().to(torch::kDouble));
      for (int t = 1; t <= 6; ++t) {
        opt.zero_grad();
        model(torch::randn({4, 5})).pow(2).sum().backward();
        std::optional<torch::Tensor> inf;
        const bool skip = t == 3;
        if (skip) inf = torch::ones({});
        if (attached) {
          if (skip) {
            opt.step_with(std::nullopt, inf);
          } else {
            opt.step();
          }
        } else {
          opt.step_with(std::nullopt, inf);
          ema.update(inf);
        }
        if (!skip) {
          const double tt = t > 3 ? t - 1 : t;  // counts non-skipped updates
          const double d = ref_decay(o, tt);
          EXPECT_NEAR(ema.decay_tensor().item<double>(), d, 1e-6) << o.decay_type() << " t=" << tt;
          auto ps = model->parameters();
          for (size_t i = 0; i < ps.size(); ++i) ref[i] += (1 - d) * (ps[i].detach().to(torch::kDouble) - ref[i]);
        }
      }
      EXPECT_EQ(ema.step_tensor().item<float>(), 5.0f);
      auto eps = ema.module()->parameters();
      for (size_t i = 0; i < eps.size(); ++i)
        EXPECT_TRUE(torch::allclose(eps[i].to(torch::kDouble), ref[i], 1e-5, 1e-6)) << o.decay_type() << " " << i;
    }
  }
  torch::nn::Linear m(2, 2);
  EXPECT_THROW(fusetrain::ModelEMA(m, fusetrain::ModelEMAOptions().decay_type("linear")), c10::Error);
}

// An optimizer destroyed before the EMA attached to it detaches the EMA, which
// then never reaches the dead optimizer: attaching it to another one (which
// detaches it first) and its destructor read freed memory before (ASan:
// heap-use-after-free in ModelEMA::detach; scripts/sanitize asan).
TEST(CppApiEma, OptimizerDestroyedFirstDetachesTheEma) {
  torch::manual_seed(3);
  torch::nn::Linear model(4, 3);
  fusetrain::ModelEMA ema(model, fusetrain::ModelEMAOptions().decay(0.5).decay_type("constant"));
  auto first = std::make_unique<fusetrain::SGD>(model->parameters(), fusetrain::SGDOptions(0.1));
  ema.attach(*first);
  EXPECT_TRUE(ema.attached_to(*first));
  first.reset();
  fusetrain::SGD second(model->parameters(), fusetrain::SGDOptions(0.1));
  ema.attach(second);
  EXPECT_TRUE(ema.attached_to(second));
  EXPECT_EQ(second.attached_ema(), &ema);
  for (auto& p : model->parameters()) p.mutable_grad() = torch::ones_like(p);
  const torch::Tensor before = ema.module()->parameters()[0].detach().clone();
  second.step();
  const torch::Tensor after_step = model->parameters()[0].detach();
  EXPECT_TRUE(torch::allclose(ema.module()->parameters()[0], before + 0.5 * (after_step - before)));
}

TEST(CppApiEma, FusedStepWithScalerAndAttachedEma) {
  torch::manual_seed(12);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 1));
  fusetrain::AdamW opt(model->parameters(), fusetrain::AdamWOptions(1e-2));
  fusetrain::LossScaler scaler;
  fusetrain::ModelEMA ema(model.ptr(), fusetrain::ModelEMAOptions().decay(0.9).decay_type("constant"));
  ema.attach(opt);
  auto x = torch::randn({64, 8});
  auto y = x.sum(1, true);
  double first = 0, last = 0;
  for (int s = 0; s < 50; ++s) {
    opt.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);
    if (s == 0) first = loss.item<double>();
    last = loss.item<double>();
    scaler.scale(loss).backward();
    fusetrain::fused_step(opt, scaler, ema);
  }
  EXPECT_LT(last, 0.5 * first);
  EXPECT_EQ(ema.step_tensor().item<float>(), 50.0f);
  auto a = ema.module()->parameters();
  auto b = model->parameters();
  EXPECT_FALSE(torch::equal(a[0], b[0]));
}

// NOTE [ema remainder]: a bfloat16 model's EMA keeps int16 remainders; joined
// with them it is the float32 model's EMA bit for bit (the EMA follows the
// masters, which are the float32 run's), and an archive keeps them.
TEST(CppApiEma, Bfloat16RemaindersAreTheFloat32Ema) {
  torch::manual_seed(13);
  torch::nn::Linear m16(torch::nn::LinearOptions(8, 5));
  m16->to(torch::kBFloat16);
  torch::nn::Linear m32(torch::nn::LinearOptions(8, 5));
  {
    torch::NoGradGuard no_grad;
    m32->weight.copy_(m16->weight.to(torch::kFloat));
    m32->bias.copy_(m16->bias.to(torch::kFloat));
  }
  fusetrain::AdamW o16(m16->parameters(), fusetrain::AdamWOptions(1e-2).master_weights(true).master_form(
                                              fusetrain::MasterForm::Remainder));
  fusetrain::AdamW o32(m32->parameters(), fusetrain::AdamWOptions(1e-2));
  const auto options = fusetrain::ModelEMAOptions().decay(0.999).decay_type("constant");
  fusetrain::ModelEMA e16(m16, options), e32(m32, options);
  e16.attach(o16);
  e32.attach(o32);
  auto joined = [&](fusetrain::ModelEMA& e) {
    std::vector<torch::Tensor> out;
    for (const auto& t : e.module()->parameters()) {
      const auto r = e.remainder_for(t);
      EXPECT_TRUE(r.defined());
      out.push_back(t.view(torch::kShort).to(torch::kInt).bitwise_and(0xFFFF).__lshift__(16).add(r.to(torch::kInt)));
    }
    return out;
  };
  for (int s = 0; s < 4; ++s) {
    const auto x = torch::randn({16, 8}).to(torch::kBFloat16);
    o16.zero_grad();
    m16->forward(x).to(torch::kFloat).square().mean().backward();
    for (size_t i = 0; i < 2; ++i) m32->parameters()[i].mutable_grad() = m16->parameters()[i].grad().to(torch::kFloat);
    fusetrain::fused_step(o16, nullptr, &e16);
    fusetrain::fused_step(o32, nullptr, &e32);
  }
  auto a = joined(e16);
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::equal(a[i], e32.module()->parameters()[i].view(torch::kInt))) << "param " << i;
  EXPECT_FALSE(e32.remainder_for(e32.module()->parameters()[0]).defined());
  torch::serialize::OutputArchive out;
  e16.save(out);
  std::stringstream buf;
  out.save_to(buf);
  torch::nn::Linear m(torch::nn::LinearOptions(8, 5));
  m->to(torch::kBFloat16);
  fusetrain::ModelEMA loaded(m, options);
  torch::serialize::InputArchive in;
  in.load_from(buf);
  loaded.load(in);
  auto b = joined(loaded);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "param " << i;
}

// NOTE [8-bit state]: state_dtype(at::kChar) keeps int8 codes with block
// scales for params of at least 4096 elements (float32 state below), follows
// the float32-state run within the codes' precision, and an archive resumes it
// bit for bit.
TEST(CppApiOptim, Int8StateOptions) {
  torch::manual_seed(21);
  std::vector<torch::Tensor> init = {torch::randn({50, 100}), torch::randn({7})};
  auto a = clone_params(init), b = clone_params(init);
  const auto base = fusetrain::AdamWOptions(1e-2).weight_decay(0.05);
  fusetrain::AdamW q8(a, fusetrain::AdamWOptions(base).state_dtype(torch::kChar).state_block_size(128));
  fusetrain::AdamW f32(b, base);
  for (int s = 0; s < 5; ++s) {
    set_grads(a, b, s);
    q8.step();
    f32.step();
  }
  expect_close(a, b, 0.0, 1e-2);
  auto& big = static_cast<fusetrain::FusedParamState&>(*q8.state().at(a[0].unsafeGetTensorImpl()));
  auto& small = static_cast<fusetrain::FusedParamState&>(*q8.state().at(a[1].unsafeGetTensorImpl()));
  EXPECT_EQ(big.exp_avg().scalar_type(), torch::kChar);
  EXPECT_EQ(big.exp_avg_sq().scalar_type(), torch::kChar);
  EXPECT_EQ(big.scales("exp_avg").numel(), 40);  // ceil(5000 / 128)
  EXPECT_EQ(small.exp_avg().scalar_type(), torch::kFloat);
  EXPECT_FALSE(small.scales("exp_avg").defined());
  std::stringstream buf;
  torch::save(q8, buf);
  auto c = clone_params(a);
  fusetrain::AdamW loaded(c, fusetrain::AdamWOptions(1.0));
  torch::load(loaded, buf);
  const auto& lo = static_cast<const fusetrain::AdamWOptions&>(loaded.param_groups()[0].options());
  EXPECT_EQ(lo.state_dtype(), torch::kChar);
  EXPECT_EQ(lo.state_block_size(), 128);
  for (int s = 5; s < 8; ++s) {
    set_grads(a, c, s);
    q8.step();
    loaded.step();
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], c[i])) << "param " << i;
  auto d = clone_params(init);
  EXPECT_THROW(fusetrain::AdamW(d, fusetrain::AdamWOptions(1e-3).state_dtype(torch::kChar).state_block_size(100)),
               c10::ValueError);
  EXPECT_THROW(fusetrain::Lamb(d, fusetrain::LambOptions(1e-3).state_dtype(torch::kChar)), c10::ValueError);
}

// NOTE [stalled updates]: bfloat16 params without a master and an lr far below
// half an ulp: every element with a non-zero update is counted.
TEST(CppApiOptim, StalledUpdatesAreCounted) {
  std::vector<torch::Tensor> p = {torch::ones({300}, torch::kBFloat16).set_requires_grad(true)};
  fusetrain::SGD opt(p, fusetrain::SGDOptions(1e-6));
  auto counter = opt.track_stalled_updates();
  ASSERT_EQ(counter.scalar_type(), torch::kLong);
  auto g = torch::ones({300}, torch::kBFloat16);
  g.slice(0, 0, 10).zero_();
  p[0].mutable_grad() = g;
  opt.step();
  opt.step();
  EXPECT_EQ(counter.item<int64_t>(), 2 * 290);
  EXPECT_TRUE(torch::equal(p[0], torch::ones({300}, torch::kBFloat16)));
  EXPECT_FALSE(opt.track_stalled_updates(false).defined());
  std::vector<torch::Tensor> q = {torch::ones({3}).set_requires_grad(true)};
  fusetrain::Lamb lamb(q, fusetrain::LambOptions(1e-3));
  EXPECT_THROW(lamb.track_stalled_updates(), c10::ValueError);
}
