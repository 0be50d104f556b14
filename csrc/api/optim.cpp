// fusetrain's torch::optim::Optimizer subclasses (see fusetrain/optim.h).
#include <fusetrain/amp.h>
#include <fusetrain/optim.h>

#include <ATen/ops/full.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/irange.h>
#include <torch/serialize/archive.h>
#include <torch/utils.h>

#include <map>
#include <tuple>

#include "capture.h"

namespace fusetrain {
namespace {

// NOTE [state before capture] (python/fusetrain/optim/_base.py): what a step
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

void check_range(const char* opt, const char* name, double v, double lo, double hi, bool hi_open) {
  TORCH_CHECK(v >= lo && (hi_open ? v < hi : v <= hi), opt, ": invalid ", name, " value: ", v, " (must be in [", lo,
              ", ", hi, hi_open ? "))" : "])");
}
void check_nonneg(const char* opt, const char* name, double v) {
  TORCH_CHECK(v >= 0.0, opt, ": invalid ", name, " value: ", v, " (must be >= 0)");
}
void check_betas(const char* opt, const std::tuple<double, double>& b) {
  TORCH_CHECK(std::get<0>(b) >= 0.0 && std::get<0>(b) < 1.0, opt, ": invalid beta parameter at index 0: ",
              std::get<0>(b), " (must be in [0, 1))");
  TORCH_CHECK(std::get<1>(b) >= 0.0 && std::get<1>(b) < 1.0, opt, ": invalid beta parameter at index 1: ",
              std::get<1>(b), " (must be in [0, 1))");
}

at::Tensor f32_zeros_like(const at::Tensor& p) {
  return at::zeros_like(p, p.options().dtype(at::kFloat), at::MemoryFormat::Preserve);
}

}  // namespace

// ---- param state ---------------------------------------------------------------
void FusedParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master);
}
void FusedParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, max_exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, momentum_buffer);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, master);
}

// ---- options -------------------------------------------------------------------
#define FT_COMMON_SERIALIZE()                            \
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);                  \
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);        \
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(maximize);            \
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_grad_norm);       \
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_weights)
#define FT_COMMON_DESERIALIZE()                            \
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);          \
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay); \
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, maximize);      \
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, max_grad_norm); \
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, master_weights)

AdamOptions::AdamOptions(double lr) : lr_(lr) {}
void AdamOptions::serialize(torch::serialize::OutputArchive& archive) const {
  FT_COMMON_SERIALIZE();
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(amsgrad);
}
void AdamOptions::serialize(torch::serialize::InputArchive& archive) {
  FT_COMMON_DESERIALIZE();
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, amsgrad);
}
AdamWOptions::AdamWOptions(double lr) : lr_(lr) {}
void AdamWOptions::serialize(torch::serialize::OutputArchive& archive) const {
  FT_COMMON_SERIALIZE();
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(amsgrad);
}
void AdamWOptions::serialize(torch::serialize::InputArchive& archive) {
  FT_COMMON_DESERIALIZE();
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, amsgrad);
}
SGDOptions::SGDOptions(double lr) : lr_(lr) {}
void SGDOptions::serialize(torch::serialize::OutputArchive& archive) const {
  FT_COMMON_SERIALIZE();
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(dampening);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
}
void SGDOptions::serialize(torch::serialize::InputArchive& archive) {
  FT_COMMON_DESERIALIZE();
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, dampening);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, nesterov);
}
LionOptions::LionOptions(double lr) : lr_(lr) {}
void LionOptions::serialize(torch::serialize::OutputArchive& archive) const {
  FT_COMMON_SERIALIZE();
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
}
void LionOptions::serialize(torch::serialize::InputArchive& archive) {
  FT_COMMON_DESERIALIZE();
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
}

