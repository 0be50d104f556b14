// The "adam", "sgd" and "lion" kinds of fusetrain::fused_step_ (one group per
// call) against a scalar double-precision reference written here (plain loops
// over the elements), on CPU and, when a device is present, on CUDA. Every suite is instantiated for both devices;
// the CUDA instances skip themselves without a device.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <fusetrain/fusetrain.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "../../csrc/ops/kind_registry.h"

namespace {

using TensorVec = std::vector<at::Tensor>;

// The optional tail of a step: fusetrain::fused_step_'s loss scale, flag, EMA
// decay and a given clipping norm (with the record's max_grad_norm).
struct Tail {
  std::optional<at::Tensor> inv_scale, found_inf, grad_norm, ema_decay;
  double max_grad_norm = 0.0;
};

// One group of optimizer `kind` through fusetrain::fused_step_, its record
// built by field name from the kind table; `masters` one per float16/bfloat16
// param.
void kind_step(const std::string& kind, const TensorVec& params, const TensorVec& grads, const TensorVec& steps,
               const TensorVec& s1, const TensorVec& s2, const TensorVec& s3, const TensorVec& masters,
               const TensorVec& emas, const at::Tensor& lr, const std::map<std::string, double>& fields,
               bool maximize = false, const Tail& tail = {}) {
  std::vector<double> hyper = {tail.max_grad_norm, masters.empty() ? 0.0 : 1.0, emas.empty() ? 0.0 : 1.0,
                               maximize ? 1.0 : 0.0};
  for (const auto& f : fusetrain::detail::find_kind(kind).fields) hyper.push_back(fields.at(f.name));
  fusetrain::fused_step_(kind, params, grads, steps, s1, s2, s3, masters, emas, {static_cast<int64_t>(params.size())},
                         {lr}, hyper, tail.inv_scale, tail.found_inf, tail.ema_decay, std::nullopt, std::nullopt,
                         tail.max_grad_norm > 0.0 ? tail.grad_norm : std::nullopt);
}

// ---- helpers -----------------------------------------------------------------

std::vector<double> to_vec(const at::Tensor& t) {
  at::Tensor d = t.detach().to(at::kCPU).to(at::kDouble).contiguous();
  const double* p = d.data_ptr<double>();
  return std::vector<double>(p, p + d.numel());
}

// The value `x` takes once computed in fp32 and stored as `t`.
double round_to(double x, at::ScalarType t) {
  const float f = static_cast<float>(x);
  switch (t) {
    case at::kHalf:
      return static_cast<float>(c10::Half(f));
    case at::kBFloat16:
      return static_cast<float>(c10::BFloat16(f));
    default:
      return f;
  }
}

double machine_eps(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return std::ldexp(1.0, -10);
    case at::kBFloat16:
      return std::ldexp(1.0, -7);
    default:
      return std::ldexp(1.0, -23);
  }
}

// Compares a tensor with its reference values. fp32 storage: |a - r| <= 1e-5 |r|
// + 1e-6 rms(r) (the absolute part covers elements that cancelled to near zero).
// fp16/bf16 storage: |a - r| <= 2 eps |r| + 1e-6 rms(r), eps the dtype's machine
// epsilon: the fp32 kernel and the double reference may round a value that lies
// near a half-way point to neighbouring representable values.
::testing::AssertionResult close_to(const at::Tensor& actual, const std::vector<double>& ref,
                                    at::ScalarType storage) {
  const std::vector<double> a = to_vec(actual);
  if (a.size() != ref.size()) {
    return ::testing::AssertionFailure() << "size " << a.size() << " vs reference " << ref.size();
  }
  double sumsq = 0.0;
  for (double r : ref) sumsq += r * r;
  const double rms = ref.empty() ? 0.0 : std::sqrt(sumsq / static_cast<double>(ref.size()));
  const bool fp32 = storage == at::kFloat;
  const double u = machine_eps(storage);
  int64_t bad = 0;
  int64_t worst = -1;
  double worst_ratio = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double tol = (fp32 ? 1e-5 : 2.0 * u) * std::abs(ref[i]) + 1e-6 * rms;
    const double err = std::abs(a[i] - ref[i]);
    const double ratio = err / tol;
    if (!(err <= tol)) {
      ++bad;
      if (worst < 0 || !(ratio <= worst_ratio)) {
        worst = static_cast<int64_t>(i);
        worst_ratio = ratio;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << a.size() << " elements off; worst at " << worst
                                       << ": got " << a[worst] << ", reference " << ref[worst] << " (error "
                                       << std::abs(a[worst] - ref[worst]) << ", " << worst_ratio
                                       << "x the tolerance)";
}

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  at::Tensor ac = a.detach().to(at::kCPU).contiguous();
  at::Tensor bc = b.detach().to(at::kCPU).contiguous();
  return std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.nbytes()) == 0;
}

TensorVec clone_all(const TensorVec& v) {
  TensorVec out;
  for (const auto& t : v) out.push_back(t.clone());
  return out;
}

// Runs f, which must throw c10::Error whose message contains every needle.
template <class F>
void expect_error(F&& f, std::initializer_list<const char*> needles) {
  std::string msg;
  EXPECT_THROW(
      {
        try {
          f();
        } catch (const c10::Error& e) {
          msg = e.what_without_backtrace();
          throw;
        }
      },
      c10::Error);
  for (const char* n : needles) {
    EXPECT_NE(msg.find(n), std::string::npos) << "message lacks \"" << n << "\": " << msg;
  }
}

// ---- the reference -------------------------------------------------------------

enum class Kind { Adam, SGD, Lion };

