// fusetrain::LossScaler, fusetrain::ModelEMA and fusetrain::fused_step.
#include <fusetrain/amp.h>

#include <ATen/ops/full.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/utils.h>

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
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
    scale_ = at::full({}, options_.init_scale(), f32);
    growth_tracker_ = at::zeros({}, at::TensorOptions().dtype(at::kInt).device(device));
    last_step_skipped_ = at::zeros({}, f32);
    skipped_steps_ = at::zeros({}, f32);
  } else if (scale_.device() != device) {
    scale_ = scale_.to(device);
    growth_tracker_ = growth_tracker_.to(device);
    last_step_skipped_ = last_step_skipped_.to(device);
    skipped_steps_ = skipped_steps_.to(device);
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
  optimizer.step_with(at::reciprocal(scale_), std::nullopt);
  at::Tensor f = optimizer.last_found_inf();
  if (!f.defined()) return;  // nothing was stepped: no flag
  f = f.to(scale_.device());
  // f is the optimizer's persistent flag, read by update() before the next step writes it.
  pending_found_inf_ = pending_found_inf_.defined() ? at::maximum(pending_found_inf_, f) : f;
}

void LossScaler::reset_pending() { pending_found_inf_ = at::Tensor(); }

void LossScaler::update() {
  if (!options_.enabled() || !scale_.defined()) return;
  at::Tensor f = pending_found_inf_.defined() ? pending_found_inf_ : at::zeros({}, scale_.options());
  update_scale_(scale_, growth_tracker_, f, options_.growth_factor(), options_.backoff_factor(),
                options_.growth_interval(), last_step_skipped_, skipped_steps_);
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
  if (!scale_.defined()) lazy_init(dev);
  scale_.copy_(s);
  growth_tracker_.copy_(g);
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
  if (options_.remainder()) {
    // NOTE [ema remainder]: zero, the bfloat16 value is the EMA to start with.
    auto add = [&](const torch::OrderedDict<std::string, at::Tensor>& named) {
      for (const auto& kv : named) {
        if (kv.value().scalar_type() != at::kBFloat16) continue;
        at::Tensor r = at::zeros_like(kv.value(), kv.value().options().dtype(at::kShort));
        rem_by_ema_[kv.value().unsafeGetTensorImpl()] = r;
        rem_by_name_.emplace_back(kv.key(), r);
      }
    };
    add(ema_->named_parameters());
    if (options_.include_buffers()) add(ema_->named_buffers());
  }
}

ModelEMA::~ModelEMA() { detach(); }

void ModelEMA::lazy_init() {
  at::Device dev = at::kCPU;
  auto ps = ema_->parameters();
  if (!ps.empty()) dev = ps.front().device();
  if (!step_.defined()) {
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
    step_ = at::zeros({}, f32);
    decay_ = at::full({}, options_.decay(), f32);
    total_ = at::full({}, static_cast<double>(std::max<int64_t>(options_.total_steps(), 1)), f32);
  }
}

void ModelEMA::set_total_steps(int64_t total_steps) {
  TORCH_CHECK(total_steps >= 0, "fusetrain::ModelEMA: total_steps must be >= 0, got ", total_steps);
  options_.total_steps(total_steps);
  if (total_steps > 0) total_.fill_(static_cast<double>(total_steps));
}

const at::Tensor& ModelEMA::prepare_decay() {
  torch::NoGradGuard no_grad;
  std::optional<at::Tensor> total;
  if (options_.total_steps() > 0) total = total_;
  ema_decay_(decay_, step_, total, options_.decay_type(), options_.decay(), options_.beta(), options_.warmup(),
             options_.warmup_gamma(), options_.warmup_power());
  return decay_;
}

