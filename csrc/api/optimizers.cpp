// The concrete C++ optimizers: options (and their serialization), argument
// checks, and each optimizer's own fields of the group record, by name (the
// kind table orders them and names the state: NOTE [kind table] in
// csrc/ops/optim_kind.h).
#include <fusetrain/optim.h>

#include <torch/serialize/archive.h>

#include <tuple>

#include "optim_internal.h"

namespace fusetrain {

using api_detail::check_betas;
using api_detail::check_nonneg;
using api_detail::check_range;

// ---- concrete optimizers -------------------------------------------------------
#define FT_SERIALIZE_METHODS(Name, Kind)                                              \
  void Name::save(torch::serialize::OutputArchive& archive) const {                 \
    torch::optim::serialize<FusedParamState, Name##Options>(archive, *this);        \
  }                                                                                  \
  void Name::load(torch::serialize::InputArchive& archive) {                        \
    torch::optim::serialize<FusedParamState, Name##Options>(archive, *this);        \
  }                                                                                  \
  const char* Name::kind() const { return Kind; }

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
  check_kind();
}
AdamW::AdamW(const std::vector<torch::optim::OptimizerParamGroup>& groups, AdamWOptions d)
    : FusedOptimizer(groups, std::make_unique<AdamWOptions>(d)) {
  check_adam_like("fusetrain::AdamW", d);
  check_kind();
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
  check_kind();
}
Lion::Lion(const std::vector<torch::optim::OptimizerParamGroup>& groups, LionOptions d)
    : FusedOptimizer(groups, std::make_unique<LionOptions>(d)) {
  const char* n = "fusetrain::Lion";
  check_nonneg(n, "learning rate", d.lr());
  check_betas(n, d.betas());
  check_nonneg(n, "weight_decay", d.weight_decay());
  check_nonneg(n, "max_grad_norm", d.max_grad_norm());
  check_kind();
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
  check_kind();
}
Adadelta::Adadelta(const std::vector<torch::optim::OptimizerParamGroup>& groups, AdadeltaOptions d)
    : FusedOptimizer(groups, std::make_unique<AdadeltaOptions>(d)) {
  const char* n = "fusetrain::Adadelta";
  check_nonneg(n, "learning rate", d.lr());
  check_range(n, "rho", d.rho(), 0.0, 1.0, false);
  check_nonneg(n, "epsilon", d.eps());
  check_nonneg(n, "weight_decay", d.weight_decay());
  check_nonneg(n, "max_grad_norm", d.max_grad_norm());
  check_kind();
}
RAdam::RAdam(const std::vector<torch::optim::OptimizerParamGroup>& groups, RAdamOptions d)
    : FusedOptimizer(groups, std::make_unique<RAdamOptions>(d)) {
  check_adam_like("fusetrain::RAdam", d);
  check_kind();
}

// NOTE [kind table] in csrc/ops/optim_kind.h: each optimizer's own record fields, by name.
template <typename O>
static void adam_fields(const O& o, bool decoupled, KindValues& v) {
  v = {{"beta1", std::get<0>(o.betas())}, {"beta2", std::get<1>(o.betas())}, {"weight_decay", o.weight_decay()},
       {"eps", o.eps()}, {"amsgrad", o.amsgrad()}, {"decoupled_weight_decay", decoupled},
       {"bias_correction", o.bias_correction()}};
}
void Adam::kind_fields(const torch::optim::OptimizerOptions& o, KindValues& v) const {
  adam_fields(static_cast<const AdamOptions&>(o), false, v);
}
void AdamW::kind_fields(const torch::optim::OptimizerOptions& o, KindValues& v) const {
  adam_fields(static_cast<const AdamWOptions&>(o), true, v);
}
void SGD::kind_fields(const torch::optim::OptimizerOptions& oo, KindValues& v) const {
  const auto& o = static_cast<const SGDOptions&>(oo);
  v = {{"momentum", o.momentum()}, {"dampening", o.dampening()}, {"weight_decay", o.weight_decay()},
       {"nesterov", o.nesterov()}};
}
void Lion::kind_fields(const torch::optim::OptimizerOptions& oo, KindValues& v) const {
  const auto& o = static_cast<const LionOptions&>(oo);
  v = {{"beta1", std::get<0>(o.betas())}, {"beta2", std::get<1>(o.betas())}, {"weight_decay", o.weight_decay()}};
}
void RMSprop::kind_fields(const torch::optim::OptimizerOptions& oo, KindValues& v) const {
  const auto& o = static_cast<const RMSpropOptions&>(oo);
  v = {{"alpha", o.alpha()}, {"eps", o.eps()}, {"weight_decay", o.weight_decay()}, {"momentum", o.momentum()},
       {"centered", o.centered()}, {"tf_style", o.tf_style()}, {"lr_in_momentum", o.lr_in_momentum()},
       {"decoupled_weight_decay", o.decoupled_weight_decay()}};
}
void Adadelta::kind_fields(const torch::optim::OptimizerOptions& oo, KindValues& v) const {
  const auto& o = static_cast<const AdadeltaOptions&>(oo);
  v = {{"rho", o.rho()}, {"eps", o.eps()}, {"weight_decay", o.weight_decay()}};
}
void RAdam::kind_fields(const torch::optim::OptimizerOptions& oo, KindValues& v) const {
  const auto& o = static_cast<const RAdamOptions&>(oo);
  v = {{"beta1", std::get<0>(o.betas())}, {"beta2", std::get<1>(o.betas())}, {"eps", o.eps()},
       {"weight_decay", o.weight_decay()}, {"decoupled_weight_decay", o.decoupled_weight_decay()}};
}

