// fusetrain::FusedOptimizer, the base of the C++ optimizers (see fusetrain/optim.h):
// state containers, lr tensors and the step as one fusetrain::fused_step_ call.
// The concrete optimizers are in optimizers.cpp.
#include <fusetrain/amp.h>
#include <fusetrain/optim.h>

#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/irange.h>
#include <torch/serialize/archive.h>
#include <torch/utils.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <map>
#include <string>
#include <tuple>

#include "../ops/optim_kind.h"
#include "capture.h"
#include "optim_internal.h"

namespace fusetrain {
namespace {

// NOTE [state before capture] (python/fusetrain/optim/_param_state.py): what a step
// creates or fills lazily would be recorded in a CUDA graph and redone on
// every replay (step counters and moments reset, the lr pinned).
[[noreturn]] void fail_capturing(const at::Device& dev, const char* what) {
  TORCH_CHECK(false, "fusetrain: ", what, " while a CUDA graph is being captured on ", dev,
              ": the graph would redo it on every replay. Call prepare_capture() on the optimizer before capturing "
              "(fusetrain::TrainStep does)");
}
void check_not_capturing(const at::Device& dev, const char* what) {
  if (detail::stream_is_capturing(dev)) fail_capturing(dev, what);
}

// FusedParamState's states, in the order of its members.
constexpr const char* kStateNames[] = {"exp_avg",    "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer",
                                       "square_avg", "grad_avg",   "acc_delta",      "mu_product"};

}  // namespace

using api_detail::keeps_master;
using api_detail::state_zeros_like;

// ---- param state ---------------------------------------------------------------
void FusedParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(square_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(grad_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(acc_delta);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(mu_product);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master);
  for (const auto& [name, t] : scales_)
    if (t.defined()) archive.write(name + "_scales", t);
}
void FusedParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, max_exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, momentum_buffer);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, square_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, grad_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, acc_delta);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, mu_product);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, master);
  scales_.clear();
  for (const char* name : kStateNames) {
    torch::Tensor t;
    if (archive.try_read(std::string(name) + "_scales", t)) scales_[name] = t;
  }
}

torch::Tensor* FusedParamState::find(const char* name) {
  torch::Tensor* const slots[] = {&exp_avg_,    &exp_avg_sq_, &max_exp_avg_sq_, &momentum_buffer_,
                                  &square_avg_, &grad_avg_,   &acc_delta_,      &mu_product_};
  static_assert(std::size(slots) == std::size(kStateNames), "FusedParamState: one name per state");
  for (size_t i = 0; i < std::size(kStateNames); ++i)
    if (std::strcmp(kStateNames[i], name) == 0) return slots[i];
  return nullptr;
}

// ---- FusedOptimizer ------------------------------------------------------------
void FusedOptimizer::check_kind() {
  const auto& spec = detail::find_kind(kind());
  KindValues values;
  kind_fields(defaults(), values);
  std::vector<bool> seen(spec.fields.size(), false);
  field_slot_.clear();
  for (const auto& [name, _] : values) {
    const int j = spec.field_index(name);
    TORCH_CHECK(j >= 0, "fusetrain: the '", kind(), "' optimizer gives a record field '", name,
                "' that its entry in the kind table lacks (csrc/ops/fused_", kind(), ".cpp)");
    TORCH_CHECK(!seen[j], "fusetrain: the '", kind(), "' optimizer gives the record field '", name, "' twice");
    seen[j] = true;
    field_slot_.push_back(j);
  }
  for (size_t j = 0; j < seen.size(); ++j)
    TORCH_CHECK(seen[j], "fusetrain: the '", kind(), "' optimizer gives no value for the record field '",
                spec.fields[j].name, "' of its kind table entry");
  for (const auto& s : spec.states)
    TORCH_CHECK(FusedParamState().find(s.name) != nullptr, "fusetrain: FusedParamState has no state '", s.name,
                "' of the kind '", kind(), "'");
  spec_ = &spec;
  check_lean(dynamic_cast<const FusedCommonOptions&>(defaults()));
}

