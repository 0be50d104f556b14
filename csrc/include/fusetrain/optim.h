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
  TORCH_ARG(torch::Tensor, master);  // fp32 master copy (or int16 remainder) of an fp16/bf16 param

 public:
  // The state tensor of this name (a state name of the kind table), or null.
  torch::Tensor* find(const char* name);
  // The float32 block scales of the int8 state of this name (NOTE [8-bit
  // state] in csrc/common/lean_state.h; undefined for another dtype).
  torch::Tensor& scales(const std::string& name) { return scales_[name]; }
  const std::map<std::string, torch::Tensor>& all_scales() const { return scales_; }
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;

 private:
  std::map<std::string, torch::Tensor> scales_;
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

// How master_weights keeps the full value of fp16/bf16 params (NOTE [lean
// state] in csrc/common/lean_state.h): an fp32 copy in the state's `master`,
// an int16 remainder there beside a bfloat16 param (together the exact fp32
// value), or none, the param written with stochastic rounding (bfloat16).
enum class MasterForm : int64_t { Float32 = 1, Remainder = 2, Stochastic = 3 };

// The options every fusetrain optimizer has: lr, weight_decay, maximize,
// max_grad_norm (global L2 norm clipping over all groups; 0 = off),
// master_weights (keep the full value of fp16/bf16 params, in master_form)
// and state_dtype (at::kFloat; at::kBFloat16: the moments in bfloat16,
// written with stochastic rounding; at::kChar: int8 codes with a float32
// scale per block of state_block_size elements, 64, 128 or 256, for params of
// at least 4096 elements, NOTE [8-bit state]). The lean forms (a master_form
// other than Float32, bfloat16 or int8 state) are for the element-wise
// optimizers.
struct FusedCommonOptions {
  virtual ~FusedCommonOptions() = default;
  double lr_ = 1e-3, weight_decay_ = 0.0, max_grad_norm_ = 0.0;
  bool maximize_ = false, master_weights_ = false;
  MasterForm master_form_ = MasterForm::Float32;
  at::ScalarType state_dtype_ = at::kFloat;
  int64_t state_block_size_ = 256;
};

namespace options_detail {
// One option in an archive: written, or read when present.
template <typename T>
void io(torch::serialize::OutputArchive& archive, const char* key, const T& value) {
  archive.write(key, c10::IValue(value));
}
template <typename T>
void io(torch::serialize::InputArchive& archive, const char* key, T& value) {
  c10::IValue v;
  if (archive.try_read(key, v)) value = v.to<T>();
}
// Enumerations travel as their integer values.
inline void io(torch::serialize::OutputArchive& archive, const char* key, const MasterForm& value) {
  archive.write(key, c10::IValue(static_cast<int64_t>(value)));
}
inline void io(torch::serialize::InputArchive& archive, const char* key, MasterForm& value) {
  c10::IValue v;
  if (archive.try_read(key, v)) value = static_cast<MasterForm>(v.toInt());
}
inline void io(torch::serialize::OutputArchive& archive, const char* key, const at::ScalarType& value) {
  archive.write(key, c10::IValue(static_cast<int64_t>(value)));
}
inline void io(torch::serialize::InputArchive& archive, const char* key, at::ScalarType& value) {
  c10::IValue v;
  if (archive.try_read(key, v)) value = static_cast<at::ScalarType>(v.toInt());
}
}  // namespace options_detail