NAdam::NAdam(const std::vector<torch::optim::OptimizerParamGroup>& groups, NAdamOptions d)
    : FusedOptimizer(groups, std::make_unique<NAdamOptions>(d)) {
  check_adam_like("fusetrain::NAdam", d);
  check_nonneg("fusetrain::NAdam", "momentum_decay", d.momentum_decay());
  check_kind();
}
void NAdam::kind_fields(const torch::optim::OptimizerOptions& oo, KindValues& v) const {
  const auto& o = static_cast<const NAdamOptions&>(oo);
  v = {{"beta1", std::get<0>(o.betas())}, {"beta2", std::get<1>(o.betas())}, {"eps", o.eps()},
       {"weight_decay", o.weight_decay()}, {"momentum_decay", o.momentum_decay()},
       {"decoupled_weight_decay", o.decoupled_weight_decay()}};
}

Lamb::Lamb(const std::vector<torch::optim::OptimizerParamGroup>& groups, LambOptions d)
    : FusedOptimizer(groups, std::make_unique<LambOptions>(d)) {
  check_adam_like("fusetrain::Lamb", d);
  check_kind();
}
void Lamb::kind_fields(const torch::optim::OptimizerOptions& oo, KindValues& v) const {
  const auto& o = static_cast<const LambOptions&>(oo);
  const bool corrected = o.decoupled_weight_decay() && o.corrected_weight_decay();
  v = {{"beta1", std::get<0>(o.betas())}, {"beta2", std::get<1>(o.betas())}, {"eps", o.eps()},
       {"weight_decay", o.weight_decay()}, {"bias_correction", o.bias_correction()},
       {"grad_averaging", o.grad_averaging()}, {"trust_clip", o.trust_clip()}, {"always_adapt", o.always_adapt()},
       {"caution", o.caution()}, {"decoupled_weight_decay", o.decoupled_weight_decay()},
       {"decay_max_lr", corrected ? defaults().get_lr() : 0.0}};
}

AdamP::AdamP(const std::vector<torch::optim::OptimizerParamGroup>& groups, AdamPOptions d)
    : FusedOptimizer(groups, std::make_unique<AdamPOptions>(d)) {
  check_adam_like("fusetrain::AdamP", d);
  check_nonneg("fusetrain::AdamP", "delta", d.delta());
  check_nonneg("fusetrain::AdamP", "wd_ratio", d.wd_ratio());
  check_kind();
}
void AdamP::kind_fields(const torch::optim::OptimizerOptions& oo, KindValues& v) const {
  const auto& o = static_cast<const AdamPOptions&>(oo);
  v = {{"beta1", std::get<0>(o.betas())}, {"beta2", std::get<1>(o.betas())}, {"eps", o.eps()},
       {"weight_decay", o.weight_decay()}, {"delta", o.delta()}, {"wd_ratio", o.wd_ratio()},
       {"nesterov", o.nesterov()}};
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
  check_kind();
}
// NOTE [muon groups] in csrc/ops/fused_muon.cpp.
void Muon::kind_fields(const torch::optim::OptimizerOptions& oo, KindValues& v) const {
  const auto& o = static_cast<const MuonOptions&>(oo);
  const auto& c = o.ns_coefficients();
  v = {{"use_muon", o.use_muon()},
       {"momentum", o.momentum()},
       {"nesterov", o.nesterov()},
       {"weight_decay", o.weight_decay()},
       {"ns_a", std::get<0>(c)},
       {"ns_b", std::get<1>(c)},
       {"ns_c", std::get<2>(c)},
       {"eps", o.eps()},
       {"ns_steps", static_cast<double>(o.ns_steps())},
       {"match_rms_adamw", o.adjust_lr_fn() == "match_rms_adamw"},
       {"adamw_beta1", std::get<0>(o.adamw_betas())},
       {"adamw_beta2", std::get<1>(o.adamw_betas())},
       {"adamw_eps", o.adamw_eps()}};
}
}  // namespace fusetrain
