// fusetrain::LossScaler, fusetrain::ModelEMA and fusetrain::fused_step.
#include <fusetrain/amp.h>

#include <ATen/ops/full.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/utils.h>

#include <map>
#include <unordered_set>

namespace fusetrain {

// ---- LossScaler ----------------------------------------------------------------
LossScaler::LossScaler(LossScalerOptions o) : options_(o) {
  TORCH_CHECK(o.init_scale() > 0, "fusetrain::LossScaler: init_scale must be > 0, got ", o.init_scale());
  TORCH_CHECK(o.growth_factor() > 1.0, "fusetrain::LossScaler: growth_factor must be > 1, got ", o.growth_factor());
  TORCH_CHECK(o.backoff_factor() > 0 && o.backoff_factor() < 1.0,
              "fusetrain::LossScaler: backoff_factor must be in (0, 1), got ", o.backoff_factor());
  TORCH_CHECK(o.growth_interval() > 0, "fusetrain::LossScaler: growth_interval must be > 0, got ",
              o.growth_interval());
}

void LossScaler::lazy_init(const at::Device& device) {
  if (!scale_.defined()) {
    scale_ = at::full({}, options_.init_scale(), at::TensorOptions().dtype(at::kFloat).device(device));
    growth_tracker_ = at::zeros({}, at::TensorOptions().dtype(at::kInt).device(device));
  } else if (scale_.device() != device) {
    scale_ = scale_.to(device);
    growth_tracker_ = growth_tracker_.to(device);
  }
}

at::Tensor LossScaler::scale(const at::Tensor& loss) {
  if (!options_.enabled()) return loss;
  lazy_init(loss.device());
  return loss * scale_.to(loss.scalar_type());
}

void LossScaler::step(FusedOptimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return;
  }
  TORCH_CHECK(scale_.defined(), "fusetrain::LossScaler: step() called before scale(loss)");
  torch::NoGradGuard no_grad;
  at::Tensor inv = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  optimizer.step_with(inv, std::nullopt);
  at::Tensor f = optimizer.last_found_inf();
  if (!f.defined()) f = at::zeros({}, scale_.options());
  f = f.to(scale_.device());
  last_found_inf_ = f;
  pending_found_inf_ = pending_found_inf_.defined() ? at::maximum(pending_found_inf_, f) : f;
}

void LossScaler::reset_pending() { pending_found_inf_ = at::Tensor(); }

void LossScaler::update() {
  if (!options_.enabled() || !scale_.defined()) return;
  at::Tensor f = pending_found_inf_.defined() ? pending_found_inf_ : at::zeros({}, scale_.options());
  update_scale_(scale_, growth_tracker_, f, options_.growth_factor(), options_.backoff_factor(),
                options_.growth_interval());
  pending_found_inf_ = at::Tensor();
}

double LossScaler::get_scale() const {
  if (!options_.enabled()) return 1.0;
  return scale_.defined() ? scale_.item<double>() : options_.init_scale();
}

void LossScaler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("scale", scale_.defined() ? scale_.cpu() : at::full({}, options_.init_scale(), at::kFloat));
  archive.write("growth_tracker", growth_tracker_.defined() ? growth_tracker_.cpu() : at::zeros({}, at::kInt));
  archive.write("growth_factor", c10::IValue(options_.growth_factor()));
  archive.write("backoff_factor", c10::IValue(options_.backoff_factor()));
  archive.write("growth_interval", c10::IValue(options_.growth_interval()));
}

void LossScaler::load(torch::serialize::InputArchive& archive) {
  at::Tensor s, g;
  archive.read("scale", s);
  archive.read("growth_tracker", g);
  c10::IValue v;
  archive.read("growth_factor", v);
  options_.growth_factor(v.toDouble());
  archive.read("backoff_factor", v);
  options_.backoff_factor(v.toDouble());
  archive.read("growth_interval", v);
  options_.growth_interval(v.toInt());
  const auto dev = scale_.defined() ? scale_.device() : s.device();
  scale_ = s.to(dev, at::kFloat).clone();
  growth_tracker_ = g.to(dev, at::kInt).clone();
}

