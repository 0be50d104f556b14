// The concrete C++ optimizers: options (and their serialization), argument
// checks, and each optimizer's part of the group record and state
// (NOTE [group records] in csrc/ops/fused_step.cpp).
#include <fusetrain/optim.h>

#include <ATen/ops/ones.h>
#include <torch/serialize/archive.h>

#include <tuple>

#include "optim_internal.h"

namespace fusetrain {

using api_detail::check_betas;
using api_detail::check_nonneg;
using api_detail::check_range;
using api_detail::state_zeros_like;

namespace {
void read_optional_bool(torch::serialize::InputArchive& archive, const char* key, bool& value) {
  c10::IValue v;
  if (archive.try_read(key, v)) value = v.toBool();
}
}  // namespace

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
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(bias_correction);
}
void AdamOptions::serialize(torch::serialize::InputArchive& archive) {
  FT_COMMON_DESERIALIZE();
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, amsgrad);
  read_optional_bool(archive, "bias_correction", bias_correction_);  // absent in archives of earlier versions
}
AdamWOptions::AdamWOptions(double lr) : lr_(lr) {}
void AdamWOptions::serialize(torch::serialize::OutputArchive& archive) const {
  FT_COMMON_SERIALIZE();
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(amsgrad);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(bias_correction);
}
void AdamWOptions::serialize(torch::serialize::InputArchive& archive) {
  FT_COMMON_DESERIALIZE();
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, amsgrad);
  read_optional_bool(archive, "bias_correction", bias_correction_);  // absent in archives of earlier versions
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

RMSpropOptions::RMSpropOptions(double lr) : lr_(lr) {}
void RMSpropOptions::serialize(torch::serialize::OutputArchive& archive) const {
  FT_COMMON_SERIALIZE();
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(alpha);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(centered);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(tf_style);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr_in_momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(decoupled_weight_decay);
}
void RMSpropOptions::serialize(torch::serialize::InputArchive& archive) {
  FT_COMMON_DESERIALIZE();
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, alpha);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, centered);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, tf_style);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, lr_in_momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, decoupled_weight_decay);
}
AdadeltaOptions::AdadeltaOptions(double lr) : lr_(lr) {}
void AdadeltaOptions::serialize(torch::serialize::OutputArchive& archive) const {
  FT_COMMON_SERIALIZE();
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(rho);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
}
void AdadeltaOptions::serialize(torch::serialize::InputArchive& archive) {
  FT_COMMON_DESERIALIZE();
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, rho);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
}
RAdamOptions::RAdamOptions(double lr) : lr_(lr) {}
void RAdamOptions::serialize(torch::serialize::OutputArchive& archive) const {
  FT_COMMON_SERIALIZE();
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(decoupled_weight_decay);
}
void RAdamOptions::serialize(torch::serialize::InputArchive& archive) {
  FT_COMMON_DESERIALIZE();
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, decoupled_weight_decay);
}
NAdamOptions::NAdamOptions(double lr) : lr_(lr) {}
void NAdamOptions::serialize(torch::serialize::OutputArchive& archive) const {
  FT_COMMON_SERIALIZE();
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(decoupled_weight_decay);
}
void NAdamOptions::serialize(torch::serialize::InputArchive& archive) {
  FT_COMMON_DESERIALIZE();
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, decoupled_weight_decay);
}
LambOptions::LambOptions(double lr) : lr_(lr) {}
void LambOptions::serialize(torch::serialize::OutputArchive& archive) const {
  FT_COMMON_SERIALIZE();
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(bias_correction);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(grad_averaging);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(trust_clip);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(always_adapt);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(caution);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(decoupled_weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(corrected_weight_decay);
}
void LambOptions::serialize(torch::serialize::InputArchive& archive) {
  FT_COMMON_DESERIALIZE();
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, bias_correction);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, grad_averaging);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, trust_clip);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, always_adapt);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, caution);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, decoupled_weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, corrected_weight_decay);
}
AdamPOptions::AdamPOptions(double lr) : lr_(lr) {}
void AdamPOptions::serialize(torch::serialize::OutputArchive& archive) const {
  FT_COMMON_SERIALIZE();
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(delta);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(wd_ratio);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
}
void AdamPOptions::serialize(torch::serialize::InputArchive& archive) {
  FT_COMMON_DESERIALIZE();
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, delta);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, wd_ratio);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, nesterov);
}
MuonOptions::MuonOptions(double lr) : lr_(lr) {}
void MuonOptions::serialize(torch::serialize::OutputArchive& archive) const {
  FT_COMMON_SERIALIZE();
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(ns_coefficients);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(ns_steps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adjust_lr_fn);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(use_muon);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adamw_betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adamw_eps);
}
void MuonOptions::serialize(torch::serialize::InputArchive& archive) {
  FT_COMMON_DESERIALIZE();
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, nesterov);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(coefficients_t, ns_coefficients);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, ns_steps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(std::string, adjust_lr_fn);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, use_muon);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, adamw_betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, adamw_eps);
}