struct Cfg {
  Kind kind = Kind::Adam;
  float lr = 1e-2f;  // step k (0-based) uses lr * (1 + 0.25 k), written into the lr tensor in place
  double beta1 = 0.9, beta2 = 0.999, weight_decay = 0.0, eps = 1e-8;
  bool amsgrad = false, maximize = false, decoupled = false;
  double momentum = 0.0, dampening = 0.0;
  bool nesterov = false;
  bool master = false, ema = false;
  float ema_decay = 0.9f;
  float grad_scale = 1.f;  // != 1: grads are generated scaled and passed inv_scale = 1 / grad_scale
  double clip_ratio = 0.0;  // > 0: max_grad_norm = clip_ratio * the step's true grad norm
  bool norm_without_max = false;  // pass grad_norm with max_grad_norm = 0 (no clipping)
  float step0 = 0.f;
  int steps = 3;
};

struct Spec {
  std::vector<int64_t> shape;
  at::ScalarType pt = at::kFloat;
  at::ScalarType gt = at::kFloat;
  bool transposed_grad = false;  // 2-D only: the grad is a transposed (non-contiguous) view
  bool channels_last = false;    // 4-D only: param, state, master and EMA are channels-last
};

struct RefTensor {
  at::ScalarType pt;
  std::vector<double> w;  // the full-precision value: the master when there is one, else the stored param
  std::vector<double> s1, s2, s3, ema;
  double step;
};

class Harness {
 public:
  static at::Tensor layout(const at::Tensor& t, const Spec& s) {
    return s.channels_last ? t.contiguous(at::MemoryFormat::ChannelsLast) : t;
  }

  Cfg c;
  at::Device dev;
  std::vector<Spec> specs;
  TensorVec params, s1, s2, s3, master, ema, steps;  // on dev
  std::vector<RefTensor> ref;
  at::Tensor lr, inv_scale, ema_decay;
  int done = 0;
  std::vector<double> clip_coefs;  // the reference's clip coefficient of each step

  Harness(const Cfg& cfg, std::vector<Spec> sp, at::Device d) : c(cfg), dev(d), specs(std::move(sp)) {
    const bool has_s1 = c.kind != Kind::SGD || c.momentum != 0.0;
    for (const Spec& s : specs) {
      RefTensor r;
      r.pt = s.pt;
      at::Tensor p32 = layout(at::randn(s.shape), s);
      at::Tensor p = p32.to(s.pt);
      r.w = c.master ? to_vec(p32) : to_vec(p);
      params.push_back(p.to(dev));
      // A float32 param of a master_weights group is its own master (updated in place).
      if (c.master) master.push_back(s.pt == at::kFloat ? params.back() : p32.to(dev));
      if (has_s1) {
        at::Tensor t = layout(at::randn(s.shape) * 0.1, s);
        r.s1 = to_vec(t);
        s1.push_back(t.to(dev));
      }
      if (c.kind == Kind::Adam) {
        at::Tensor v = layout(at::rand(s.shape) * 1e-3, s);
        r.s2 = to_vec(v);
        s2.push_back(v.to(dev));
        at::Tensor vm = layout(v + at::rand(s.shape) * 1e-3, s);
        r.s3 = to_vec(vm);
        s3.push_back(vm.to(dev));
      }
      if (c.ema) {
        at::Tensor e = layout((p32 + 0.05 * at::randn(s.shape)).to(s.pt), s);
        r.ema = to_vec(e);
        ema.push_back(e.to(dev));
      }
      r.step = c.step0;
      steps.push_back(at::full({}, c.step0, at::TensorOptions().dtype(at::kFloat).device(dev)));
      ref.push_back(std::move(r));
    }
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
    lr = at::full({}, c.lr, f32);
    if (c.grad_scale != 1.f) inv_scale = at::full({}, 1.0f / c.grad_scale, f32);
    if (c.ema) ema_decay = at::full({}, c.ema_decay, f32);
  }

  TensorVec make_grads() const {
    TensorVec gs;
    for (const Spec& s : specs) {
      at::Tensor g = s.transposed_grad ? at::randn({s.shape[1], s.shape[0]}).t() : at::randn(s.shape);
      gs.push_back((g * c.grad_scale).to(s.gt).to(dev));
    }
    return gs;
  }

  void call(const TensorVec& grads, const Tail& tail) {
    const TensorVec none;
    TensorVec low_masters;
    for (size_t i = 0; i < master.size(); ++i)
      if (params[i].scalar_type() != at::kFloat) low_masters.push_back(master[i]);
    switch (c.kind) {
      case Kind::Adam:
        kind_step("adam", params, grads, steps, s1, s2, c.amsgrad ? s3 : none, low_masters, ema, lr,
                  {{"beta1", c.beta1}, {"beta2", c.beta2}, {"weight_decay", c.weight_decay}, {"eps", c.eps},
                   {"amsgrad", c.amsgrad}, {"decoupled_weight_decay", c.decoupled}, {"bias_correction", 1.0}},
                  c.maximize, tail);
        break;
      case Kind::SGD:
        kind_step("sgd", params, grads, steps, c.momentum != 0.0 ? s1 : none, none, none, low_masters, ema, lr,
                  {{"momentum", c.momentum}, {"dampening", c.dampening}, {"weight_decay", c.weight_decay},
                   {"nesterov", c.nesterov}},
                  c.maximize, tail);
        break;
      case Kind::Lion:
        kind_step("lion", params, grads, steps, s1, none, none, low_masters, ema, lr,
                  {{"beta1", c.beta1}, {"beta2", c.beta2}, {"weight_decay", c.weight_decay}}, c.maximize, tail);
        break;
    }
  }

  Tail tail_for(const TensorVec& grads, double* gmul_ref) {
    Tail tail;
    const double inv = c.grad_scale != 1.f ? 1.0 / static_cast<double>(c.grad_scale) : 1.0;
    if (inv_scale.defined()) tail.inv_scale = inv_scale;
    if (c.ema) tail.ema_decay = ema_decay;
    double coef = 1.0;
    if (c.clip_ratio > 0.0 || c.norm_without_max) {
      double sumsq = 0.0;
      for (const auto& g : grads) {
        for (double x : to_vec(g)) sumsq += (x * inv) * (x * inv);
      }
      const double norm = std::sqrt(sumsq);
      auto [dev_norm, found_inf] = fusetrain::grad_stats(grads, tail.inv_scale);
      EXPECT_NEAR(dev_norm.item<float>(), norm, 1e-5 * norm);
      EXPECT_EQ(found_inf.item<float>(), 0.f);
      tail.grad_norm = dev_norm;
      if (c.clip_ratio > 0.0) {
        tail.max_grad_norm = c.clip_ratio * norm;
        coef = std::min(1.0, tail.max_grad_norm / (norm + 1e-6));
      }
    }
    clip_coefs.push_back(coef);
    *gmul_ref = inv * coef;
    return tail;
  }