// ---- ModelEMA ------------------------------------------------------------------
ModelEMA::ModelEMA(std::shared_ptr<torch::nn::Module> model, ModelEMAOptions o)
    : model_(std::move(model)), options_(std::move(o)) {
  TORCH_CHECK(model_ != nullptr, "fusetrain::ModelEMA: model is null");
  const auto& t = options_.decay_type();
  TORCH_CHECK(t == "constant" || t == "threshold" || t == "exp",
              "fusetrain::ModelEMA: decay_type must be one of 'constant', 'threshold', 'exp', got '", t, "'");
  TORCH_CHECK(options_.decay() >= 0 && options_.decay() <= 1, "fusetrain::ModelEMA: decay must be in [0, 1], got ",
              options_.decay());
  TORCH_CHECK(options_.beta() > 0, "fusetrain::ModelEMA: beta must be > 0, got ", options_.beta());
  TORCH_CHECK(options_.total_steps() >= 0, "fusetrain::ModelEMA: total_steps must be >= 0 (0 = not set), got ",
              options_.total_steps());
  TORCH_CHECK(options_.warmup_gamma() > 0, "fusetrain::ModelEMA: warmup_gamma must be > 0, got ",
              options_.warmup_gamma());
  TORCH_CHECK(options_.warmup_power() > 0, "fusetrain::ModelEMA: warmup_power must be > 0, got ",
              options_.warmup_power());
  ema_ = model_->clone();
  torch::NoGradGuard no_grad;
  for (auto& p : ema_->parameters()) p.set_requires_grad(false);
  lazy_init();
}

ModelEMA::~ModelEMA() { detach(); }

void ModelEMA::lazy_init() {
  at::Device dev = at::kCPU;
  auto ps = ema_->parameters();
  if (!ps.empty()) dev = ps.front().device();
  if (!step_.defined()) {
    step_ = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(dev));
    decay_ = at::full({}, options_.decay(), at::TensorOptions().dtype(at::kFloat).device(dev));
  }
}

void ModelEMA::set_total_steps(int64_t total_steps) {
  TORCH_CHECK(total_steps >= 0, "fusetrain::ModelEMA: total_steps must be >= 0, got ", total_steps);
  options_.total_steps(total_steps);
}

const at::Tensor& ModelEMA::prepare_decay() {
  torch::NoGradGuard no_grad;
  at::Tensor t = step_ + 1.0;  // the 1-based number of the update about to happen
  const auto opts = step_.options();
  at::Tensor d;
  const auto& type = options_.decay_type();
  if (type == "constant") {
    d = at::full({}, options_.decay(), opts);
  } else if (type == "threshold") {
    d = at::minimum(at::full({}, options_.decay(), opts), (t + 1.0) / (t + 10.0));
  } else {
    TORCH_CHECK(options_.total_steps() > 0,
                "fusetrain::ModelEMA: decay_type 'exp' needs total_steps (set it in the options or with "
                "set_total_steps)");
    d = ((t * (-options_.beta() / static_cast<double>(options_.total_steps()))).exp() * -1.0 + 1.0) *
        options_.decay();
  }
  if (options_.warmup()) {
    at::Tensor w = 1.0 - (t / options_.warmup_gamma() + 1.0).pow(-options_.warmup_power());
    d = at::minimum(d, w);
  }
  // In place: decay_ stays the tensor made at construction, outside any CUDA
  // graph's pool (NOTE [persistent step results] in python/fusetrain/training/step.py).
  decay_.copy_(d);
  return decay_;
}

std::vector<std::pair<at::Tensor, at::Tensor>> ModelEMA::float_pairs(bool params, bool buffers) const {
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  if (params) {
    auto src = model_->parameters();
    auto dst = ema_->parameters();
    TORCH_CHECK(src.size() == dst.size(), "fusetrain::ModelEMA: the model's parameter count changed");
    for (size_t i = 0; i < src.size(); ++i) out.emplace_back(dst[i], src[i]);
  }
  if (buffers) {
    auto src = model_->buffers();
    auto dst = ema_->buffers();
    TORCH_CHECK(src.size() == dst.size(), "fusetrain::ModelEMA: the model's buffer count changed");
    for (size_t i = 0; i < src.size(); ++i) out.emplace_back(dst[i], src[i]);
  }
  return out;
}