// ---- concrete optimizers -------------------------------------------------------
#define FT_SERIALIZE_METHODS(Name, Kind)                                              \
  void Name::save(torch::serialize::OutputArchive& archive) const {                 \
    torch::optim::serialize<FusedParamState, Name##Options>(archive, *this);        \
  }                                                                                  \
  void Name::load(torch::serialize::InputArchive& archive) {                        \
    torch::optim::serialize<FusedParamState, Name##Options>(archive, *this);        \
  }                                                                                  \
  const char* Name::kind() const { return Kind; }                                    \
  double Name::group_max_grad_norm(const torch::optim::OptimizerOptions& o) const { \
    return static_cast<const Name##Options&>(o).max_grad_norm();                    \
  }                                                                                  \
  bool Name::group_master_weights(const torch::optim::OptimizerOptions& o) const {  \
    return static_cast<const Name##Options&>(o).master_weights();                   \
  }                                                                                  \
  bool Name::group_maximize(const torch::optim::OptimizerOptions& o) const {        \
    return static_cast<const Name##Options&>(o).maximize();                         \
  }

FT_SERIALIZE_METHODS(Adam, "adam")
FT_SERIALIZE_METHODS(AdamW, "adam")
FT_SERIALIZE_METHODS(SGD, "sgd")
FT_SERIALIZE_METHODS(Lion, "lion")
FT_SERIALIZE_METHODS(RMSprop, "rmsprop")
FT_SERIALIZE_METHODS(Adadelta, "adadelta")
FT_SERIALIZE_METHODS(RAdam, "radam")
FT_SERIALIZE_METHODS(NAdam, "nadam")
FT_SERIALIZE_METHODS(Lamb, "lamb")
FT_SERIALIZE_METHODS(AdamP, "adamp")
FT_SERIALIZE_METHODS(Muon, "muon")

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

RMSprop::RMSprop(const std::vector<torch::optim::OptimizerParamGroup>& groups, RMSpropOptions d)
    : FusedOptimizer(groups, std::make_unique<RMSpropOptions>(d)) {
  const char* n = "fusetrain::RMSprop";
  check_nonneg(n, "learning rate", d.lr());
  check_nonneg(n, "alpha", d.alpha());
  check_nonneg(n, "epsilon", d.eps());
  check_nonneg(n, "momentum", d.momentum());
  check_nonneg(n, "weight_decay", d.weight_decay());
  check_nonneg(n, "max_grad_norm", d.max_grad_norm());
  TORCH_CHECK_VALUE(d.tf_style() || (!d.lr_in_momentum() && !d.decoupled_weight_decay()), n,
                    ": lr_in_momentum and decoupled_weight_decay need tf_style(true) (timm's RMSpropTF form)");
}
Adadelta::Adadelta(const std::vector<torch::optim::OptimizerParamGroup>& groups, AdadeltaOptions d)
    : FusedOptimizer(groups, std::make_unique<AdadeltaOptions>(d)) {
  const char* n = "fusetrain::Adadelta";
  check_nonneg(n, "learning rate", d.lr());
  check_range(n, "rho", d.rho(), 0.0, 1.0, false);
  check_nonneg(n, "epsilon", d.eps());
  check_nonneg(n, "weight_decay", d.weight_decay());
  check_nonneg(n, "max_grad_norm", d.max_grad_norm());
}
RAdam::RAdam(const std::vector<torch::optim::OptimizerParamGroup>& groups, RAdamOptions d)
    : FusedOptimizer(groups, std::make_unique<RAdamOptions>(d)) {
  check_adam_like("fusetrain::RAdam", d);
}