  void step() {
    const float lr_k = c.lr * (1.f + 0.25f * static_cast<float>(done));
    lr.fill_(lr_k);
    const TensorVec grads = make_grads();
    double gmul = 1.0;
    const Tail tail = tail_for(grads, &gmul);
    call(grads, tail);
    for (size_t t = 0; t < ref.size(); ++t) ref_update(ref[t], to_vec(grads[t]), gmul, lr_k);
    ++done;
  }

  // Checks every step against the reference, then takes the stored fp16/bf16
  // values (param without master, EMA) as the reference's next input: where the
  // two rounded a value near a half-way point differently, that one-ulp
  // difference would otherwise be carried on (and, through L2 weight decay,
  // leak into the fp32 state), so each step is checked on its own rounding.
  void run() {
    for (int k = 0; k < c.steps; ++k) {
      step();
      check();
      resync_low_precision();
    }
  }

  void resync_low_precision() {
    for (size_t t = 0; t < ref.size(); ++t) {
      RefTensor& r = ref[t];
      if (r.pt == at::kFloat) continue;
      if (!c.master) r.w = to_vec(params[t]);
      if (c.ema) r.ema = to_vec(ema[t]);
    }
  }

  void ref_update(RefTensor& r, const std::vector<double>& g_in, double gmul, double lr_d) const {
    r.step += 1.0;
    const double wd = c.weight_decay;
    const double bc1 = 1.0 - std::pow(c.beta1, r.step);
    const double bc2 = 1.0 - std::pow(c.beta2, r.step);
    for (size_t j = 0; j < r.w.size(); ++j) {
      double g = g_in[j] * gmul;
      if (c.maximize) g = -g;
      double p = r.w[j];
      switch (c.kind) {
        case Kind::Adam: {
          if (wd != 0.0) {
            if (c.decoupled) {
              p *= 1.0 - lr_d * wd;
            } else {
              g += wd * p;
            }
          }
          double& m = r.s1[j];
          double& v = r.s2[j];
          m = c.beta1 * m + (1.0 - c.beta1) * g;
          v = c.beta2 * v + (1.0 - c.beta2) * g * g;
          double vv = v;
          if (c.amsgrad) {
            r.s3[j] = std::max(r.s3[j], v);
            vv = r.s3[j];
          }
          const double denom = std::sqrt(vv) / std::sqrt(bc2) + c.eps;
          p -= lr_d / bc1 * m / denom;
          break;
        }
        case Kind::SGD: {
          if (wd != 0.0) g += wd * p;
          if (c.momentum != 0.0) {
            double& buf = r.s1[j];
            buf = r.step == 1.0 ? g : c.momentum * buf + (1.0 - c.dampening) * g;
            g = c.nesterov ? g + c.momentum * buf : buf;
          }
          p -= lr_d * g;
          break;
        }
        case Kind::Lion: {
          double& m = r.s1[j];
          const double u = c.beta1 * m + (1.0 - c.beta1) * g;
          p *= 1.0 - lr_d * wd;
          p -= lr_d * static_cast<double>((u > 0.0) - (u < 0.0));
          m = c.beta2 * m + (1.0 - c.beta2) * g;
          break;
        }
      }
      r.w[j] = round_to(p, c.master ? at::kFloat : r.pt);
      if (c.ema) {
        const double w = 1.0 - static_cast<double>(c.ema_decay);
        r.ema[j] = round_to(r.ema[j] + w * (r.w[j] - r.ema[j]), r.pt);
      }
    }
  }

  // Every tensor against the reference (run after each step).
  void check() const {
    for (size_t t = 0; t < ref.size(); ++t) {
      const RefTensor& r = ref[t];
      SCOPED_TRACE(::testing::Message() << "after step " << done << ", tensor " << t << " shape " << params[t].sizes() << " param "
                                        << r.pt << " grad " << specs[t].gt);
      EXPECT_EQ(steps[t].item<float>(), static_cast<float>(r.step));
      if (c.master) {
        EXPECT_TRUE(close_to(master[t], r.w, at::kFloat)) << "master";
        EXPECT_TRUE(bitwise_equal(params[t], master[t].to(r.pt))) << "param is not the rounded master";
      } else {
        EXPECT_TRUE(close_to(params[t], r.w, r.pt)) << "param";
      }
      if (!s1.empty()) EXPECT_TRUE(close_to(s1[t], r.s1, at::kFloat)) << "state 1";
      if (!s2.empty()) EXPECT_TRUE(close_to(s2[t], r.s2, at::kFloat)) << "exp_avg_sq";
      if (c.amsgrad) EXPECT_TRUE(close_to(s3[t], r.s3, at::kFloat)) << "max_exp_avg_sq";
      if (c.ema) EXPECT_TRUE(close_to(ema[t], r.ema, r.pt)) << "ema";
    }
  }

  TensorVec all_tensors() const {
    TensorVec v;
    for (const TensorVec* l : {&params, &s1, &s2, &s3, &master, &ema, &steps}) v.insert(v.end(), l->begin(), l->end());
    return v;
  }
};

std::vector<Spec> odd_sizes(at::ScalarType pt = at::kFloat, at::ScalarType gt = at::kFloat) {
  std::vector<Spec> v;
  for (std::vector<int64_t> shape : {std::vector<int64_t>{1}, {7}, {1031}, {65537}, {0}, {3, 5, 7}}) {
    v.push_back(Spec{shape, pt, gt});
  }
  return v;
}