// The options of one optimizer: the common ones here (their setters return
// Derived&, so they chain with its own), its own in Derived, which lists them
// for (de)serialization in `static void fields(Archive&, Self&)`.
template <typename Derived>
struct FusedOptions : torch::optim::OptimizerCloneableOptions<Derived>, FusedCommonOptions {
  explicit FusedOptions(double lr, double weight_decay = 0.0, double max_grad_norm = 0.0) {
    lr_ = lr;
    weight_decay_ = weight_decay;
    max_grad_norm_ = max_grad_norm;
  }
#define FUSETRAIN_COMMON_OPTION(T, name)               \
  Derived& name(const T& value) noexcept {             \
    name##_ = value;                                   \
    return static_cast<Derived&>(*this);               \
  }                                                    \
  const T& name() const noexcept { return name##_; }
  FUSETRAIN_COMMON_OPTION(double, lr)
  FUSETRAIN_COMMON_OPTION(double, weight_decay)
  FUSETRAIN_COMMON_OPTION(bool, maximize)
  FUSETRAIN_COMMON_OPTION(double, max_grad_norm)
  FUSETRAIN_COMMON_OPTION(bool, master_weights)
  FUSETRAIN_COMMON_OPTION(MasterForm, master_form)
  FUSETRAIN_COMMON_OPTION(at::ScalarType, state_dtype)
  FUSETRAIN_COMMON_OPTION(int64_t, state_block_size)
#undef FUSETRAIN_COMMON_OPTION
  double get_lr() const override { return lr_; }
  void set_lr(const double lr) override { lr_ = lr; }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    all_fields(archive, static_cast<const Derived&>(*this));
  }
  void serialize(torch::serialize::InputArchive& archive) override {
    all_fields(archive, static_cast<Derived&>(*this));
  }

 private:
  template <typename Archive, typename Self>
  static void all_fields(Archive& archive, Self& self) {
    options_detail::io(archive, "lr", self.lr_);
    options_detail::io(archive, "weight_decay", self.weight_decay_);
    options_detail::io(archive, "maximize", self.maximize_);
    options_detail::io(archive, "max_grad_norm", self.max_grad_norm_);
    options_detail::io(archive, "master_weights", self.master_weights_);
    options_detail::io(archive, "master_form", self.master_form_);
    options_detail::io(archive, "state_dtype", self.state_dtype_);
    options_detail::io(archive, "state_block_size", self.state_block_size_);
    Derived::fields(archive, self);
  }
};

struct AdamOptions : FusedOptions<AdamOptions> {
  AdamOptions(double lr = 1e-3) : FusedOptions(lr) {}
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, bias_correction) = true;  // false: the BertAdam form

 public:
  template <typename Archive, typename Self>
  static void fields(Archive& archive, Self& self) {
    options_detail::io(archive, "betas", self.betas_);
    options_detail::io(archive, "eps", self.eps_);
    options_detail::io(archive, "amsgrad", self.amsgrad_);
    options_detail::io(archive, "bias_correction", self.bias_correction_);
  }
};

struct AdamWOptions : FusedOptions<AdamWOptions> {
  AdamWOptions(double lr = 1e-3) : FusedOptions(lr, 1e-2) {}
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, bias_correction) = true;  // false: the BertAdam form

 public:
  template <typename Archive, typename Self>
  static void fields(Archive& archive, Self& self) {
    options_detail::io(archive, "betas", self.betas_);
    options_detail::io(archive, "eps", self.eps_);
    options_detail::io(archive, "amsgrad", self.amsgrad_);
    options_detail::io(archive, "bias_correction", self.bias_correction_);
  }
};

struct SGDOptions : FusedOptions<SGDOptions> {
  SGDOptions(double lr = 1e-3) : FusedOptions(lr) {}
  TORCH_ARG(double, momentum) = 0.0;
  TORCH_ARG(double, dampening) = 0.0;
  TORCH_ARG(bool, nesterov) = false;

 public:
  template <typename Archive, typename Self>
  static void fields(Archive& archive, Self& self) {
    options_detail::io(archive, "momentum", self.momentum_);
    options_detail::io(archive, "dampening", self.dampening_);
    options_detail::io(archive, "nesterov", self.nesterov_);
  }
};

struct LionOptions : FusedOptions<LionOptions> {
  LionOptions(double lr = 1e-4) : FusedOptions(lr) {}
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.99);

 public:
  template <typename Archive, typename Self>
  static void fields(Archive& archive, Self& self) {
    options_detail::io(archive, "betas", self.betas_);
  }
};