template <typename O>
static void init_adam_state(FusedParamState& s, const at::Tensor& p, const O& o) {
  if (!s.exp_avg().defined()) s.exp_avg(state_zeros_like(p));
  if (!s.exp_avg_sq().defined()) s.exp_avg_sq(state_zeros_like(p));
  if (o.amsgrad() && !s.max_exp_avg_sq().defined()) s.max_exp_avg_sq(state_zeros_like(p));
}
// NOTE [group records] in csrc/ops/fused_step.cpp: the optimizer's own fields.
template <typename O>
static void adam_fields(const O& o, bool decoupled, std::vector<double>& h) {
  h.insert(h.end(), {std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(),
                     o.amsgrad() ? 1.0 : 0.0, decoupled ? 1.0 : 0.0, o.bias_correction() ? 1.0 : 0.0});
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
void Adam::kind_fields(const torch::optim::OptimizerOptions& o, std::vector<double>& h) const {
  adam_fields(static_cast<const AdamOptions&>(o), false, h);
}
void AdamW::kind_fields(const torch::optim::OptimizerOptions& o, std::vector<double>& h) const {
  adam_fields(static_cast<const AdamWOptions&>(o), true, h);
}
void AdamW::init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions& o) const {
  init_adam_state(s, p, static_cast<const AdamWOptions&>(o));
}
void AdamW::collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions& o) const {
  collect_adam_state(l, s, static_cast<const AdamWOptions&>(o));
}
void SGD::kind_fields(const torch::optim::OptimizerOptions& oo, std::vector<double>& h) const {
  const auto& o = static_cast<const SGDOptions&>(oo);
  h.insert(h.end(), {o.momentum(), o.dampening(), o.weight_decay(), o.nesterov() ? 1.0 : 0.0});
}
void SGD::init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions& oo) const {
  const auto& o = static_cast<const SGDOptions&>(oo);
  if (o.momentum() != 0 && !s.momentum_buffer().defined()) s.momentum_buffer(state_zeros_like(p));
}
void SGD::collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions& oo) const {
  const auto& o = static_cast<const SGDOptions&>(oo);
  if (o.momentum() != 0) l.state1.push_back(s.momentum_buffer());
}
void Lion::kind_fields(const torch::optim::OptimizerOptions& oo, std::vector<double>& h) const {
  const auto& o = static_cast<const LionOptions&>(oo);
  h.insert(h.end(), {std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay()});
}
void Lion::init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions&) const {
  if (!s.exp_avg().defined()) s.exp_avg(state_zeros_like(p));
}
void Lion::collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions&) const {
  l.state1.push_back(s.exp_avg());
}

void RMSprop::kind_fields(const torch::optim::OptimizerOptions& oo, std::vector<double>& h) const {
  const auto& o = static_cast<const RMSpropOptions&>(oo);
  h.insert(h.end(), {o.alpha(), o.eps(), o.weight_decay(), o.momentum(), o.centered() ? 1.0 : 0.0,
                     o.tf_style() ? 1.0 : 0.0, o.lr_in_momentum() ? 1.0 : 0.0,
                     o.decoupled_weight_decay() ? 1.0 : 0.0});
}
void RMSprop::init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions& oo) const {
  const auto& o = static_cast<const RMSpropOptions&>(oo);
  if (!s.square_avg().defined()) s.square_avg(o.tf_style() ? state_zeros_like(p).fill_(1.0) : state_zeros_like(p));
  if (o.momentum() > 0 && !s.momentum_buffer().defined()) s.momentum_buffer(state_zeros_like(p));
  if (o.centered() && !s.grad_avg().defined()) s.grad_avg(state_zeros_like(p));
}
void RMSprop::collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions& oo) const {
  const auto& o = static_cast<const RMSpropOptions&>(oo);
  l.state1.push_back(s.square_avg());
  if (o.momentum() > 0) l.state2.push_back(s.momentum_buffer());
  if (o.centered()) l.state3.push_back(s.grad_avg());
}
void Adadelta::kind_fields(const torch::optim::OptimizerOptions& oo, std::vector<double>& h) const {
  const auto& o = static_cast<const AdadeltaOptions&>(oo);
  h.insert(h.end(), {o.rho(), o.eps(), o.weight_decay()});
}
void Adadelta::init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions&) const {
  if (!s.square_avg().defined()) s.square_avg(state_zeros_like(p));
  if (!s.acc_delta().defined()) s.acc_delta(state_zeros_like(p));
}
void Adadelta::collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions&) const {
  l.state1.push_back(s.square_avg());
  l.state2.push_back(s.acc_delta());
}
void RAdam::kind_fields(const torch::optim::OptimizerOptions& oo, std::vector<double>& h) const {
  const auto& o = static_cast<const RAdamOptions&>(oo);
  h.insert(h.end(), {std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(),
                     o.decoupled_weight_decay() ? 1.0 : 0.0});
}
void RAdam::init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions&) const {
  if (!s.exp_avg().defined()) s.exp_avg(state_zeros_like(p));
  if (!s.exp_avg_sq().defined()) s.exp_avg_sq(state_zeros_like(p));
}
void RAdam::collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions&) const {
  l.state1.push_back(s.exp_avg());
  l.state2.push_back(s.exp_avg_sq());
}