// Low-precision params with every grad dtype, at sizes that cover the vector
// tails of both kernels.
std::vector<Spec> lowp_specs() {
  std::vector<Spec> v;
  for (at::ScalarType pt : {at::kHalf, at::kBFloat16}) {
    for (at::ScalarType gt : {at::kFloat, at::kHalf, at::kBFloat16}) {
      v.push_back(Spec{{7}, pt, gt});
      v.push_back(Spec{{1031}, pt, gt});
    }
    v.push_back(Spec{{65537}, pt, pt});
  }
  return v;
}

// ---- fixtures ------------------------------------------------------------------

class OnDevice : public ::testing::TestWithParam<at::DeviceType> {
 protected:
  void SetUp() override {
    if (GetParam() == at::kCUDA) {
      if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
      if (!fusetrain::built_with_cuda()) GTEST_SKIP() << "fusetrain was built without its CUDA kernels";
    }
    at::manual_seed(1234);
  }
  at::Device dev() const { return at::Device(GetParam()); }
  at::TensorOptions f32() const { return at::TensorOptions().dtype(at::kFloat).device(dev()); }

  void run_and_check(const Cfg& c, std::vector<Spec> specs) {
    Harness h(c, std::move(specs), dev());
    h.run();
  }
};

class FusedAdam : public OnDevice {};
class FusedSGD : public OnDevice {};
class FusedLion : public OnDevice {};
class FusedCommon : public OnDevice {};
class FusedArgs : public OnDevice {};

std::string device_name(const ::testing::TestParamInfo<at::DeviceType>& info) {
  return info.param == at::kCPU ? "CPU" : "CUDA";
}

#define FT_ON_DEVICES(Suite) \
  INSTANTIATE_TEST_SUITE_P(Devices, Suite, ::testing::Values(at::kCPU, at::kCUDA), device_name)

// ---- Adam / AdamW --------------------------------------------------------------

TEST_P(FusedAdam, Fp32L2WeightDecayOddSizes) {
  Cfg c;
  c.weight_decay = 0.01;
  c.steps = 4;
  run_and_check(c, odd_sizes());
}

TEST_P(FusedAdam, Fp32DecoupledWeightDecay) {
  Cfg c;
  c.weight_decay = 0.1;
  c.decoupled = true;
  c.beta1 = 0.8;
  c.beta2 = 0.99;
  c.eps = 1e-6;
  c.steps = 4;
  run_and_check(c, odd_sizes());
}

TEST_P(FusedAdam, Fp32AmsgradMaximize) {
  Cfg c;
  c.amsgrad = true;
  c.maximize = true;
  c.weight_decay = 0.05;
  c.decoupled = true;
  c.step0 = 5.f;
  c.steps = 4;
  run_and_check(c, odd_sizes());
}

TEST_P(FusedAdam, AmsgradL2WeightDecay) {
  Cfg c;
  c.amsgrad = true;
  c.weight_decay = 0.02;
  run_and_check(c, odd_sizes());
}

TEST_P(FusedAdam, Fp32ParamsWithLowPrecisionGrads) {
  Cfg c;
  c.weight_decay = 0.01;
  c.decoupled = true;
  run_and_check(c, {Spec{{1031}, at::kFloat, at::kHalf}, Spec{{65537}, at::kFloat, at::kBFloat16},
                    Spec{{7}, at::kFloat, at::kHalf}, Spec{{1}, at::kFloat, at::kBFloat16}});
}

TEST_P(FusedAdam, LowPrecisionWithoutMaster) {
  Cfg c;
  c.weight_decay = 0.01;
  run_and_check(c, lowp_specs());
}

TEST_P(FusedAdam, LowPrecisionWithMasterAndEma) {
  Cfg c;
  c.lr = 1e-3f;  // steps of about an fp16 ulp and below bf16's: the master accumulates them
  c.weight_decay = 0.1;
  c.decoupled = true;
  c.amsgrad = true;
  c.master = true;
  c.ema = true;
  c.ema_decay = 0.75f;
  c.steps = 4;
  run_and_check(c, lowp_specs());
}

TEST_P(FusedAdam, NonContiguousGrad) {
  Cfg c;
  c.weight_decay = 0.01;
  run_and_check(c, {Spec{{7, 5}, at::kFloat, at::kFloat, true}, Spec{{33, 40}, at::kBFloat16, at::kHalf, true},
                    Spec{{64, 129}, at::kFloat, at::kBFloat16, true}});
}

TEST_P(FusedAdam, ChannelsLastParamsWithContiguousGrads) {
  // Params and their state share a channels-last layout; the grads are
  // row-major, so the op must pair elements by index, not by memory offset.
  Cfg c;
  c.weight_decay = 0.01;
  c.amsgrad = true;
  c.master = true;
  c.ema = true;
  Harness h(c, {Spec{{4, 3, 5, 7}, at::kHalf, at::kFloat, false, true}, Spec{{2, 8, 3, 3}, at::kFloat, at::kBFloat16, false, true}},
            dev());
  ASSERT_FALSE(h.params[0].is_contiguous());
  h.run();
  EXPECT_TRUE(h.params[0].is_contiguous(at::MemoryFormat::ChannelsLast));
}

// ---- SGD -----------------------------------------------------------------------

TEST_P(FusedSGD, PlainWithWeightDecay) {
  Cfg c;
  c.kind = Kind::SGD;
  c.lr = 0.05f;
  c.weight_decay = 0.01;
  run_and_check(c, odd_sizes());
}

TEST_P(FusedSGD, MomentumDampening) {
  Cfg c;
  c.kind = Kind::SGD;
  c.momentum = 0.9;
  c.dampening = 0.1;
  c.weight_decay = 0.001;
  c.steps = 4;
  run_and_check(c, odd_sizes());
}

TEST_P(FusedSGD, NesterovMaximizeFromLaterStep) {
  Cfg c;
  c.kind = Kind::SGD;
  c.momentum = 0.8;
  c.nesterov = true;
  c.maximize = true;
  c.weight_decay = 0.01;
  c.step0 = 7.f;  // the existing buffer is used from the first call
  run_and_check(c, odd_sizes());
}