struct RMSpropOptions : FusedOptions<RMSpropOptions> {
  RMSpropOptions(double lr = 1e-2) : FusedOptions(lr) {}
  TORCH_ARG(double, alpha) = 0.99;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, momentum) = 0.0;
  TORCH_ARG(bool, centered) = false;
  // timm's RMSpropTF (TensorFlow's form, NOTE [rmsprop tf] in csrc/common/rms_math.h): square_avg starts at 1;
  // lr_in_momentum and decoupled_weight_decay need it. Its usual settings: alpha 0.9, eps 1e-10 (or 1e-3),
  // lr_in_momentum true.
  TORCH_ARG(bool, tf_style) = false;
  TORCH_ARG(bool, lr_in_momentum) = false;
  TORCH_ARG(bool, decoupled_weight_decay) = false;

 public:
  template <typename Archive, typename Self>
  static void fields(Archive& archive, Self& self) {
    options_detail::io(archive, "alpha", self.alpha_);
    options_detail::io(archive, "eps", self.eps_);
    options_detail::io(archive, "momentum", self.momentum_);
    options_detail::io(archive, "centered", self.centered_);
    options_detail::io(archive, "tf_style", self.tf_style_);
    options_detail::io(archive, "lr_in_momentum", self.lr_in_momentum_);
    options_detail::io(archive, "decoupled_weight_decay", self.decoupled_weight_decay_);
  }
};

struct AdadeltaOptions : FusedOptions<AdadeltaOptions> {
  AdadeltaOptions(double lr = 1.0) : FusedOptions(lr) {}
  TORCH_ARG(double, rho) = 0.9;
  TORCH_ARG(double, eps) = 1e-6;

 public:
  template <typename Archive, typename Self>
  static void fields(Archive& archive, Self& self) {
    options_detail::io(archive, "rho", self.rho_);
    options_detail::io(archive, "eps", self.eps_);
  }
};

struct RAdamOptions : FusedOptions<RAdamOptions> {
  RAdamOptions(double lr = 1e-3) : FusedOptions(lr) {}
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(bool, decoupled_weight_decay) = false;

 public:
  template <typename Archive, typename Self>
  static void fields(Archive& archive, Self& self) {
    options_detail::io(archive, "betas", self.betas_);
    options_detail::io(archive, "eps", self.eps_);
    options_detail::io(archive, "decoupled_weight_decay", self.decoupled_weight_decay_);
  }
};

struct NAdamOptions : FusedOptions<NAdamOptions> {
  NAdamOptions(double lr = 2e-3) : FusedOptions(lr) {}
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, momentum_decay) = 4e-3;
  TORCH_ARG(bool, decoupled_weight_decay) = false;

 public:
  template <typename Archive, typename Self>
  static void fields(Archive& archive, Self& self) {
    options_detail::io(archive, "betas", self.betas_);
    options_detail::io(archive, "eps", self.eps_);
    options_detail::io(archive, "momentum_decay", self.momentum_decay_);
    options_detail::io(archive, "decoupled_weight_decay", self.decoupled_weight_decay_);
  }
};

// Lamb with timm's semantics and defaults (NOTE [apply pass] in
// csrc/ops/aten_stage.h); its built-in clipping is max_grad_norm (default 1).
// corrected_weight_decay scales the decoupled decay by lr / defaults().lr().
struct LambOptions : FusedOptions<LambOptions> {
  LambOptions(double lr = 1e-3) : FusedOptions(lr, 0.01, 1.0) {}
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(bool, bias_correction) = true;
  TORCH_ARG(bool, grad_averaging) = true;
  TORCH_ARG(bool, trust_clip) = false;
  TORCH_ARG(bool, always_adapt) = false;
  TORCH_ARG(bool, caution) = false;
  TORCH_ARG(bool, decoupled_weight_decay) = false;
  TORCH_ARG(bool, corrected_weight_decay) = false;

