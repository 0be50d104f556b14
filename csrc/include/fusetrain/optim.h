// fusetrain's fused optimizers for LibTorch programs.
//
// fusetrain::Adam, AdamW, SGD, Lion, RMSprop, Adadelta, RAdam, NAdam, Lamb, AdamP and
// Muon derive from
// torch::optim::Optimizer, so
// they plug into LibTorch loops, LR schedulers (which go through
// options().get_lr()/set_lr()) and torch::save/torch::load of optimizer state.
// Each step runs fusetrain's multi-tensor kernels (one pass over all params of
// a group); clipping, the skip on non-finite gradients, loss unscaling and an
// attached EMA are folded into the same pass without any host-device sync.
#pragma once

#include <fusetrain/ops.h>

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace fusetrain {

class ModelEMA;

// Per-parameter state shared by all fusetrain optimizers. `step` is a 0-d
// float32 tensor on the param's device (incremented on the device by the
// kernels); the other tensors are float32 (float64 for float64 params) and
// undefined when unused.
struct FusedParamState : public torch::optim::OptimizerCloneableParamState<FusedParamState> {
  TORCH_ARG(torch::Tensor, step);
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_sq);
  TORCH_ARG(torch::Tensor, max_exp_avg_sq);
  TORCH_ARG(torch::Tensor, momentum_buffer);
  TORCH_ARG(torch::Tensor, square_avg);  // RMSprop, Adadelta
  TORCH_ARG(torch::Tensor, grad_avg);    // centered RMSprop
  TORCH_ARG(torch::Tensor, acc_delta);   // Adadelta
  TORCH_ARG(torch::Tensor, mu_product);  // NAdam: 0-d float32, like step
  TORCH_ARG(torch::Tensor, master);  // fp32 master copy of an fp16/bf16 param

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};
using AdamParamState = FusedParamState;
using AdamWParamState = FusedParamState;
using SGDParamState = FusedParamState;
using LionParamState = FusedParamState;
using RMSpropParamState = FusedParamState;
using AdadeltaParamState = FusedParamState;
using RAdamParamState = FusedParamState;
using NAdamParamState = FusedParamState;
using LambParamState = FusedParamState;
using AdamPParamState = FusedParamState;
using MuonParamState = FusedParamState;