TEST_P(FusedSGD, FirstStepBufferIsTheGrad) {
  Cfg c;
  c.kind = Kind::SGD;
  c.momentum = 0.9;
  c.dampening = 0.5;
  c.steps = 1;
  Harness h(c, {Spec{{1031}}, Spec{{7}}, Spec{{65537}, at::kBFloat16, at::kFloat}}, dev());
  const TensorVec before = clone_all(h.s1);
  const TensorVec grads = h.make_grads();
  h.call(grads, {});
  for (size_t t = 0; t < grads.size(); ++t) {
    // No weight decay, no scaling: the buffer is exactly the grad, whatever it held.
    EXPECT_FALSE(bitwise_equal(h.s1[t], before[t]));
    EXPECT_TRUE(bitwise_equal(h.s1[t], grads[t].to(at::kFloat))) << "tensor " << t;
    EXPECT_EQ(h.steps[t].item<float>(), 1.f);
  }
  // The second step blends: buf = 0.9 buf + 0.5 g.
  const TensorVec grads2 = h.make_grads();
  h.call(grads2, {});
  for (size_t t = 0; t < grads.size(); ++t) {
    std::vector<double> expect = to_vec(grads[t]);
    const std::vector<double> g2 = to_vec(grads2[t]);
    for (size_t j = 0; j < expect.size(); ++j) expect[j] = 0.9 * expect[j] + 0.5 * g2[j];
    EXPECT_TRUE(close_to(h.s1[t], expect, at::kFloat)) << "tensor " << t;
  }
}

TEST_P(FusedSGD, LowPrecisionWithoutMaster) {
  Cfg c;
  c.kind = Kind::SGD;
  c.momentum = 0.9;
  c.weight_decay = 0.01;
  run_and_check(c, lowp_specs());
}

TEST_P(FusedSGD, LowPrecisionWithMasterEmaAndClip) {
  Cfg c;
  c.kind = Kind::SGD;
  c.lr = 1e-3f;
  c.momentum = 0.9;
  c.nesterov = true;
  c.master = true;
  c.ema = true;
  c.grad_scale = 256.f;
  c.clip_ratio = 0.3;
  run_and_check(c, lowp_specs());
}

// ---- Lion ----------------------------------------------------------------------

TEST_P(FusedLion, Fp32WithWeightDecay) {
  Cfg c;
  c.kind = Kind::Lion;
  c.lr = 1e-3f;
  c.beta1 = 0.9;
  c.beta2 = 0.99;
  c.weight_decay = 0.1;
  c.steps = 4;
  run_and_check(c, odd_sizes());
}

TEST_P(FusedLion, MaximizeLowPrecisionWithoutMaster) {
  Cfg c;
  c.kind = Kind::Lion;
  c.lr = 1e-2f;
  c.beta1 = 0.95;
  c.beta2 = 0.98;
  c.maximize = true;
  c.weight_decay = 0.01;
  run_and_check(c, lowp_specs());
}

TEST_P(FusedLion, LowPrecisionWithMasterAndEma) {
  Cfg c;
  c.kind = Kind::Lion;
  c.lr = 1e-4f;
  c.weight_decay = 0.5;
  c.master = true;
  c.ema = true;
  c.ema_decay = 0.999f;
  c.steps = 4;
  run_and_check(c, lowp_specs());
}

// ---- what every update op shares: unscale, clip, skip, EMA, many tensors -----

TEST_P(FusedCommon, UnscaleAndClipActive) {
  for (Kind k : {Kind::Adam, Kind::SGD, Kind::Lion}) {
    SCOPED_TRACE(static_cast<int>(k));
    Cfg c;
    c.kind = k;
    c.momentum = 0.9;
    c.grad_scale = 1024.f;
    c.clip_ratio = 0.25;
    Harness h(c, {Spec{{1031}, at::kFloat, at::kHalf}, Spec{{65537}}, Spec{{7}, at::kFloat, at::kBFloat16}}, dev());
    h.run();
    for (double coef : h.clip_coefs) EXPECT_LT(coef, 0.26);  // the clipping really happened
  }
}

TEST_P(FusedCommon, UnscaleWithClipInactive) {
  Cfg c;
  c.grad_scale = 65536.f;
  c.clip_ratio = 4.0;
  Harness h(c, {Spec{{1031}}, Spec{{4099}, at::kFloat, at::kBFloat16}}, dev());
  h.run();
  for (double coef : h.clip_coefs) EXPECT_EQ(coef, 1.0);
}

TEST_P(FusedCommon, GradNormWithoutMaxDoesNotClip) {
  Cfg c;
  c.kind = Kind::SGD;
  c.lr = 0.1f;
  c.norm_without_max = true;
  run_and_check(c, {Spec{{1031}}, Spec{{7}}});
}

TEST_P(FusedCommon, ClipCoefficientSeenThroughPlainSGD) {
  // Plain SGD moves each element by lr * inv_scale * coef * g: the step divided
  // by lr * g is the multiplier, which must be inv_scale * min(1, max / (norm + 1e-6)).
  Cfg c;
  c.kind = Kind::SGD;
  c.lr = 0.5f;
  c.grad_scale = 8.f;
  c.clip_ratio = 0.1;
  Harness h(c, {Spec{{4096}}, Spec{{100}, at::kFloat, at::kHalf}}, dev());
  const TensorVec p0 = clone_all(h.params);
  const TensorVec grads = h.make_grads();
  double gmul_ref = 0.0;
  const Tail tail = h.tail_for(grads, &gmul_ref);
  h.call(grads, tail);
  EXPECT_NEAR(h.clip_coefs[0], 0.1, 1e-6);
  EXPECT_NEAR(gmul_ref, 0.1 / 8.0, 1e-6);
  for (size_t t = 0; t < grads.size(); ++t) {
    const at::Tensor step = (p0[t] - h.params[t]).cpu().to(at::kDouble);
    const at::Tensor base = grads[t].cpu().to(at::kDouble) * static_cast<double>(c.lr);
    const double mult = ((step * base).sum() / (base * base).sum()).item<double>();  // least squares
    EXPECT_NEAR(mult, gmul_ref, 1e-5 * gmul_ref) << "tensor " << t;
  }
}

