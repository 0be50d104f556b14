// fusetrain::FusedOptimizer, the base of the C++ optimizers (see fusetrain/optim.h):
// state containers, lr tensors and the step as one fusetrain::fused_step_ call.
// The concrete optimizers are the optimizer table's (fusetrain/optim_table.h,
// generated): everything here reads the kind table.
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

#include "../ops/kind_registry.h"
#include "../ops/capture.h"

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

// Params below this size keep float32 state in an int8 group (NOTE [8-bit
// state]; python/fusetrain/optim/_int8_state.py's MIN_NUMEL).
constexpr int64_t kInt8MinNumel = 4096;

// NOTE [float64 params] in csrc/ops/fused_update.cpp: float64 state for float64
// params, float32 for the others unless the group keeps bfloat16 or int8
// state (NOTE [lean state], NOTE [8-bit state] in csrc/common/lean_state.h).
at::ScalarType state_dtype_of(const at::Tensor& p, at::ScalarType group_dtype) {
  if (p.scalar_type() == at::kDouble) return at::kDouble;
  if (group_dtype == at::kChar) return p.numel() >= kInt8MinNumel ? at::kChar : at::kFloat;
  return group_dtype;
}
// Whether a param of a group with these options keeps a `master` tensor.
bool keeps_master(const FusedCommonOptions& o, const at::Tensor& p) {
  const bool low = p.scalar_type() == at::kHalf || p.scalar_type() == at::kBFloat16;
  return o.master_weights_ && low && o.master_form_ != MasterForm::Stochastic;
}

}  // namespace

// ---- FusedOptimizer ------------------------------------------------------------
FusedOptimizer::~FusedOptimizer() {
  if (ema_ != nullptr) ema_->detach();
}

void FusedOptimizer::check_kind(const char* name, bool takes_maximize) {
  const auto& spec = detail::find_kind(kind());
  KindValues values;
  try {
    kind_fields(defaults(), values);
  } catch (const c10::ValueError& e) {  // an option the record cannot take (a choice's value)
    TORCH_CHECK_VALUE(false, "fusetrain::", name, ": ", e.what_without_backtrace());
  }
  std::vector<bool> seen(spec.fields.size(), false);
  field_slot_.clear();
  for (const auto& [field, _] : values) {
    const int j = spec.field_index(field);
    TORCH_CHECK(j >= 0, "fusetrain: the '", kind(), "' optimizer gives a record field '", field,
                "' that its entry in the kind table lacks (python/fusetrain/optim/_table.py)");
    TORCH_CHECK(!seen[j], "fusetrain: the '", kind(), "' optimizer gives the record field '", field, "' twice");
    seen[j] = true;
    field_slot_.push_back(j);
  }
  for (size_t j = 0; j < seen.size(); ++j)
    TORCH_CHECK(seen[j], "fusetrain: the '", kind(), "' optimizer gives no value for the record field '",
                spec.fields[j].name, "' of its kind table entry");
  spec_ = &spec;
  // Each group's options (the defaults' when there is none), as fused_step_ will check them, and before it.
  const size_t n = param_groups_.size();
  for (size_t g = 0; g < std::max<size_t>(n, 1); ++g) {
    const auto& o = n > 0 ? param_groups_[g].options() : defaults();
    const auto& common = dynamic_cast<const FusedCommonOptions&>(o);
    const std::string where = std::string("fusetrain::") + name + (n > 1 ? " (group " + std::to_string(g) + ")" : "");
    TORCH_CHECK_VALUE(common.lr_ >= 0.0, where, ": lr must be >= 0, got ", common.lr_);
    TORCH_CHECK_VALUE(common.max_grad_norm_ >= 0.0, where, ": max_grad_norm must be >= 0 (0: no clipping), got ",
                      common.max_grad_norm_);
    TORCH_CHECK_VALUE(takes_maximize || !common.maximize_, where, ": maximize is not supported");
    check_lean(common);
    std::vector<double> record;
    try {
      record = kind_record(o);
    } catch (const c10::ValueError& e) {
      TORCH_CHECK_VALUE(false, where, ": ", e.what_without_backtrace());
    }
    spec.check(where, record.data());
    if (n > 0) spec.check_params(where, record.data(), param_groups_[g].params());
  }
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
  const at::ScalarType dtype = state_dtype_of(p, options.state_dtype_);
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
      *t = at::zeros_like(p, p.options().dtype(dtype), at::MemoryFormat::Preserve);
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
      for (const auto* t : {&probe.step(), &probe.master()})
        ready = ready && (!t->defined() || t->device() == p.device());
      for (const char* name : FusedParamState::kStateNames) {
        const at::Tensor& t = *probe.find(name);
        ready = ready && (!t.defined() || t.device() == p.device()) && t.is_same(*s->find(name));
      }
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
  for (size_t i = 0; i < std::size(FusedParamState::kStateNames); ++i) {
    at::Tensor& t = *s->find(FusedParamState::kStateNames[i]);
    t = to_dev(t);
    if (t.defined() && FusedParamState::kScalarStates[i]) t = t.to(at::kFloat);  // 0-d float32, like step
  }
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
    spec_->check(std::string(kind()) + " (group " + std::to_string(key.first) + ")", fields.data());
    device_scalars(key.first, entry.lr.device(), opts.get_lr(), fields);
  }
}

}  // namespace fusetrain