void FusedOptimizer::check_lean(const FusedCommonOptions& o) const {
  const auto form = static_cast<int64_t>(o.master_form_);
  TORCH_CHECK_VALUE(form >= 1 && form <= 3, "fusetrain: master_form must be MasterForm::Float32, Remainder or "
                    "Stochastic, got ", form);
  TORCH_CHECK_VALUE(o.state_dtype_ == at::kFloat || o.state_dtype_ == at::kBFloat16 || o.state_dtype_ == at::kChar,
                    "fusetrain: state_dtype must be at::kFloat, at::kBFloat16 or at::kChar (int8), got ",
                    o.state_dtype_);
  TORCH_CHECK_VALUE(o.state_block_size_ == 64 || o.state_block_size_ == 128 || o.state_block_size_ == 256,
                    "fusetrain: state_block_size must be 64, 128 or 256 (NOTE [8-bit state]), got ",
                    o.state_block_size_);
  TORCH_CHECK_VALUE(spec_->lean || (o.master_form_ == MasterForm::Float32 && o.state_dtype_ == at::kFloat),
                    "fusetrain: the '", kind(), "' optimizer keeps float32 state and masters; master_form Remainder "
                    "or Stochastic and state_dtype at::kBFloat16 or at::kChar are for the element-wise optimizers");
}

std::vector<double> FusedOptimizer::kind_record(const torch::optim::OptimizerOptions& o) const {
  KindValues values;
  kind_fields(o, values);
  TORCH_INTERNAL_ASSERT(spec_ != nullptr && values.size() == field_slot_.size(), "fusetrain: the '", kind(),
                        "' optimizer's constructor did not call check_kind()");
  std::vector<double> fields(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    TORCH_INTERNAL_ASSERT(std::strcmp(values[i].first, spec_->fields[field_slot_[i]].name) == 0);
    fields[field_slot_[i]] = values[i].second;
  }
  return fields;
}

void FusedOptimizer::init_state(FusedParamState& s, const at::Tensor& p, const double* fields,
                                const FusedCommonOptions& options) const {
  const at::ScalarType dtype = api_detail::state_dtype_of(p, options.state_dtype_);
  for (int k = 0; k < 3; ++k) {
    const detail::KindState* st = spec_->slot_state(fields, k);
    if (st == nullptr) continue;
    at::Tensor* t = s.find(st->name);
    if (t->defined()) continue;
    const double v = spec_->initial_value(*st, fields);
    if (st->scalar) {
      *t = at::full({}, v, p.options().dtype(at::kFloat));
    } else if (dtype == at::kChar) {
      // NOTE [8-bit state]: every block holds v, so one block's code and scale repeated.
      const float x = static_cast<float>(v), mag = std::fabs(x);
      const bool finite = std::isfinite(x), negative = x < 0.f;
      const int64_t block = options.state_block_size_;
      const detail::Q8Block q = detail::q8_block(finite ? mag : 0.f, negative, finite);
      const auto code = static_cast<int8_t>(detail::q8_store(x, q, 0x8000u));  // rounded to nearest
      *t = at::full_like(p, code, p.options().dtype(at::kChar), at::MemoryFormat::Preserve);
      s.scales(st->name) = at::full({(p.numel() + block - 1) / block}, q.scale, p.options().dtype(at::kFloat));
    } else {
      *t = state_zeros_like(p, dtype);
      if (v != 0.0) t->fill_(v);
    }
  }
}

torch::Tensor FusedOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  step_with(std::nullopt, std::nullopt);
  return loss;
}