// ---- FusedOptimizer ------------------------------------------------------------
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
                               const std::optional<at::Tensor>& found_inf_in) {
  torch::NoGradGuard no_grad;
  struct Item {
    size_t group;
    at::Tensor param;
  };
  std::vector<Item> items;
  bool need_norm = false;
  for (const auto gi : c10::irange(param_groups_.size())) {
    auto& group = param_groups_[gi];
    if (group_max_grad_norm(group.options()) > 0) need_norm = true;
    for (const auto& p : group.params()) {
      const auto& g = p.grad();
      if (!g.defined()) continue;
      TORCH_CHECK(!g.is_sparse(), "fusetrain: param of group ", gi, " has a sparse gradient; not supported");
      TORCH_CHECK(!g.is_complex(), "fusetrain: param of group ", gi, " has a complex gradient; not supported");
      items.push_back({gi, p});
    }
  }
  std::optional<at::Tensor> found_inf = found_inf_in;
  if (items.empty()) {
    last_grad_norm_ = at::Tensor();
    last_found_inf_ = found_inf ? *found_inf : at::Tensor();
    return;
  }
  const bool capturing = detail::stream_is_capturing(items.front().param.device());
  TORCH_CHECK(!capturing || result_bufs_[0].defined(), "fusetrain: a step is being captured as a CUDA graph "
              "without prepare_capture(); call optimizer.prepare_capture() before capturing");
  // Global norm / non-finite flag, one grad_stats pass per device.
  at::Tensor grad_norm;
  if (need_norm || (inv_scale.has_value() && !found_inf.has_value())) {
    std::map<std::string, std::vector<at::Tensor>> by_device;
    std::vector<std::string> order;
    for (const auto& it : items) {
      auto key = it.param.grad().device().str();
      if (!by_device.count(key)) order.push_back(key);
      by_device[key].push_back(it.param.grad());
    }
    at::Tensor sq, inf, single;
    const auto dev0 = items.front().param.device();
    for (const auto& key : order) {
      auto& grads = by_device[key];
      std::optional<at::Tensor> inv;
      if (inv_scale) inv = inv_scale->to(grads.front().device());
      auto [n, f] = grad_stats(grads, inv);
      n = n.to(dev0);
      single = n;
      f = f.to(dev0);
      sq = sq.defined() ? sq + n * n : n * n;
      inf = inf.defined() ? at::maximum(inf, f) : f;
    }
    grad_norm = order.size() == 1 ? single : sq.sqrt();
    found_inf = found_inf ? at::maximum(found_inf->to(dev0), inf) : inf;
  }
  // NOTE [persistent step results] (python/fusetrain/training/step.py): the
  // host reads these after a replay; a graph-pool tensor could be overwritten
  // by another graph sharing the pool, so a captured step copies them into
  // buffers made by prepare_capture(). Assigned only here, so a capture that
  // fails earlier leaves the previous step's results.
  auto result = [&](const at::Tensor& value, at::Tensor& buf) {
    if (!value.defined() || !capturing) return value;
    buf.copy_(value);
    return buf;
  };
  last_grad_norm_ = result(grad_norm, result_bufs_[0]);
  last_found_inf_ = result(found_inf ? *found_inf : at::Tensor(), result_bufs_[1]);

  const at::Tensor* decay = nullptr;
  if (ema_ != nullptr) decay = &ema_->prepare_decay();

  // Partition: (group, device, has master, has ema) -> one kernel call each.
  std::map<std::tuple<size_t, std::string, bool, bool>, FusedLists> parts;
  std::vector<at::Tensor> covered;
  for (const auto& it : items) {
    auto& group = param_groups_[it.group];
    const auto& opts = group.options();
    const auto& p = it.param;
    auto& s = ensure_state(p, opts, capturing);
    const bool has_master = group_master_weights(opts) && p.scalar_type() != at::kFloat;
    at::Tensor ema_t;
    if (ema_ != nullptr) ema_t = ema_->ema_for(p);
    auto& l = parts[{it.group, p.device().str(), has_master, ema_t.defined()}];
    l.params.push_back(p);
    l.grads.push_back(p.grad());
    l.steps.push_back(s.step());
    if (has_master) l.masters.push_back(s.master());
    if (ema_t.defined()) {
      l.emas.push_back(ema_t);
      covered.push_back(p);
    }
    collect_state(l, s, opts);
  }
  for (auto& [key, l] : parts) {
    const auto& opts = param_groups_[std::get<0>(key)].options();
    const auto dev = l.params.front().device();
    FusedTail tail;
    if (inv_scale) tail.inv_scale = inv_scale->to(dev);
    if (found_inf) tail.found_inf = found_inf->to(dev);
    tail.max_grad_norm = group_max_grad_norm(opts);
    if (tail.max_grad_norm > 0) tail.grad_norm = grad_norm.to(dev);
    if (std::get<3>(key)) tail.ema_decay = decay->to(dev);
    run_update(l, lr_tensor(std::get<0>(key), dev, opts.get_lr()), opts, tail);
  }
  if (ema_ != nullptr) ema_->finish_step(found_inf, covered);
}

const at::Tensor& FusedOptimizer::lr_tensor(size_t group, const at::Device& dev, double lr) {
  auto& entry = lr_cache_[{group, dev.str()}];
  if (!entry.second.defined() || entry.first != lr) check_not_capturing(dev, "a group's lr tensor would be filled");
  if (!entry.second.defined()) {
    entry = {lr, at::full({}, lr, at::TensorOptions().dtype(at::kFloat).device(dev))};
  } else if (entry.first != lr) {
    entry.second.fill_(lr);
    entry.first = lr;
  }
  return entry.second;
}