NAdam::NAdam(const std::vector<torch::optim::OptimizerParamGroup>& groups, NAdamOptions d)
    : FusedOptimizer(groups, std::make_unique<NAdamOptions>(d)) {
  check_adam_like("fusetrain::NAdam", d);
  check_nonneg("fusetrain::NAdam", "momentum_decay", d.momentum_decay());
}
void NAdam::kind_fields(const torch::optim::OptimizerOptions& oo, std::vector<double>& h) const {
  const auto& o = static_cast<const NAdamOptions&>(oo);
  h.insert(h.end(), {std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(), o.momentum_decay(),
                     o.decoupled_weight_decay() ? 1.0 : 0.0});
}
void NAdam::init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions&) const {
  if (!s.exp_avg().defined()) s.exp_avg(state_zeros_like(p));
  if (!s.exp_avg_sq().defined()) s.exp_avg_sq(state_zeros_like(p));
  if (!s.mu_product().defined()) s.mu_product(at::ones({}, p.options().dtype(at::kFloat)));
}
void NAdam::collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions&) const {
  l.state1.push_back(s.exp_avg());
  l.state2.push_back(s.exp_avg_sq());
  l.state3.push_back(s.mu_product());
}

Lamb::Lamb(const std::vector<torch::optim::OptimizerParamGroup>& groups, LambOptions d)
    : FusedOptimizer(groups, std::make_unique<LambOptions>(d)) {
  check_adam_like("fusetrain::Lamb", d);
}
void Lamb::kind_fields(const torch::optim::OptimizerOptions& oo, std::vector<double>& h) const {
  const auto& o = static_cast<const LambOptions&>(oo);
  const bool corrected = o.decoupled_weight_decay() && o.corrected_weight_decay();
  h.insert(h.end(), {std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(),
                     o.bias_correction() ? 1.0 : 0.0, o.grad_averaging() ? 1.0 : 0.0, o.trust_clip() ? 1.0 : 0.0,
                     o.always_adapt() ? 1.0 : 0.0, o.caution() ? 1.0 : 0.0, o.decoupled_weight_decay() ? 1.0 : 0.0,
                     corrected ? defaults().get_lr() : 0.0});
}
void Lamb::init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions&) const {
  if (!s.exp_avg().defined()) s.exp_avg(state_zeros_like(p));
  if (!s.exp_avg_sq().defined()) s.exp_avg_sq(state_zeros_like(p));
}
void Lamb::collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions&) const {
  l.state1.push_back(s.exp_avg());
  l.state2.push_back(s.exp_avg_sq());
}