// Source/EMA tensor pairs: floating-point ones averaged, the rest copied.
// `params` false leaves the parameters out (they ride in the optimizer's pass).
ModelEMA::Pairs ModelEMA::pairs(bool params) const {
  Pairs out;
  auto add = [&](const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src, bool average) {
    for (size_t i = 0; i < src.size(); ++i) {
      const bool avg = average && dst[i].is_floating_point();
      (avg ? out.avg_dst : out.copy_dst).push_back(dst[i]);
      (avg ? out.avg_src : out.copy_src).push_back(src[i].detach());
      const at::Tensor r = avg ? remainder_for(dst[i]) : at::Tensor();
      if (r.defined()) out.avg_rem.push_back(r);
    }
  };
  auto src_p = model_->parameters();
  auto dst_p = ema_->parameters();
  TORCH_CHECK(src_p.size() == dst_p.size(), "fusetrain::ModelEMA: the model's parameter count changed");
  auto src_b = model_->buffers();
  auto dst_b = ema_->buffers();
  TORCH_CHECK(src_b.size() == dst_b.size(), "fusetrain::ModelEMA: the model's buffer count changed");
  if (params) {
    add(dst_p, src_p, true);
  } else {
    // Non-float params are copied in either case.
    std::vector<at::Tensor> d, s;
    for (size_t i = 0; i < src_p.size(); ++i) {
      if (dst_p[i].is_floating_point()) continue;
      d.push_back(dst_p[i]);
      s.push_back(src_p[i]);
    }
    add(d, s, false);
  }
  add(dst_b, src_b, options_.include_buffers());
  return out;
}

void ModelEMA::update(const std::optional<at::Tensor>& found_inf) {
  torch::NoGradGuard no_grad;
  prepare_decay();
  const auto p = pairs(true);
  ema_step_(p.avg_dst, p.avg_src, p.copy_dst, p.copy_src, decay_, step_, found_inf, p.avg_rem);
}

at::Tensor ModelEMA::remainder_for(const at::Tensor& ema_tensor) const {
  auto it = rem_by_ema_.find(ema_tensor.unsafeGetTensorImpl());
  return it == rem_by_ema_.end() ? at::Tensor() : it->second;
}

void ModelEMA::attach(FusedOptimizer& optimizer) {
  TORCH_CHECK(optimizer.attached_ema() == nullptr || optimizer.attached_ema() == this,
              "fusetrain::ModelEMA: the optimizer already has another EMA attached");
  detach();
  optimizer.attach_ema(this);
  optimizer_ = &optimizer;
  rides_ = rem_by_ema_.empty() || optimizer.carries_ema_remainders();
}

void ModelEMA::detach() {
  if (optimizer_ != nullptr && optimizer_->attached_ema() == this) optimizer_->attach_ema(nullptr);
  optimizer_ = nullptr;
  rides_ = false;
}

at::Tensor ModelEMA::ema_for(const at::Tensor& param) const {
  if (!rides_) return at::Tensor();
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

void ModelEMA::finish_step(const at::Tensor& found_inf) {
  // The optimizer's pass updated the EMA of the params it stepped (a param
  // without a gradient keeps its EMA); buffers and non-float params follow here.
  torch::NoGradGuard no_grad;
  const auto p = pairs(!rides_);
  ema_step_(p.avg_dst, p.avg_src, p.copy_dst, p.copy_src, decay_, step_, found_inf, p.avg_rem);
}

void ModelEMA::save(torch::serialize::OutputArchive& archive) const {
  torch::serialize::OutputArchive m(archive.compilation_unit());
  ema_->save(m);
  archive.write("module", m);
  archive.write("step", step_.cpu());
  archive.write("total_steps", c10::IValue(options_.total_steps()));
  torch::serialize::OutputArchive rems(archive.compilation_unit());
  for (const auto& [name, r] : rem_by_name_) rems.write(name, r.cpu());
  archive.write("remainders", rems);
}

void ModelEMA::load(torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive m;
  archive.read("module", m);
  ema_->load(m);
  at::Tensor s;
  archive.read("step", s);
  c10::IValue v;
  archive.read("total_steps", v);
  set_total_steps(v.toInt());
  step_.copy_(s);
  // NOTE [ema remainder]: a remainder the archive lacks is 0 (the bfloat16 value is the EMA).
  torch::serialize::InputArchive rems;
  const bool has = archive.try_read("remainders", rems);
  torch::NoGradGuard no_grad;
  for (const auto& [name, r] : rem_by_name_) {
    at::Tensor saved;
    if (has && rems.try_read(name, saved)) {
      r.copy_(saved);
    } else {
      r.zero_();
    }
  }
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