FusedParamState& FusedOptimizer::ensure_state(const at::Tensor& p, const torch::optim::OptimizerOptions& opts,
                                              bool capturing) {
  auto key_impl = p.unsafeGetTensorImpl();
  auto found = state_.find(key_impl);
  auto* s = found == state_.end() ? nullptr : static_cast<FusedParamState*>(found->second.get());
  const bool has_master = group_master_weights(opts) && p.scalar_type() != at::kFloat;
  if (capturing) {
    // Nothing may be created or moved now: check that the state is complete.
    bool ready = s != nullptr && s->step().defined() && s->step().scalar_type() == at::kFloat &&
                 (!has_master || s->master().defined());
    if (ready) {
      FusedParamState probe = *s;
      init_state(probe, p, opts);  // defines what is missing; nothing is missing when ready
      for (const auto* t : {&probe.step(), &probe.exp_avg(), &probe.exp_avg_sq(), &probe.max_exp_avg_sq(),
                            &probe.momentum_buffer(), &probe.master()})
        ready = ready && (!t->defined() || t->device() == p.device());
      ready = ready && probe.exp_avg().is_same(s->exp_avg()) && probe.exp_avg_sq().is_same(s->exp_avg_sq()) &&
              probe.max_exp_avg_sq().is_same(s->max_exp_avg_sq()) &&
              probe.momentum_buffer().is_same(s->momentum_buffer());
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
  s->master(to_dev(s->master()));
  init_state(*s, p, opts);  // fills whatever is still missing
  if (has_master && !s->master().defined()) s->master(p.detach().to(at::kFloat).clone());
  return *s;
}

void FusedOptimizer::prepare_capture() {
  torch::NoGradGuard no_grad;
  for (const auto gi : c10::irange(param_groups_.size())) {
    auto& group = param_groups_[gi];
    for (const auto& p : group.params()) {
      if (!p.requires_grad()) continue;
      ensure_state(p, group.options(), /*capturing=*/false);
      lr_tensor(gi, p.device(), group.options().get_lr());
      if (!result_bufs_[0].defined()) {
        for (auto& b : result_bufs_) b = at::zeros({}, p.options().dtype(at::kFloat));
      }
    }
  }
}

void FusedOptimizer::refresh_lr_tensors() {
  for (auto& [key, entry] : lr_cache_) {
    if (key.first >= param_groups_.size() || !entry.second.defined()) continue;
    const double lr = param_groups_[key.first].options().get_lr();
    if (entry.first != lr) {
      entry.second.fill_(lr);
      entry.first = lr;
    }
  }
}

// ---- concrete optimizers -------------------------------------------------------
#define FT_SERIALIZE_METHODS(Name)                                                   \
  void Name::save(torch::serialize::OutputArchive& archive) const {                 \
    torch::optim::serialize<FusedParamState, Name##Options>(archive, *this);        \
  }                                                                                  \
  void Name::load(torch::serialize::InputArchive& archive) {                        \
    torch::optim::serialize<FusedParamState, Name##Options>(archive, *this);        \
  }                                                                                  \
  double Name::group_max_grad_norm(const torch::optim::OptimizerOptions& o) const { \
    return static_cast<const Name##Options&>(o).max_grad_norm();                    \
  }                                                                                  \
  bool Name::group_master_weights(const torch::optim::OptimizerOptions& o) const {  \
    return static_cast<const Name##Options&>(o).master_weights();                   \
  }

FT_SERIALIZE_METHODS(Adam)
FT_SERIALIZE_METHODS(AdamW)
FT_SERIALIZE_METHODS(SGD)
FT_SERIALIZE_METHODS(Lion)

template <typename O>
static void check_adam_like(const char* name, const O& d) {
  check_nonneg(name, "learning rate", d.lr());
  check_nonneg(name, "epsilon", d.eps());
  check_betas(name, d.betas());
  check_nonneg(name, "weight_decay", d.weight_decay());
  check_nonneg(name, "max_grad_norm", d.max_grad_norm());
}

Adam::Adam(const std::vector<torch::optim::OptimizerParamGroup>& groups, AdamOptions d)
    : FusedOptimizer(groups, std::make_unique<AdamOptions>(d)) {
  check_adam_like("fusetrain::Adam", d);
}
AdamW::AdamW(const std::vector<torch::optim::OptimizerParamGroup>& groups, AdamWOptions d)
    : FusedOptimizer(groups, std::make_unique<AdamWOptions>(d)) {
  check_adam_like("fusetrain::AdamW", d);
}
SGD::SGD(const std::vector<torch::optim::OptimizerParamGroup>& groups, SGDOptions d)
    : FusedOptimizer(groups, std::make_unique<SGDOptions>(d)) {
  const char* n = "fusetrain::SGD";
  check_nonneg(n, "learning rate", d.lr());
  check_nonneg(n, "momentum", d.momentum());
  check_nonneg(n, "weight_decay", d.weight_decay());
  check_nonneg(n, "max_grad_norm", d.max_grad_norm());
  TORCH_CHECK(!d.nesterov() || (d.momentum() > 0 && d.dampening() == 0),
              "fusetrain::SGD: nesterov momentum requires a momentum > 0 and zero dampening");
}
Lion::Lion(const std::vector<torch::optim::OptimizerParamGroup>& groups, LionOptions d)
    : FusedOptimizer(groups, std::make_unique<LionOptions>(d)) {
  const char* n = "fusetrain::Lion";
  check_nonneg(n, "learning rate", d.lr());
  check_betas(n, d.betas());
  check_nonneg(n, "weight_decay", d.weight_decay());
  check_nonneg(n, "max_grad_norm", d.max_grad_norm());
}

template <typename O>
static void init_adam_state(FusedParamState& s, const at::Tensor& p, const O& o) {
  if (!s.exp_avg().defined()) s.exp_avg(f32_zeros_like(p));
  if (!s.exp_avg_sq().defined()) s.exp_avg_sq(f32_zeros_like(p));
  if (o.amsgrad() && !s.max_exp_avg_sq().defined()) s.max_exp_avg_sq(f32_zeros_like(p));
}
template <typename O>
static void collect_adam_state(FusedLists& l, FusedParamState& s, const O& o) {
  l.state1.push_back(s.exp_avg());
  l.state2.push_back(s.exp_avg_sq());
  if (o.amsgrad()) l.state3.push_back(s.max_exp_avg_sq());
}

void Adam::init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions& o) const {
  init_adam_state(s, p, static_cast<const AdamOptions&>(o));
}
void Adam::collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions& o) const {
  collect_adam_state(l, s, static_cast<const AdamOptions&>(o));
}
void Adam::run_update(FusedLists& l, const at::Tensor& lr, const torch::optim::OptimizerOptions& oo,
                      const FusedTail& tail) const {
  const auto& o = static_cast<const AdamOptions&>(oo);
  fused_adam_(l.params, l.grads, l.state1, l.state2, l.state3, l.steps, l.masters, l.emas, lr, std::get<0>(o.betas()),
              std::get<1>(o.betas()), o.weight_decay(), o.eps(), o.amsgrad(), o.maximize(), false, tail);
}
void AdamW::init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions& o) const {
  init_adam_state(s, p, static_cast<const AdamWOptions&>(o));
}
void AdamW::collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions& o) const {
  collect_adam_state(l, s, static_cast<const AdamWOptions&>(o));
}
void AdamW::run_update(FusedLists& l, const at::Tensor& lr, const torch::optim::OptimizerOptions& oo,
                       const FusedTail& tail) const {
  const auto& o = static_cast<const AdamWOptions&>(oo);
  fused_adam_(l.params, l.grads, l.state1, l.state2, l.state3, l.steps, l.masters, l.emas, lr, std::get<0>(o.betas()),
              std::get<1>(o.betas()), o.weight_decay(), o.eps(), o.amsgrad(), o.maximize(), true, tail);
}
void SGD::init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions& oo) const {
  const auto& o = static_cast<const SGDOptions&>(oo);
  if (o.momentum() != 0 && !s.momentum_buffer().defined()) s.momentum_buffer(f32_zeros_like(p));
}
void SGD::collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions& oo) const {
  const auto& o = static_cast<const SGDOptions&>(oo);
  if (o.momentum() != 0) l.state1.push_back(s.momentum_buffer());
}
void SGD::run_update(FusedLists& l, const at::Tensor& lr, const torch::optim::OptimizerOptions& oo,
                     const FusedTail& tail) const {
  const auto& o = static_cast<const SGDOptions&>(oo);
  fused_sgd_(l.params, l.grads, l.state1, l.steps, l.masters, l.emas, lr, o.momentum(), o.dampening(),
             o.weight_decay(), o.nesterov(), o.maximize(), tail);
}
void Lion::init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions&) const {
  if (!s.exp_avg().defined()) s.exp_avg(f32_zeros_like(p));
}
void Lion::collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions&) const {
  l.state1.push_back(s.exp_avg());
}
void Lion::run_update(FusedLists& l, const at::Tensor& lr, const torch::optim::OptimizerOptions& oo,
                      const FusedTail& tail) const {
  const auto& o = static_cast<const LionOptions&>(oo);
  fused_lion_(l.params, l.grads, l.state1, l.steps, l.masters, l.emas, lr, std::get<0>(o.betas()),
              std::get<1>(o.betas()), o.weight_decay(), o.maximize(), tail);
}

}  // namespace fusetrain