 public:
  template <typename Archive, typename Self>
  static void fields(Archive& archive, Self& self) {
    options_detail::io(archive, "betas", self.betas_);
    options_detail::io(archive, "eps", self.eps_);
    options_detail::io(archive, "bias_correction", self.bias_correction_);
    options_detail::io(archive, "grad_averaging", self.grad_averaging_);
    options_detail::io(archive, "trust_clip", self.trust_clip_);
    options_detail::io(archive, "always_adapt", self.always_adapt_);
    options_detail::io(archive, "caution", self.caution_);
    options_detail::io(archive, "decoupled_weight_decay", self.decoupled_weight_decay_);
    options_detail::io(archive, "corrected_weight_decay", self.corrected_weight_decay_);
  }
};

// AdamP with timm's semantics and defaults (NOTE [adamp projection] in
// csrc/ops/fused_adamp.cpp).
struct AdamPOptions : FusedOptions<AdamPOptions> {
  AdamPOptions(double lr = 1e-3) : FusedOptions(lr) {}
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, delta) = 0.1;
  TORCH_ARG(double, wd_ratio) = 0.1;
  TORCH_ARG(bool, nesterov) = false;

 public:
  template <typename Archive, typename Self>
  static void fields(Archive& archive, Self& self) {
    options_detail::io(archive, "betas", self.betas_);
    options_detail::io(archive, "eps", self.eps_);
    options_detail::io(archive, "delta", self.delta_);
    options_detail::io(archive, "wd_ratio", self.wd_ratio_);
    options_detail::io(archive, "nesterov", self.nesterov_);
  }
};

// Muon (torch.optim.Muon's update, NOTE [muon apply] in csrc/ops/fused_muon.cpp)
// for the params of use_muon groups (2 or more dims each; a convolution filter
// is the matrix out_channels x the rest), AdamW with adamw_betas, adamw_eps and
// the group's lr and weight_decay for the params of the others: give biases,
// norms and embeddings a group with use_muon(false). adjust_lr_fn: "original"
// or "match_rms_adamw" (then one lr suits both kinds). maximize is not
// supported (an error when true).
struct MuonOptions : FusedOptions<MuonOptions> {
  MuonOptions(double lr = 1e-3) : FusedOptions(lr, 0.1) {}
  typedef std::tuple<double, double> betas_t;
  typedef std::tuple<double, double, double> coefficients_t;
  TORCH_ARG(double, momentum) = 0.95;
  TORCH_ARG(bool, nesterov) = true;
  TORCH_ARG(coefficients_t, ns_coefficients) = std::make_tuple(3.4445, -4.775, 2.0315);
  TORCH_ARG(double, eps) = 1e-7;
  TORCH_ARG(int64_t, ns_steps) = 5;
  TORCH_ARG(std::string, adjust_lr_fn) = "original";
  TORCH_ARG(bool, use_muon) = true;
  TORCH_ARG(betas_t, adamw_betas) = std::make_tuple(0.9, 0.95);
  TORCH_ARG(double, adamw_eps) = 1e-8;

 public:
  template <typename Archive, typename Self>
  static void fields(Archive& archive, Self& self) {
    options_detail::io(archive, "momentum", self.momentum_);
    options_detail::io(archive, "nesterov", self.nesterov_);
    options_detail::io(archive, "ns_coefficients", self.ns_coefficients_);
    options_detail::io(archive, "eps", self.eps_);
    options_detail::io(archive, "ns_steps", self.ns_steps_);
    options_detail::io(archive, "adjust_lr_fn", self.adjust_lr_fn_);
    options_detail::io(archive, "use_muon", self.use_muon_);
    options_detail::io(archive, "adamw_betas", self.adamw_betas_);
    options_detail::io(archive, "adamw_eps", self.adamw_eps_);
  }
};