AdamP::AdamP(const std::vector<torch::optim::OptimizerParamGroup>& groups, AdamPOptions d)
    : FusedOptimizer(groups, std::make_unique<AdamPOptions>(d)) {
  check_adam_like("fusetrain::AdamP", d);
  check_nonneg("fusetrain::AdamP", "delta", d.delta());
  check_nonneg("fusetrain::AdamP", "wd_ratio", d.wd_ratio());
}
void AdamP::kind_fields(const torch::optim::OptimizerOptions& oo, std::vector<double>& h) const {
  const auto& o = static_cast<const AdamPOptions&>(oo);
  h.insert(h.end(), {std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(), o.delta(),
                     o.wd_ratio(), o.nesterov() ? 1.0 : 0.0});
}
void AdamP::init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions&) const {
  if (!s.exp_avg().defined()) s.exp_avg(state_zeros_like(p));
  if (!s.exp_avg_sq().defined()) s.exp_avg_sq(state_zeros_like(p));
}
void AdamP::collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions&) const {
  l.state1.push_back(s.exp_avg());
  l.state2.push_back(s.exp_avg_sq());
}

Muon::Muon(const std::vector<torch::optim::OptimizerParamGroup>& groups, MuonOptions d)
    : FusedOptimizer(groups, std::make_unique<MuonOptions>(d)) {
  const char* n = "fusetrain::Muon";
  check_nonneg(n, "learning rate", d.lr());
  check_nonneg(n, "weight_decay", d.weight_decay());
  check_range(n, "momentum", d.momentum(), 0.0, 1.0, true);
  check_nonneg(n, "epsilon", d.eps());
  check_nonneg(n, "adamw_eps", d.adamw_eps());
  check_betas(n, d.adamw_betas());
  check_nonneg(n, "max_grad_norm", d.max_grad_norm());
  TORCH_CHECK_VALUE(d.ns_steps() >= 0 && d.ns_steps() < 100, n, ": ns_steps must be in [0, 100), got ",
                    d.ns_steps());
  TORCH_CHECK_VALUE(d.adjust_lr_fn() == "original" || d.adjust_lr_fn() == "match_rms_adamw", n,
                    ": adjust_lr_fn must be 'original' or 'match_rms_adamw', got '", d.adjust_lr_fn(), "'");
  for (size_t g = 0; g < param_groups().size(); ++g) {
    const auto& o = static_cast<const MuonOptions&>(param_groups()[g].options());
    TORCH_CHECK_VALUE(!o.maximize(), n, ": maximize is not supported");
    if (!o.use_muon()) continue;
    for (const auto& p : param_groups()[g].params())
      TORCH_CHECK_VALUE(p.dim() >= 2, n, ": group ", g, " (use_muon) has a param of shape ", p.sizes(),
                        "; Muon updates matrices and convolution filters: put params of fewer than 2 dims in a "
                        "group with MuonOptions().use_muon(false) (AdamW)");
  }
}
// NOTE [muon groups] in csrc/ops/fused_step.cpp.
void Muon::kind_fields(const torch::optim::OptimizerOptions& oo, std::vector<double>& h) const {
  const auto& o = static_cast<const MuonOptions&>(oo);
  const auto& c = o.ns_coefficients();
  h.insert(h.end(), {o.use_muon() ? 1.0 : 0.0, o.momentum(), o.nesterov() ? 1.0 : 0.0, o.weight_decay(),
                     std::get<0>(c), std::get<1>(c), std::get<2>(c), o.eps(), static_cast<double>(o.ns_steps()),
                     o.adjust_lr_fn() == "match_rms_adamw" ? 1.0 : 0.0, std::get<0>(o.adamw_betas()),
                     std::get<1>(o.adamw_betas()), o.adamw_eps()});
}
void Muon::init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions& oo) const {
  if (static_cast<const MuonOptions&>(oo).use_muon()) {
    if (!s.momentum_buffer().defined()) s.momentum_buffer(state_zeros_like(p));
  } else {
    if (!s.exp_avg().defined()) s.exp_avg(state_zeros_like(p));
    if (!s.exp_avg_sq().defined()) s.exp_avg_sq(state_zeros_like(p));
  }
}
void Muon::collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions& oo) const {
  if (static_cast<const MuonOptions&>(oo).use_muon()) {
    l.state1.push_back(s.momentum_buffer());
  } else {
    l.state1.push_back(s.exp_avg());
    l.state2.push_back(s.exp_avg_sq());
  }
}
}  // namespace fusetrain