void FusedOptimizer::step_with(const std::optional<at::Tensor>& inv_scale,
                               const std::optional<at::Tensor>& found_inf) {
  torch::NoGradGuard no_grad;
  FusedLists l;
  std::vector<int64_t> sizes;
  std::vector<at::Tensor> lrs, values;
  std::vector<double> hyper;
  bool capturing = false;
  for (const auto gi : c10::irange(param_groups_.size())) {
    auto& group = param_groups_[gi];
    const auto& opts = group.options();
    std::vector<at::Tensor> params;
    for (const auto& p : group.params()) {
      const auto& g = p.grad();
      if (!g.defined()) continue;
      TORCH_CHECK(!g.is_sparse(), "fusetrain: param of group ", gi, " has a sparse gradient; not supported");
      TORCH_CHECK(!g.is_complex(), "fusetrain: param of group ", gi, " has a complex gradient; not supported");
      params.push_back(p);
    }
    if (params.empty()) continue;
    if (sizes.empty()) capturing = detail::stream_is_capturing(params.front().device());
    const auto& common = dynamic_cast<const FusedCommonOptions&>(opts);
    check_lean(common);
    const std::vector<double> fields = kind_record(opts);
    const detail::KindState* slots[3];
    for (int k = 0; k < 3; ++k) slots[k] = spec_->slot_state(fields.data(), k);
    std::vector<at::Tensor>* lists[3] = {&l.state1, &l.state2, &l.state3};
    std::vector<at::Tensor> group_scales[3];  // NOTE [group records]: group by group, slot by slot
    size_t with_ema = 0;
    for (const auto& p : params) {
      auto& st = ensure_state(p, opts, fields, capturing);
      l.params.push_back(p);
      l.grads.push_back(p.grad());
      l.steps.push_back(st.step());
      if (keeps_master(common, p)) l.masters.push_back(st.master());
      for (int k = 0; k < 3; ++k) {
        if (slots[k] == nullptr) continue;
        const at::Tensor& t = *st.find(slots[k]->name);
        lists[k]->push_back(t);
        if (t.scalar_type() == at::kChar) group_scales[k].push_back(st.scales(slots[k]->name));
      }
      if (ema_ == nullptr) continue;
      at::Tensor e = ema_->ema_for(p);
      if (!e.defined()) continue;
      l.emas.push_back(e);
      const at::Tensor r = ema_->remainder_for(e);
      if (r.defined()) l.ema_rems.push_back(r);
      ++with_ema;
    }
    TORCH_CHECK(with_ema == 0 || with_ema == params.size(), "fusetrain: the attached ModelEMA covers ", with_ema,
                " of the ", params.size(), " params with a gradient in group ", gi,
                "; the EMA model must hold every param of a group, or none");
    for (const auto& sc : group_scales) l.scales.insert(l.scales.end(), sc.begin(), sc.end());
    sizes.push_back(static_cast<int64_t>(params.size()));
    const DeviceScalars& scalars = device_scalars(gi, params.front().device(), opts.get_lr(), fields);
    lrs.push_back(scalars.lr);
    if (scalars.values.defined()) values.push_back(scalars.values);
    const double master_code = common.master_weights_ ? static_cast<double>(common.master_form_) : 0.0;
    hyper.insert(hyper.end(), {common.max_grad_norm_, master_code, with_ema > 0 ? 1.0 : 0.0,
                               common.maximize_ ? 1.0 : 0.0});
    hyper.insert(hyper.end(), fields.begin(), fields.end());
  }
  if (l.params.empty()) {
    // Nothing to step: no flag from this step (a stale one would make a
    // LossScaler back off or an EMA advance for a step that did nothing).
    last_grad_norm_ = at::Tensor();
    last_found_inf_ = found_inf ? *found_inf : at::Tensor();
    return;
  }
  ensure_results(l.params.front().device(), capturing);
  std::optional<at::Tensor> decay;
  if (ema_ != nullptr) decay = ema_->prepare_decay();
  fused_step_(kind(), l.params, l.grads, l.steps, l.state1, l.state2, l.state3, l.masters, l.emas, sizes, lrs, hyper,
              inv_scale, found_inf, decay, last_grad_norm_, last_found_inf_, std::nullopt,
              values.empty() ? std::nullopt : std::optional<at::TensorList>(values),
              l.scales.empty() ? std::nullopt : std::optional<at::TensorList>(l.scales),
              l.ema_rems.empty() ? std::nullopt : std::optional<at::TensorList>(l.ema_rems),
              stalled_.defined() ? std::optional<at::Tensor>(stalled_) : std::nullopt);
  if (ema_ != nullptr) ema_->finish_step(last_found_inf_);
}