// The state tensors of one step, flattened over groups in the layout of
// fusetrain::fused_step_ (NOTE [group records] in csrc/ops/fused_step.cpp).
struct FusedLists {
  std::vector<at::Tensor> params, grads, steps, masters, emas, state1, state2, state3;
  std::vector<at::Tensor> ema_rems;  // NOTE [ema remainder]: one per bfloat16 EMA tensor with a remainder
  std::vector<at::Tensor> scales;    // NOTE [8-bit state]: fused_step_'s state_scales
};

// An optimizer's own fields of a group record, by name (NOTE [kind table] in
// csrc/ops/optim_kind.h): the kind table orders them.
using KindValues = std::vector<std::pair<const char*, double>>;

namespace detail {
struct KindSpec;
}

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

  // NOTE [stalled updates] (csrc/common/lean_state.h): with `enabled`, every
  // step adds to a 0-d int64 device tensor the updates that float16/bfloat16
  // params kept without a master lose (their stored value unchanged although
  // the step computed another); returns it (also stalled_updates()). Read it
  // when you want the number, zero_() it to start over; no step waits for
  // it. The element-wise optimizers count; the params must share a device.
  // false stops counting (an undefined tensor).
  at::Tensor track_stalled_updates(bool enabled = true);
  const at::Tensor& stalled_updates() const { return stalled_; }

  // Refills each group's lr tensor and values tensor (its schedulable
  // settings: betas, momentum, weight decay, eps, ...; NOTE [device values]
  // in csrc/common/update_args.h) where the group's options changed since the
  // last step, checking them first (step() does this itself).
  // fusetrain::TrainStep calls it before replaying a captured step, so set_lr,
  // LR schedulers and schedules of those settings apply without a recapture.
  // Not to be called while a CUDA graph is being captured.
  void refresh_device_values();

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
  // Whether its update pass carries EMA remainders (NOTE [ema remainder]): the
  // element-wise optimizers' does.
  bool carries_ema_remainders() const;

 protected:
  // The optimizer's kind in the kind table ("adam", "sgd", ...) and a group's
  // record: the common fields come from its FusedCommonOptions, the rest, by
  // name, from kind_fields. The state a group keeps is the kind's (the table's).
  virtual const char* kind() const = 0;
  virtual void kind_fields(const torch::optim::OptimizerOptions& o, KindValues& values) const = 0;
  // Checks kind_fields against the kind table (each field named once); every
  // constructor calls it.
  void check_kind();

 private:
  // A group's own record fields in the kind table's order.
  std::vector<double> kind_record(const torch::optim::OptimizerOptions& o) const;
  // Creates the states that the kind keeps for a group with these fields.
  void init_state(FusedParamState& s, const at::Tensor& p, const double* fields,
                  const FusedCommonOptions& options) const;
  // Refuses lean options (NOTE [lean state]) this optimizer's kind cannot take.
  void check_lean(const FusedCommonOptions& options) const;
  // The lr (0-d float32) and schedulable fields (float64 vector, undefined
  // when the kind has none) of (group, device) as device tensors, refilled
  // only where they change (no allocation per step).
  struct DeviceScalars {
    at::Tensor lr, values;
    double lr_value = 0.0;
    std::vector<double> values_now;
  };
  const DeviceScalars& device_scalars(size_t group, const at::Device& dev, double lr,
                                      const std::vector<double>& fields);
  // The state of p, created or moved to p's device where needed; while
  // capturing, raises instead when anything would be created or moved.
  FusedParamState& ensure_state(const at::Tensor& p, const torch::optim::OptimizerOptions& opts,
                                const std::vector<double>& fields, bool capturing);
  void ensure_results(const at::Device& dev, bool capturing);
  at::Tensor last_grad_norm_, last_found_inf_, stalled_;
  ModelEMA* ema_ = nullptr;
  std::map<std::pair<size_t, std::string>, DeviceScalars> device_cache_;
  const detail::KindSpec* spec_ = nullptr;
  std::vector<int> field_slot_;  // the table position of each kind_fields value
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
    void kind_fields(const torch::optim::OptimizerOptions& o, KindValues& values) const override;              \
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