// Options. Common to all: lr, weight_decay, maximize, max_grad_norm (global L2
// norm clipping over all groups; 0 = off) and master_weights (keep an fp32
// master copy of fp16/bf16 params in the state).
struct AdamOptions : public torch::optim::OptimizerCloneableOptions<AdamOptions> {
  AdamOptions(double lr = 1e-3);
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, bias_correction) = true;  // false: the BertAdam form
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(double, max_grad_norm) = 0.0;
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct AdamWOptions : public torch::optim::OptimizerCloneableOptions<AdamWOptions> {
  AdamWOptions(double lr = 1e-3);
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, bias_correction) = true;  // false: the BertAdam form
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(double, max_grad_norm) = 0.0;
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct SGDOptions : public torch::optim::OptimizerCloneableOptions<SGDOptions> {
  SGDOptions(double lr = 1e-3);
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, momentum) = 0.0;
  TORCH_ARG(double, dampening) = 0.0;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(double, max_grad_norm) = 0.0;
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct LionOptions : public torch::optim::OptimizerCloneableOptions<LionOptions> {
  LionOptions(double lr = 1e-4);
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(double, lr) = 1e-4;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.99);
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(double, max_grad_norm) = 0.0;
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct RMSpropOptions : public torch::optim::OptimizerCloneableOptions<RMSpropOptions> {
  RMSpropOptions(double lr = 1e-2);
  TORCH_ARG(double, lr) = 1e-2;
  TORCH_ARG(double, alpha) = 0.99;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(double, momentum) = 0.0;
  TORCH_ARG(bool, centered) = false;
  // timm's RMSpropTF (TensorFlow's form, NOTE [rmsprop tf] in csrc/common/rms_math.h): square_avg starts at 1;
  // lr_in_momentum and decoupled_weight_decay need it. Its usual settings: alpha 0.9, eps 1e-10 (or 1e-3),
  // lr_in_momentum true.
  TORCH_ARG(bool, tf_style) = false;
  TORCH_ARG(bool, lr_in_momentum) = false;
  TORCH_ARG(bool, decoupled_weight_decay) = false;
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(double, max_grad_norm) = 0.0;
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct AdadeltaOptions : public torch::optim::OptimizerCloneableOptions<AdadeltaOptions> {
  AdadeltaOptions(double lr = 1.0);
  TORCH_ARG(double, lr) = 1.0;
  TORCH_ARG(double, rho) = 0.9;
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(double, max_grad_norm) = 0.0;
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct RAdamOptions : public torch::optim::OptimizerCloneableOptions<RAdamOptions> {
  RAdamOptions(double lr = 1e-3);
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, decoupled_weight_decay) = false;
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(double, max_grad_norm) = 0.0;
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct NAdamOptions : public torch::optim::OptimizerCloneableOptions<NAdamOptions> {
  NAdamOptions(double lr = 2e-3);
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(double, lr) = 2e-3;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(double, momentum_decay) = 4e-3;
  TORCH_ARG(bool, decoupled_weight_decay) = false;
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(double, max_grad_norm) = 0.0;
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

// Lamb with timm's semantics and defaults (NOTE [apply pass] in
// csrc/ops/aten_stage.h); its built-in clipping is max_grad_norm (default 1).
// corrected_weight_decay scales the decoupled decay by lr / defaults().lr().
struct LambOptions : public torch::optim::OptimizerCloneableOptions<LambOptions> {
  LambOptions(double lr = 1e-3);
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0.01;
  TORCH_ARG(bool, bias_correction) = true;
  TORCH_ARG(bool, grad_averaging) = true;
  TORCH_ARG(bool, trust_clip) = false;
  TORCH_ARG(bool, always_adapt) = false;
  TORCH_ARG(bool, caution) = false;
  TORCH_ARG(bool, decoupled_weight_decay) = false;
  TORCH_ARG(bool, corrected_weight_decay) = false;
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(double, max_grad_norm) = 1.0;
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

// AdamP with timm's semantics and defaults (NOTE [adamp projection] in
// csrc/ops/fused_adamp.cpp).
struct AdamPOptions : public torch::optim::OptimizerCloneableOptions<AdamPOptions> {
  AdamPOptions(double lr = 1e-3);
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(double, delta) = 0.1;
  TORCH_ARG(double, wd_ratio) = 0.1;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(bool, maximize) = false;
  TORCH_ARG(double, max_grad_norm) = 0.0;
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

// Muon (torch.optim.Muon's update, NOTE [muon apply] in csrc/ops/fused_muon.cpp)
// for the params of use_muon groups (2 or more dims each; a convolution filter
// is the matrix out_channels x the rest), AdamW with adamw_betas, adamw_eps and
// the group's lr and weight_decay for the params of the others: give biases,
// norms and embeddings a group with use_muon(false). adjust_lr_fn: "original"
// or "match_rms_adamw" (then one lr suits both kinds).
struct MuonOptions : public torch::optim::OptimizerCloneableOptions<MuonOptions> {
  MuonOptions(double lr = 1e-3);
  typedef std::tuple<double, double> betas_t;
  typedef std::tuple<double, double, double> coefficients_t;
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, weight_decay) = 0.1;
  TORCH_ARG(double, momentum) = 0.95;
  TORCH_ARG(bool, nesterov) = true;
  TORCH_ARG(coefficients_t, ns_coefficients) = std::make_tuple(3.4445, -4.775, 2.0315);
  TORCH_ARG(double, eps) = 1e-7;
  TORCH_ARG(int64_t, ns_steps) = 5;
  TORCH_ARG(std::string, adjust_lr_fn) = "original";
  TORCH_ARG(bool, use_muon) = true;
  TORCH_ARG(betas_t, adamw_betas) = std::make_tuple(0.9, 0.95);
  TORCH_ARG(double, adamw_eps) = 1e-8;
  TORCH_ARG(bool, maximize) = false;  // not supported (an error when true); kept for the common interface
  TORCH_ARG(double, max_grad_norm) = 0.0;
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

// The state tensors of one step, flattened over groups in the layout of
// fusetrain::fused_step_ (NOTE [group records] in csrc/ops/fused_step.cpp).
struct FusedLists {
  std::vector<at::Tensor> params, grads, steps, masters, emas, state1, state2, state3;
};

// Common base: lazy state, the loss-scale entry, EMA attachment. A step is one
// call of fusetrain::fused_step_, which holds the step's logic (stats pass,
// clipping, skip on non-finite gradients, master weights, EMA).
class FusedOptimizer : public torch::optim::Optimizer {
 public:
  using torch::optim::Optimizer::Optimizer;

  // Plain step (no loss scaling). Returns the closure's loss if given.
  torch::Tensor step(LossClosure closure = nullptr) override;

  // Entry used by fusetrain::LossScaler: gradients are multiplied by
  // inv_scale (0-d float32); when found_inf is non-zero on the device, nothing
  // changes. With inv_scale and no found_inf, the flag is computed here (one
  // grad_stats pass, also giving the clipping norm).
  void step_with(const std::optional<at::Tensor>& inv_scale, const std::optional<at::Tensor>& found_inf);

  // Device tensors written by every step that updated something (undefined
  // before): the global gradient norm (NaN when the step measured none: no
  // clipping and no loss scaling) and the non-finite flag. They are the same
  // tensors from step to step (created outside any CUDA graph's pool).
  const at::Tensor& last_grad_norm() const { return last_grad_norm_; }
  const at::Tensor& last_found_inf() const { return last_found_inf_; }

  // Refills the cached per-group lr device tensors whose group lr changed
  // since the last step (step() does this itself). fusetrain::TrainStep calls
  // it before replaying a captured step, so set_lr and LR schedulers apply
  // without a recapture. Not to be called while a CUDA graph is being captured.
  void refresh_lr_tensors();

  // Creates, before a CUDA-graph capture of step(), everything a step would
  // otherwise create lazily and a graph would redo on every replay: the state
  // of every param that requires grad (also of those without a gradient yet,
  // moved to the param's device), the lr tensor of each group and device, and
  // the result tensors behind last_grad_norm()/last_found_inf(). A step that
  // would still create state or fill an lr tensor while capturing raises.
  // fusetrain::TrainStep calls it.
  void prepare_capture();

  // Used by ModelEMA::attach / detach.
  void attach_ema(ModelEMA* ema) { ema_ = ema; }
  ModelEMA* attached_ema() const { return ema_; }

 protected:
  // The op's optimizer name ("adam", "sgd", "lion") and a group's record:
  // the common fields come from these accessors, the rest from kind_fields.
  virtual const char* kind() const = 0;
  virtual double group_max_grad_norm(const torch::optim::OptimizerOptions& o) const = 0;
  virtual bool group_master_weights(const torch::optim::OptimizerOptions& o) const = 0;
  virtual bool group_maximize(const torch::optim::OptimizerOptions& o) const = 0;
  virtual void kind_fields(const torch::optim::OptimizerOptions& o, std::vector<double>& hyper) const = 0;
  virtual void init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions& o) const = 0;
  // Appends the param's state1..3 entries that its group uses.
  virtual void collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions& o) const = 0;

 private:
  // The lr of (group, device) as a device tensor, refilled only when the
  // group's lr changes (no allocation per step).
  const at::Tensor& lr_tensor(size_t group, const at::Device& dev, double lr);
  // The state of p, created or moved to p's device where needed; while
  // capturing, raises instead when anything would be created or moved.
  FusedParamState& ensure_state(const at::Tensor& p, const torch::optim::OptimizerOptions& opts, bool capturing);
  void ensure_results(const at::Device& dev, bool capturing);
  at::Tensor last_grad_norm_, last_found_inf_;
  ModelEMA* ema_ = nullptr;
  std::map<std::pair<size_t, std::string>, std::pair<double, at::Tensor>> lr_cache_;
};

#define FUSETRAIN_DECLARE_OPTIMIZER(Name)                                                                     \
  class Name : public FusedOptimizer {                                                                          \
   public:                                                                                                      \
    explicit Name(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Name##Options defaults = {}); \
    explicit Name(std::vector<at::Tensor> params, Name##Options defaults = {})                                 \
        : Name(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))}, \
               std::move(defaults)) {}                                                                          \
    void save(torch::serialize::OutputArchive& archive) const override;                                         \
    void load(torch::serialize::InputArchive& archive) override;                                                \
                                                                                                                \
   protected:                                                                                                   \
    const char* kind() const override;                                                                          \
    double group_max_grad_norm(const torch::optim::OptimizerOptions& o) const override;                         \
    bool group_master_weights(const torch::optim::OptimizerOptions& o) const override;                          \
    bool group_maximize(const torch::optim::OptimizerOptions& o) const override;                                \
    void kind_fields(const torch::optim::OptimizerOptions& o, std::vector<double>& hyper) const override;      \
    void init_state(FusedParamState& s, const at::Tensor& p, const torch::optim::OptimizerOptions& o) const override; \
    void collect_state(FusedLists& l, FusedParamState& s, const torch::optim::OptimizerOptions& o) const override; \
  };

FUSETRAIN_DECLARE_OPTIMIZER(Adam)
FUSETRAIN_DECLARE_OPTIMIZER(AdamW)
FUSETRAIN_DECLARE_OPTIMIZER(SGD)
FUSETRAIN_DECLARE_OPTIMIZER(Lion)
FUSETRAIN_DECLARE_OPTIMIZER(RMSprop)
FUSETRAIN_DECLARE_OPTIMIZER(Adadelta)
FUSETRAIN_DECLARE_OPTIMIZER(RAdam)
FUSETRAIN_DECLARE_OPTIMIZER(NAdam)
FUSETRAIN_DECLARE_OPTIMIZER(Lamb)
FUSETRAIN_DECLARE_OPTIMIZER(AdamP)
FUSETRAIN_DECLARE_OPTIMIZER(Muon)
#undef FUSETRAIN_DECLARE_OPTIMIZER

}  // namespace fusetrain