bool FusedOptimizer::carries_ema_remainders() const { return spec_->lean; }

at::Tensor FusedOptimizer::track_stalled_updates(bool enabled) {
  if (!enabled) {
    stalled_ = at::Tensor();
    return stalled_;
  }
  TORCH_CHECK_VALUE(spec_->lean, "fusetrain: the '", kind(), "' optimizer does not count stalled updates (the "
                    "element-wise optimizers do)");
  std::optional<at::Device> dev;
  for (const auto& g : param_groups_)
    for (const auto& p : g.params()) {
      TORCH_CHECK_VALUE(!dev || *dev == p.device(), "fusetrain: track_stalled_updates needs the params on one "
                        "device, got ", *dev, " and ", p.device());
      dev = p.device();
    }
  if (dev && (!stalled_.defined() || stalled_.device() != *dev)) {
    check_not_capturing(*dev, "the stalled-update counter would be created");
    stalled_ = at::zeros({}, at::TensorOptions().dtype(at::kLong).device(*dev));
  }
  return stalled_;
}

void FusedOptimizer::ensure_results(const at::Device& dev, bool capturing) {
  // NOTE [persistent step results] (python/fusetrain/training/step.py): the
  // host reads these after a replay, so they are made once, outside any graph.
  if (last_grad_norm_.defined() && last_found_inf_.defined() && last_grad_norm_.device() == dev &&
      last_found_inf_.device() == dev)
    return;
  check_not_capturing(dev, "the step's result tensors would be created");
  last_grad_norm_ = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(dev));
  last_found_inf_ = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(dev));
}

const FusedOptimizer::DeviceScalars& FusedOptimizer::device_scalars(size_t group, const at::Device& dev, double lr,
                                                                     const std::vector<double>& fields) {
  std::vector<double> values;
  for (int i : spec_->value_positions) values.push_back(fields[i]);
  auto& e = device_cache_[{group, dev.str()}];
  const bool made = e.lr.defined();
  if (!made || e.lr_value != lr || e.values_now != values)
    check_not_capturing(dev, "a group's lr or values tensor would be filled");
  if (!made) {
    e.lr = at::full({}, lr, at::TensorOptions().dtype(at::kFloat).device(dev));
    if (!values.empty()) e.values = at::tensor(values, at::TensorOptions().dtype(at::kDouble)).to(dev);
  } else {
    if (e.lr_value != lr) e.lr.fill_(lr);
    for (size_t k = 0; k < values.size(); ++k)
      if (values[k] != e.values_now[k]) e.values.select(0, static_cast<int64_t>(k)).fill_(values[k]);
  }
  e.lr_value = lr;
  e.values_now = std::move(values);
  return e;
}

