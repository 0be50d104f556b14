// The C++ half of the conformance suite: every case of
// tests/conformance/cases.txt run through fusetrain's C++ front end
// (optimizers, LossScaler, attached ModelEMA). With FUSETRAIN_CONFORMANCE_OUT
// set, the results are written there (torch::pickle_save of a dict of
// tensors) for tests/python/optim/test_conformance.py, which runs the same cases
// through the Python front end and requires bit-identical results.
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "test_util.h"

namespace {

using Case = std::map<std::string, std::string>;

// The checkout holding tests/conformance: $FUSETRAIN_SOURCE_DIR when set (a test
// binary run on another machine than the one that built it), else the build's.
std::string source_dir() {
  const char* env = std::getenv("FUSETRAIN_SOURCE_DIR");
  return env && *env ? env : FUSETRAIN_SOURCE_DIR;
}

std::vector<Case> read_cases() {
  std::ifstream in(source_dir() + "/tests/conformance/cases.txt");
  EXPECT_TRUE(in.good()) << "cannot read tests/conformance/cases.txt";
  std::vector<Case> cases;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream words(line);
    Case c{{"optimizer", "adamw"}, {"dtype", "fp32"}, {"master", "0"}, {"clip", "0"}, {"amsgrad", "0"},
           {"bias_correction", "1"}, {"scaler", "0"}, {"ema", "0"}, {"accumulate", "1"}, {"steps", "4"}, {"inf_step", "-1"},
           {"lr", "0.01"}, {"lr_decay", "1"}, {"seed", "0"}, {"groups", "1"}};
    words >> c["name"];
    std::string kv;
    while (words >> kv) {
      const auto eq = kv.find('=');
      EXPECT_NE(eq, std::string::npos) << "bad entry '" << kv << "' in case " << c["name"];
      EXPECT_TRUE(c.count(kv.substr(0, eq))) << "unknown key '" << kv << "' in case " << c["name"];
      c[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    cases.push_back(c);
  }
  return cases;
}

const std::vector<std::vector<int64_t>> kShapes = {{7}, {13, 5}, {3, 4, 2}};

struct ToyImpl : torch::nn::Cloneable<ToyImpl> {
  explicit ToyImpl(at::ScalarType dtype) : dtype(dtype) { reset(); }
  void reset() override {
    for (size_t i = 0; i < kShapes.size(); ++i)
      register_parameter("p" + std::to_string(i), torch::zeros(kShapes[i], torch::dtype(dtype)));
    register_buffer("running", torch::zeros({5}));
    register_buffer("count", torch::zeros({}, torch::kLong));
  }
  at::ScalarType dtype;
};
TORCH_MODULE(Toy);

// groups=2: the last param in a group of its own without weight decay.
template <typename Opt, typename Options>
std::unique_ptr<fusetrain::FusedOptimizer> make(const Case& c, std::vector<torch::Tensor> params, Options o) {
  if (c.at("groups") == "1") return std::make_unique<Opt>(params, o);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>(params.begin(), params.end() - 1),
                      std::make_unique<Options>(o));
  groups.emplace_back(std::vector<torch::Tensor>{params.back()}, std::make_unique<Options>(Options(o).weight_decay(0.0)));
  return std::make_unique<Opt>(groups, o);
}

std::unique_ptr<fusetrain::FusedOptimizer> make_optimizer(const Case& c, std::vector<torch::Tensor> params) {
  const double lr = std::stod(c.at("lr")), clip = std::stod(c.at("clip"));
  const bool master = c.at("master") == "1", amsgrad = c.at("amsgrad") == "1";
  const bool bias_correction = c.at("bias_correction") == "1";
  const auto& name = c.at("optimizer");
  if (name == "adam")
    return make<fusetrain::Adam>(c, params, fusetrain::AdamOptions(lr).betas({0.9, 0.99}).weight_decay(0.01)
                                                .amsgrad(amsgrad).bias_correction(bias_correction)
                                                .max_grad_norm(clip).master_weights(master));
  if (name == "adamw")
    return make<fusetrain::AdamW>(c, params, fusetrain::AdamWOptions(lr).betas({0.9, 0.99}).weight_decay(0.05)
                                                 .amsgrad(amsgrad).bias_correction(bias_correction)
                                                 .max_grad_norm(clip).master_weights(master));
  if (name == "sgd")
    return make<fusetrain::SGD>(c, params, fusetrain::SGDOptions(lr).momentum(0.9).nesterov(true).weight_decay(0.01)
                                               .max_grad_norm(clip).master_weights(master));
  if (name == "rmsprop")
    return make<fusetrain::RMSprop>(c, params, fusetrain::RMSpropOptions(lr).alpha(0.9).weight_decay(0.01)
                                                   .momentum(0.5).centered(true).max_grad_norm(clip)
                                                   .master_weights(master));
  if (name == "rmsprop_tf")
    return make<fusetrain::RMSpropTF>(c, params, fusetrain::RMSpropTFOptions(lr).alpha(0.9).eps(1e-3)
                                                     .weight_decay(0.01).momentum(0.9).lr_in_momentum(true)
                                                     .decoupled_decay(true).max_grad_norm(clip)
                                                     .master_weights(master));
  if (name == "muon") {  // the matrices in a Muon group, the vector in an AdamW group (as Python's Muon splits)
    const auto o = fusetrain::MuonOptions(lr).weight_decay(0.05).adjust_lr_fn("match_rms_adamw").max_grad_norm(clip)
                       .master_weights(master);
    std::vector<torch::Tensor> mats, rest;
    for (const auto& p : params) (p.dim() >= 2 ? mats : rest).push_back(p);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(mats, std::make_unique<fusetrain::MuonOptions>(o));
    groups.emplace_back(rest, std::make_unique<fusetrain::MuonOptions>(fusetrain::MuonOptions(o).use_muon(false)));
    return std::make_unique<fusetrain::Muon>(groups, o);
  }
  if (name == "adadelta")
    return make<fusetrain::Adadelta>(c, params, fusetrain::AdadeltaOptions(lr).rho(0.8).weight_decay(0.01)
                                                    .max_grad_norm(clip).master_weights(master));
  if (name == "radam")
    return make<fusetrain::RAdam>(c, params, fusetrain::RAdamOptions(lr).betas({0.9, 0.99}).weight_decay(0.05)
                                                 .decoupled_weight_decay(true).max_grad_norm(clip)
                                                 .master_weights(master));
  if (name == "nadam")
    return make<fusetrain::NAdam>(c, params, fusetrain::NAdamOptions(lr).betas({0.9, 0.99}).weight_decay(0.05)
                                                 .momentum_decay(0.01).decoupled_weight_decay(true)
                                                 .max_grad_norm(clip).master_weights(master));
  if (name == "lamb")
    return make<fusetrain::Lamb>(c, params, fusetrain::LambOptions(lr).weight_decay(0.05).trust_clip(true)
                                                .max_grad_norm(clip).master_weights(master));
  if (name == "adamp")
    return make<fusetrain::AdamP>(c, params, fusetrain::AdamPOptions(lr).weight_decay(0.05).delta(1.0).nesterov(true)
                                                 .max_grad_norm(clip).master_weights(master));
  EXPECT_EQ(name, "lion");
  return make<fusetrain::Lion>(c, params, fusetrain::LionOptions(lr).betas({0.9, 0.99}).weight_decay(0.1)
                                              .max_grad_norm(clip).master_weights(master));
}

// Runs one case; returns its results under "<name>/...".
void run_case(const Case& c, c10::Dict<std::string, at::Tensor>& out) {
  const auto& name = c.at("name");
  const auto dtype = c.at("dtype") == "bf16" ? torch::kBFloat16 : c.at("dtype") == "fp16" ? torch::kHalf : torch::kFloat;
  torch::manual_seed(std::stoll(c.at("seed")));
  Toy model(dtype);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.copy_(torch::randn(p.sizes()).to(dtype));
  }
  auto opt = make_optimizer(c, model->parameters());
  std::unique_ptr<fusetrain::ModelEMA> ema;
  if (c.at("ema") == "1") {
    ema = std::make_unique<fusetrain::ModelEMA>(
        model, fusetrain::ModelEMAOptions().decay(0.99).decay_type("threshold").warmup(true).warmup_power(0.75));
    ema->attach(*opt);
  }
  std::unique_ptr<fusetrain::LossScaler> scaler;
  if (c.at("scaler") == "1")
    scaler = std::make_unique<fusetrain::LossScaler>(fusetrain::LossScalerOptions().init_scale(1024).growth_interval(2));
  const int steps = std::stoi(c.at("steps")), accumulate = std::stoi(c.at("accumulate"));
  const int inf_step = std::stoi(c.at("inf_step"));
  double lr = std::stod(c.at("lr"));
  for (int step = 0; step < steps; ++step) {
    double scale = 1.0;
    if (scaler) {
      scaler->scale(torch::ones({}));  // creates the scale, as scale(loss) does
      scale = scaler->get_scale();
    }
    for (int micro = 0; micro < accumulate; ++micro) {
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) {
        auto g = (torch::randn(p.sizes()) * scale).to(dtype);
        if (micro == 0) {
          p.mutable_grad() = g;
        } else {
          p.mutable_grad().add_(g);
        }
      }
      model->named_buffers()["running"].add_(torch::randn({5}) * 0.1);
      model->named_buffers()["count"].add_(1);
    }
    if (step == inf_step) model->parameters()[1].mutable_grad().view(-1)[3] = std::numeric_limits<float>::infinity();
    if (scaler) {
      scaler->step(*opt);
      scaler->update();
    } else {
      opt->step();
    }
    opt->zero_grad();
    lr *= std::stod(c.at("lr_decay"));
    for (auto& group : opt->param_groups()) group.options().set_lr(lr);
  }
  const auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto key = name + "/param/" + std::to_string(i);
    out.insert(key, params[i].detach().clone());
    auto& st = static_cast<fusetrain::FusedParamState&>(*opt->state().at(params[i].unsafeGetTensorImpl()));
    const std::pair<const char*, at::Tensor> fields[] = {
        {"step", st.step()}, {"exp_avg", st.exp_avg()}, {"exp_avg_sq", st.exp_avg_sq()},
        {"max_exp_avg_sq", st.max_exp_avg_sq()}, {"momentum_buffer", st.momentum_buffer()},
        {"mu_product", st.mu_product()}, {"master_param", st.master()}};
    for (const auto& [field, t] : fields)
      if (t.defined()) out.insert(name + "/state/" + std::to_string(i) + "/" + field, t.clone());
  }
  for (const auto& kv : model->named_buffers()) out.insert(name + "/buffer/" + kv.key(), kv.value().clone());
  if (ema) {
    for (const auto& kv : ema->module()->named_parameters()) out.insert(name + "/ema/" + kv.key(), kv.value().clone());
    for (const auto& kv : ema->module()->named_buffers()) out.insert(name + "/ema/" + kv.key(), kv.value().clone());
    out.insert(name + "/ema_step", ema->step_tensor().clone());
  }
  if (scaler) {
    out.insert(name + "/scale", scaler->get_scale_tensor().clone());
    out.insert(name + "/growth_tracker", scaler->growth_tracker().clone());
    out.insert(name + "/skipped_steps", scaler->skipped_steps().clone());
  }
  out.insert(name + "/found_inf", opt->last_found_inf().clone());
}

TEST(Conformance, EveryCaseRunsAndSkipsItsNonFiniteStep) {
  const auto cases = read_cases();
  ASSERT_GE(cases.size(), 5u);
  c10::Dict<std::string, at::Tensor> out;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.at("name"));
    run_case(c, out);
    const auto& name = c.at("name");
    for (size_t i = 0; i < kShapes.size(); ++i) {
      const auto p = out.at(name + "/param/" + std::to_string(i));
      EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
      // Every step but the skipped one counts.
      const int expected = std::stoi(c.at("steps")) - (std::stoi(c.at("inf_step")) >= 0 ? 1 : 0);
      EXPECT_EQ(out.at(name + "/state/" + std::to_string(i) + "/step").item<float>(), expected);
    }
    if (c.at("scaler") == "1")
      EXPECT_EQ(out.at(name + "/skipped_steps").item<float>(), std::stoi(c.at("inf_step")) >= 0 ? 1.0f : 0.0f);
  }
  if (const char* path = std::getenv("FUSETRAIN_CONFORMANCE_OUT")) {
    const auto bytes = torch::pickle_save(c10::IValue(out));
    std::ofstream f(path, std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(f.good()) << "could not write " << path;
  }
}

}  // namespace