TEST_P(FusedCommon, EmaFp32) {
  for (Kind k : {Kind::Adam, Kind::SGD, Kind::Lion}) {
    SCOPED_TRACE(static_cast<int>(k));
    Cfg c;
    c.kind = k;
    c.ema = true;
    c.ema_decay = 0.9f;
    c.steps = 4;
    run_and_check(c, odd_sizes());
  }
}

TEST_P(FusedCommon, EmaLowPrecisionFollowsStoredParam) {
  Cfg c;
  c.ema = true;
  c.ema_decay = 0.5f;
  c.weight_decay = 0.01;
  c.decoupled = true;
  run_and_check(c, lowp_specs());
}

TEST_P(FusedCommon, SkipLeavesEverythingBitIdentical) {
  for (Kind k : {Kind::Adam, Kind::SGD, Kind::Lion}) {
    for (bool from_stats : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "kind " << static_cast<int>(k) << " from grad_stats " << from_stats);
      Cfg c;
      c.kind = k;
      c.amsgrad = true;
      c.momentum = 0.9;
      c.weight_decay = 0.01;
      c.master = true;
      c.ema = true;
      c.grad_scale = 1024.f;
      c.step0 = 3.f;
      Harness h(c, {Spec{{1031}, at::kHalf, at::kHalf}, Spec{{7}, at::kBFloat16, at::kFloat}, Spec{{65537}},
                    Spec{{1}, at::kHalf, at::kBFloat16}},
                dev());
      h.step();  // a real step first, so that the state is not the initial one
      const TensorVec before = clone_all(h.all_tensors());
      TensorVec grads = h.make_grads();
      Tail tail;
      tail.inv_scale = h.inv_scale;
      tail.ema_decay = h.ema_decay;
      if (from_stats) {
        grads[2].view({-1})[65536] = std::numeric_limits<float>::infinity();
        grads[1].view({-1})[3] = std::numeric_limits<float>::quiet_NaN();
        auto [norm, found_inf] = fusetrain::grad_stats(grads, h.inv_scale);
        EXPECT_EQ(found_inf.item<float>(), 1.f);
        tail.found_inf = found_inf;
        tail.grad_norm = norm;
        tail.max_grad_norm = 1.0;
      } else {
        tail.found_inf = at::ones({}, f32());
      }
      h.call(grads, tail);
      const TensorVec after = h.all_tensors();
      ASSERT_EQ(before.size(), after.size());
      for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(bitwise_equal(before[i], after[i])) << "tensor " << i;
      EXPECT_EQ(h.steps[0].item<float>(), 4.f);
    }
  }
}

TEST_P(FusedCommon, FoundInfZeroUpdatesLikeNoFlag) {
  for (Kind k : {Kind::Adam, Kind::SGD, Kind::Lion}) {
    SCOPED_TRACE(static_cast<int>(k));
    Cfg c;
    c.kind = k;
    c.momentum = 0.9;
    c.master = true;
    c.ema = true;
    std::vector<Spec> specs = {Spec{{1031}, at::kBFloat16, at::kHalf}, Spec{{7}}};
    at::manual_seed(7);
    Harness a(c, specs, dev());
    at::manual_seed(7);
    Harness b(c, specs, dev());
    const TensorVec grads = a.make_grads();
    const TensorVec initial = clone_all(a.params);
    Tail ta;
    ta.ema_decay = a.ema_decay;
    ta.found_inf = at::zeros({}, f32());
    Tail tb;
    tb.ema_decay = b.ema_decay;
    a.call(grads, ta);
    b.call(grads, tb);
    const TensorVec av = a.all_tensors(), bv = b.all_tensors();
    for (size_t i = 0; i < av.size(); ++i) EXPECT_TRUE(bitwise_equal(av[i], bv[i])) << "tensor " << i;
    EXPECT_EQ(a.steps[0].item<float>(), 1.f);
    for (size_t i = 0; i < initial.size(); ++i) EXPECT_FALSE(bitwise_equal(initial[i], a.params[i]));
  }
}

TEST_P(FusedCommon, ManyTensorsMixedDtypes) {
  // 200 tensors of assorted sizes, every (param, grad) dtype pair in one list.
  const at::ScalarType dts[] = {at::kFloat, at::kHalf, at::kBFloat16};
  std::vector<Spec> specs;
  for (int i = 0; i < 200; ++i) {
    const int64_t n = 1 + (i * 7919) % 3001;
    specs.push_back(Spec{{n}, dts[i % 3], dts[(i / 3) % 3]});
  }
  specs[17].shape = {70001};  // one tensor spanning several chunks amid the small ones
  for (Kind k : {Kind::Adam, Kind::SGD, Kind::Lion}) {
    SCOPED_TRACE(static_cast<int>(k));
    Cfg c;
    c.kind = k;
    c.momentum = 0.9;
    c.weight_decay = 0.01;
    c.ema = true;
    c.grad_scale = 512.f;
    c.clip_ratio = 0.5;
    run_and_check(c, specs);
  }
}

TEST_P(FusedCommon, ManyTensorsWithMaster) {
  std::vector<Spec> specs;
  for (int i = 0; i < 200; ++i) {
    specs.push_back(Spec{{1 + (i * 104729) % 2053}, i % 2 ? at::kHalf : at::kBFloat16, i % 3 ? at::kFloat : at::kHalf});
  }
  Cfg c;
  c.decoupled = true;
  c.weight_decay = 0.05;
  c.master = true;
  c.lr = 1e-3f;
  run_and_check(c, specs);
}