FusedParamState& FusedOptimizer::ensure_state(const at::Tensor& p, const torch::optim::OptimizerOptions& opts,
                                              const std::vector<double>& fields, bool capturing) {
  auto key_impl = p.unsafeGetTensorImpl();
  auto found = state_.find(key_impl);
  auto* s = found == state_.end() ? nullptr : static_cast<FusedParamState*>(found->second.get());
  const auto& common = dynamic_cast<const FusedCommonOptions&>(opts);
  const bool has_master = keeps_master(common, p);
  if (capturing) {
    // Nothing may be created or moved now: check that the state is complete.
    bool ready = s != nullptr && s->step().defined() && s->step().scalar_type() == at::kFloat &&
                 (!has_master || s->master().defined());
    if (ready) {
      FusedParamState probe = *s;
      init_state(probe, p, fields.data(), common);  // defines what is missing; nothing is missing when ready
      for (const auto* t : {&probe.step(), &probe.exp_avg(), &probe.exp_avg_sq(), &probe.max_exp_avg_sq(),
                            &probe.momentum_buffer(), &probe.square_avg(), &probe.grad_avg(), &probe.acc_delta(),
                            &probe.mu_product(), &probe.master()})
        ready = ready && (!t->defined() || t->device() == p.device());
      ready = ready && probe.exp_avg().is_same(s->exp_avg()) && probe.exp_avg_sq().is_same(s->exp_avg_sq()) &&
              probe.max_exp_avg_sq().is_same(s->max_exp_avg_sq()) &&
              probe.momentum_buffer().is_same(s->momentum_buffer()) && probe.square_avg().is_same(s->square_avg()) &&
              probe.grad_avg().is_same(s->grad_avg()) && probe.acc_delta().is_same(s->acc_delta()) &&
              probe.mu_product().is_same(s->mu_product());
      for (const auto& [name, sc] : probe.all_scales())
        ready = ready && sc.is_same(s->scales(name)) && sc.device() == p.device();
    }
    if (!ready) fail_capturing(p.device(), "optimizer state would be created (a param's first step)");
    return *s;
  }
  if (s == nullptr) {
    auto fresh = std::make_unique<FusedParamState>();
    s = fresh.get();
    state_.emplace(key_impl, std::move(fresh));
  }
  // State loaded from an archive lives on the CPU: move it next to the param.
  auto to_dev = [&](const at::Tensor& t) { return t.defined() && t.device() != p.device() ? t.to(p.device()) : t; };
  if (!s->step().defined()) s->step(at::zeros({}, p.options().dtype(at::kFloat)));
  s->step(to_dev(s->step()).to(at::kFloat));
  s->exp_avg(to_dev(s->exp_avg()));
  s->exp_avg_sq(to_dev(s->exp_avg_sq()));
  s->max_exp_avg_sq(to_dev(s->max_exp_avg_sq()));
  s->momentum_buffer(to_dev(s->momentum_buffer()));
  s->square_avg(to_dev(s->square_avg()));
  s->grad_avg(to_dev(s->grad_avg()));
  s->acc_delta(to_dev(s->acc_delta()));
  if (s->mu_product().defined()) s->mu_product(to_dev(s->mu_product()).to(at::kFloat));
  s->master(to_dev(s->master()));
  for (const auto& [name, sc] : s->all_scales()) s->scales(name) = to_dev(sc);
  init_state(*s, p, fields.data(), common);  // fills whatever is still missing
  if (has_master && !s->master().defined()) {
    // NOTE [lean state]: a remainder starts at 0 (the param is the value).
    s->master(common.master_form_ == MasterForm::Remainder && p.scalar_type() == at::kBFloat16
                  ? at::zeros_like(p, p.options().dtype(at::kShort), at::MemoryFormat::Preserve)
                  : p.detach().to(at::kFloat).clone());
  }
  return *s;
}

void FusedOptimizer::prepare_capture() {
  torch::NoGradGuard no_grad;
  for (const auto gi : c10::irange(param_groups_.size())) {
    auto& group = param_groups_[gi];
    const std::vector<double> fields = kind_record(group.options());
    for (const auto& p : group.params()) {
      if (!p.requires_grad()) continue;
      ensure_state(p, group.options(), fields, /*capturing=*/false);
      device_scalars(gi, p.device(), group.options().get_lr(), fields);
      if (!last_grad_norm_.defined()) ensure_results(p.device(), /*capturing=*/false);
    }
  }
}

void FusedOptimizer::refresh_device_values() {
  for (auto& [key, entry] : device_cache_) {
    if (key.first >= param_groups_.size() || !entry.lr.defined()) continue;
    const auto& opts = param_groups_[key.first].options();
    const std::vector<double> fields = kind_record(opts);
    spec_->check(std::string(kind()) + " (group " + std::to_string(key.first) + ")",
                 detail::KindRecord{spec_, fields.data()});
    device_scalars(key.first, entry.lr.device(), opts.get_lr(), fields);
  }
}

}  // namespace fusetrain