namespace {
void apply_ema(const std::vector<std::pair<at::Tensor, at::Tensor>>& pairs, const at::Tensor& decay,
               const std::optional<at::Tensor>& found_inf) {
  // Float tensors through ema_update_ (grouped by dtype and device); the rest copied.
  std::map<std::string, std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>> groups;
  for (const auto& [e, s] : pairs) {
    if (e.is_floating_point() && e.scalar_type() != at::kDouble) {
      auto key = e.device().str() + "/" + std::string(c10::toString(e.scalar_type()));
      groups[key].first.push_back(e);
      groups[key].second.push_back(s.detach());
    } else if (found_inf.has_value()) {
      // keep the skip on the device: copy only where found_inf == 0
      e.copy_(at::where(found_inf->to(e.device()) != 0, e, s.detach()));
    } else {
      e.copy_(s.detach());
    }
  }
  for (auto& [key, lists] : groups) {
    const auto dev = lists.first.front().device();
    std::optional<at::Tensor> f;
    if (found_inf) f = found_inf->to(dev);
    ema_update_(lists.first, lists.second, decay.to(dev), f);
  }
}
}  // namespace

void ModelEMA::update(const std::optional<at::Tensor>& found_inf) {
  torch::NoGradGuard no_grad;
  prepare_decay();
  apply_ema(float_pairs(true, options_.include_buffers()), decay_, found_inf);
  if (found_inf)
    step_.add_(1.0 - found_inf->to(step_.device()));
  else
    step_.add_(1.0);
}

void ModelEMA::attach(FusedOptimizer& optimizer) {
  TORCH_CHECK(optimizer.attached_ema() == nullptr || optimizer.attached_ema() == this,
              "fusetrain::ModelEMA: the optimizer already has another EMA attached");
  detach();
  optimizer.attach_ema(this);
  optimizer_ = &optimizer;
}

void ModelEMA::detach() {
  if (optimizer_ != nullptr && optimizer_->attached_ema() == this) optimizer_->attach_ema(nullptr);
  optimizer_ = nullptr;
}

at::Tensor ModelEMA::ema_for(const at::Tensor& param) const {
  // One map per EMA (module parameters keep their tensors for the model's life;
  // load/copy_ write into them), so the per-step lookup is O(1).
  if (ema_by_param_.empty()) {
    auto src = model_->parameters();
    auto dst = ema_->parameters();
    for (size_t i = 0; i < src.size() && i < dst.size(); ++i) ema_by_param_[src[i].unsafeGetTensorImpl()] = dst[i];
  }
  auto it = ema_by_param_.find(param.unsafeGetTensorImpl());
  return it == ema_by_param_.end() ? at::Tensor() : it->second;
}

void ModelEMA::finish_step(const std::optional<at::Tensor>& found_inf, const std::vector<at::Tensor>& covered) {
  torch::NoGradGuard no_grad;
  std::unordered_set<const void*> done;
  for (const auto& p : covered) done.insert(p.unsafeGetTensorImpl());
  std::vector<std::pair<at::Tensor, at::Tensor>> rest;
  for (auto& pr : float_pairs(true, options_.include_buffers()))
    if (!done.count(pr.second.unsafeGetTensorImpl())) rest.push_back(pr);
  apply_ema(rest, decay_, found_inf);
  if (found_inf)
    step_.add_(1.0 - found_inf->to(step_.device()));
  else
    step_.add_(1.0);
}

void ModelEMA::save(torch::serialize::OutputArchive& archive) const {
  torch::serialize::OutputArchive m(archive.compilation_unit());
  ema_->save(m);
  archive.write("module", m);
  archive.write("step", step_.cpu());
  archive.write("total_steps", c10::IValue(options_.total_steps()));
}

void ModelEMA::load(torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive m;
  archive.read("module", m);
  ema_->load(m);
  at::Tensor s;
  archive.read("step", s);
  c10::IValue v;
  archive.read("total_steps", v);
  options_.total_steps(v.toInt());
  step_.copy_(s);
}

// ---- fused tail ----------------------------------------------------------------
void fused_step(FusedOptimizer& optimizer, LossScaler* scaler, ModelEMA* ema) {
  const bool rides = ema != nullptr && ema->attached_to(optimizer);
  if (scaler != nullptr)
    scaler->step(optimizer);
  else
    optimizer.step();
  if (ema != nullptr && !rides) {
    const auto& f = optimizer.last_found_inf();
    ema->update(f.defined() ? std::optional<at::Tensor>(f) : std::nullopt);
  }
  if (scaler != nullptr) scaler->update();
}

}  // namespace fusetrain