TEST_P(FusedCommon, EmptyListsForEveryKind) {
  const TensorVec none;
  at::Tensor lr = at::full({}, 0.1f, f32());
  Tail tail;
  tail.inv_scale = at::full({}, 0.5f, f32());
  tail.found_inf = at::zeros({}, f32());
  tail.grad_norm = at::full({}, 3.f, f32());
  tail.max_grad_norm = 1.0;
  tail.ema_decay = at::full({}, 0.9f, f32());
  for (const auto* spec : fusetrain::detail::all_kinds()) {
    SCOPED_TRACE(spec->name);
    std::map<std::string, double> fields;
    for (const auto& f : spec->fields) fields[f.name] = 0.0;
    EXPECT_NO_THROW(kind_step(spec->name, none, none, none, none, none, none, none, none, lr, fields, false, tail));
  }
  auto [norm, found_inf] = fusetrain::grad_stats(none, *tail.inv_scale);
  EXPECT_EQ(norm.item<float>(), 0.f);
  EXPECT_EQ(found_inf.item<float>(), 0.f);
  EXPECT_EQ(norm.device().type(), GetParam());
}

// ---- argument checks -----------------------------------------------------------

struct AdamCall {
  TensorVec params, grads, m, v, vmax, steps, master, ema;
  at::Tensor lr;
  bool amsgrad = false;
  Tail tail;
  void operator()() const {
    kind_step("adam", params, grads, steps, m, v, vmax, master, ema, lr,
              {{"beta1", 0.9}, {"beta2", 0.999}, {"weight_decay", 0.0}, {"eps", 1e-8}, {"amsgrad", amsgrad},
               {"decoupled_weight_decay", 1.0}, {"bias_correction", 1.0}},
              false, tail);
  }
};

AdamCall good_adam_call(at::Device dev) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  AdamCall c;
  for (int64_t n : {5, 9}) {
    c.params.push_back(at::randn({n}, f32));
    c.grads.push_back(at::randn({n}, f32));
    c.m.push_back(at::zeros({n}, f32));
    c.v.push_back(at::zeros({n}, f32));
    c.steps.push_back(at::zeros({}, f32));
  }
  c.lr = at::full({}, 1e-3f, f32);
  return c;
}

TEST_P(FusedArgs, GoodCallRuns) {
  AdamCall c = good_adam_call(dev());
  EXPECT_NO_THROW(c());
  EXPECT_EQ(c.steps[1].item<float>(), 1.f);
}

TEST_P(FusedArgs, MismatchedListSizes) {
  {
    AdamCall c = good_adam_call(dev());
    c.grads.pop_back();
    expect_error(c, {"fused_step_", "grads"});
  }
  {
    AdamCall c = good_adam_call(dev());
    c.steps.pop_back();
    expect_error(c, {"state_steps"});
  }
  {
    AdamCall c = good_adam_call(dev());
    c.m.pop_back();
    expect_error(c, {"state1"});
  }
  {
    AdamCall c = good_adam_call(dev());
    c.amsgrad = true;
    expect_error(c, {"state3"});
  }
  {
    AdamCall c = good_adam_call(dev());
    c.master.push_back(c.params[0].clone());
    expect_error(c, {"master_params"});
  }
  {
    const auto opts = f32();
    TensorVec p = {at::randn({4}, opts)}, g = {at::randn({4}, opts)}, s = {at::zeros({}, opts)}, none;
    at::Tensor lr = at::full({}, 0.1f, opts);
    const std::map<std::string, double> sgd = {
        {"momentum", 0.9}, {"dampening", 0.0}, {"weight_decay", 0.0}, {"nesterov", 0.0}};
    const std::map<std::string, double> lion = {{"beta1", 0.9}, {"beta2", 0.99}, {"weight_decay", 0.0}};
    expect_error([&] { kind_step("sgd", p, g, s, none, none, none, none, none, lr, sgd); }, {"fused_step_", "state1"});
    expect_error([&] { kind_step("lion", p, g, s, none, none, none, none, none, lr, lion); },
                 {"fused_step_", "state1"});
  }
}

TEST_P(FusedArgs, MismatchedShapes) {
  {
    AdamCall c = good_adam_call(dev());
    c.grads[1] = at::randn({10}, f32());
    expect_error(c, {"grads[1]", "shape"});
    // A rejected call changes nothing, not even the steps of the tensors before the bad one.
    EXPECT_EQ(c.steps[0].item<float>(), 0.f);
  }
  {
    AdamCall c = good_adam_call(dev());
    c.grads[0] = at::randn({5, 1}, f32());
    expect_error(c, {"grads[0]"});
  }
  {
    AdamCall c = good_adam_call(dev());
    c.v[0] = at::zeros({6}, f32());
    expect_error(c, {"exp_avg_sq[0]", "shape"});
  }
  {
    AdamCall c = good_adam_call(dev());
    for (auto& p : c.params) {
      c.master.push_back(p.clone());
      p = p.to(at::kHalf);
    }
    c.master[1] = at::zeros({8}, f32());
    expect_error(c, {"master_params[1]", "shape"});
  }
}

TEST_P(FusedArgs, Float64AndOtherDtypes) {
  {
    AdamCall c = good_adam_call(dev());
    c.params[0] = c.params[0].to(at::kDouble);
    expect_error(c, {"params[0]", "Double"});
  }
  {
    AdamCall c = good_adam_call(dev());
    c.grads[1] = c.grads[1].to(at::kDouble);
    expect_error(c, {"grads[1]"});
  }
  {
    AdamCall c = good_adam_call(dev());
    c.grads[0] = at::randn({5}, f32().dtype(at::kComplexFloat));
    expect_error(c, {"grads[0]", "complex"});
  }
  {
    AdamCall c = good_adam_call(dev());
    c.m[0] = c.m[0].to(at::kHalf);
    expect_error(c, {"exp_avg[0]", "float32"});
  }
  {
    AdamCall c = good_adam_call(dev());
    c.steps[0] = at::zeros({}, f32().dtype(at::kDouble));
    expect_error(c, {"state_steps[0]"});
  }
  {
    AdamCall c = good_adam_call(dev());
    for (const auto& p : c.params) c.ema.push_back(p.to(at::kHalf));
    c.tail.ema_decay = at::full({}, 0.9f, f32());
    expect_error(c, {"ema_params[0]", "dtype"});
  }
  {
    AdamCall c = good_adam_call(dev());
    for (const auto& p : c.params) c.ema.push_back(p.clone());
    expect_error(c, {"ema_decay"});
  }
}

TEST_P(FusedArgs, BadScalars) {
  {
    AdamCall c = good_adam_call(dev());
    c.lr = at::full({2}, 1e-3f, f32());
    expect_error(c, {"lr", "one element"});
  }
  {
    AdamCall c = good_adam_call(dev());
    c.tail.inv_scale = at::ones({3}, f32());
    expect_error(c, {"inv_scale"});
  }
  {
    AdamCall c = good_adam_call(dev());
    c.tail.found_inf = at::zeros({}, f32().dtype(at::kHalf));
    expect_error(c, {"found_inf"});
  }
  const TensorVec none;
  const auto opts = f32();
  TensorVec p = {at::randn({4}, opts)}, g = {at::randn({4}, opts)}, s = {at::zeros({}, opts)};
  at::Tensor lr = at::full({}, 0.1f, opts);
  TensorVec m = {at::zeros({4}, opts)}, v = {at::zeros({4}, opts)};
  expect_error([&] {
    kind_step("adam", p, g, s, m, v, none, none, none, lr,
              {{"beta1", 1.0}, {"beta2", 0.999}, {"weight_decay", 0.0}, {"eps", 1e-8}, {"amsgrad", 0.0},
               {"decoupled_weight_decay", 0.0}, {"bias_correction", 1.0}});
  }, {"beta1"});
  expect_error([&] {
    kind_step("sgd", p, g, s, none, none, none, none, none, lr,
              {{"momentum", 0.0}, {"dampening", 0.0}, {"weight_decay", 0.0}, {"nesterov", 1.0}});
  }, {"nesterov"});
  expect_error([&] {
    kind_step("lion", p, g, s, m, none, none, none, none, lr,
              {{"beta1", 0.9}, {"beta2", 0.99}, {"weight_decay", -1.0}});
  }, {"weight_decay"});
  EXPECT_EQ(s[0].item<float>(), 0.f);
}

TEST_P(FusedArgs, MixedDevices) {
  if (GetParam() != at::kCUDA) GTEST_SKIP() << "needs a second device type";
  {
    AdamCall c = good_adam_call(dev());
    c.grads[0] = c.grads[0].cpu();
    expect_error(c, {"grads[0]", "cpu"});
  }
  {
    AdamCall c = good_adam_call(dev());
    c.m[1] = c.m[1].cpu();
    expect_error(c, {"[1]", "cpu"});
  }
  {
    AdamCall c = good_adam_call(dev());
    c.steps[1] = c.steps[1].cpu();
    expect_error(c, {"state_steps[1]"});
  }
  {
    AdamCall c = good_adam_call(dev());
    c.params[1] = c.params[1].cpu();
    expect_error(c, {"params[1]"});
  }
}

// NOTE [lean state] (csrc/common/lean_state.h): a bfloat16 param and its
// int16 remainder (master_weights 2) are the fp32 master (master_weights 1)
// bit for bit, with bfloat16 moments too (the same stochastic rounding both times).
TEST_P(FusedCommon, RemainderIsTheFloat32MasterBitForBit) {
  const int64_t n = 70001;
  const auto bf = f32().dtype(at::kBFloat16);
  const at::Tensor start = at::randn({n}, f32()).to(at::kBFloat16);
  at::Tensor p_full = start.clone(), p_lean = start.clone(), master = start.to(at::kFloat);
  at::Tensor rem = at::zeros({n}, f32().dtype(at::kShort));
  TensorVec m = {at::zeros({n}, bf), at::zeros({n}, bf)}, v = {at::zeros({n}, bf), at::zeros({n}, bf)};
  TensorVec steps = {at::zeros({}, f32()), at::zeros({}, f32())};
  const at::Tensor lr = at::full({}, 1e-2, f32());
  std::vector<double> record = {0.0, 0.0, 0.0, 0.0};
  for (const auto& f : fusetrain::detail::find_kind("adam").fields) {
    const std::map<std::string, double> values = {{"beta1", 0.9}, {"beta2", 0.999}, {"weight_decay", 0.1},
                                                  {"eps", 1e-8}, {"amsgrad", 0.0}, {"decoupled_weight_decay", 1.0},
                                                  {"bias_correction", 1.0}};
    record.push_back(values.at(f.name));
  }
  for (int step = 0; step < 5; ++step) {
    const at::Tensor g = at::randn({n}, f32()).to(at::kBFloat16);
    for (int k = 0; k < 2; ++k) {
      record[1] = k == 0 ? 1.0 : 2.0;
      fusetrain::fused_step_("adam", {k == 0 ? p_full : p_lean}, {g}, {steps[k]}, {m[k]}, {v[k]}, {},
                             {k == 0 ? master : rem}, {}, {1}, {lr}, record, std::nullopt, std::nullopt,
                             std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
    }
  }
  const at::Tensor joined = p_lean.view(at::kShort).to(at::kInt).bitwise_and(0xFFFF).__lshift__(16).add(
      rem.to(at::kInt));
  EXPECT_TRUE(at::equal(joined, master.view(at::kInt)));
  EXPECT_TRUE(at::equal(m[0], m[1]) && at::equal(v[0], v[1]));
  EXPECT_GT(rem.abs().sum().item<int64_t>(), 0);
}

FT_ON_DEVICES(FusedAdam);
FT_ON_DEVICES(FusedSGD);
FT_ON_DEVICES(FusedLion);
FT_ON_DEVICES(FusedCommon);
FT_ON_DEVICES(FusedArgs);

}  // namespace
