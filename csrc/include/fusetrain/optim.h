// fusetrain's fused optimizers for LibTorch programs.
//
// The optimizer table's classes (e.g. fusetrain::AdamW, SGD, Muon: their
// options and classes are in fusetrain/optim_table.h, generated from the
// table) derive from torch::optim::Optimizer, so they plug into LibTorch
// loops, LR schedulers (which go through options().get_lr()/set_lr()) and
// torch::save/torch::load of optimizer state.
// Each step runs fusetrain's multi-tensor kernels (one pass over all params of
// a group); clipping, the skip on non-finite gradients, loss unscaling and an
// attached EMA are folded into the same pass without any host-device sync.
#pragma once

#include <fusetrain/ops.h>

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace fusetrain {

class ModelEMA;

struct FusedParamState;  // fusetrain/optim_table.h

// How master_weights keeps the full value of fp16/bf16 params (NOTE [lean
// state] in csrc/common/lean_state.h): an fp32 copy in the state's `master`,
// an int16 remainder there beside a bfloat16 param (together the exact fp32
// value), or none, the param written with stochastic rounding (bfloat16).
enum class MasterForm : int64_t { Float32 = 1, Remainder = 2, Stochastic = 3 };

// The options every fusetrain optimizer has: lr, maximize,
// max_grad_norm (global L2 norm clipping over all groups; 0 = off),
// master_weights (keep the full value of fp16/bf16 params, in master_form)
// and state_dtype (at::kFloat; at::kBFloat16: the moments in bfloat16,
// written with stochastic rounding; at::kChar: int8 codes with a float32
// scale per block of state_block_size elements, 64, 128 or 256, for params of
// at least 4096 elements, NOTE [8-bit state]). The lean forms (a master_form
// other than Float32, bfloat16 or int8 state) are for the element-wise
// optimizers.
// Each written once, here, as X(type, name, default): the members below,
// FusedOptions' accessors and its serialization expand this list.
#define FUSETRAIN_COMMON_OPTIONS(X)                 \
  X(double, lr, 1e-3)                               \
  X(bool, maximize, false)                          \
  X(double, max_grad_norm, 0.0)                     \
  X(bool, master_weights, false)                    \
  X(MasterForm, master_form, MasterForm::Float32)   \
  X(at::ScalarType, state_dtype, at::kFloat)        \
  X(int64_t, state_block_size, 256)
struct FusedCommonOptions {
  virtual ~FusedCommonOptions() = default;
#define FUSETRAIN_COMMON_MEMBER(T, name, initial) T name##_ = initial;
  FUSETRAIN_COMMON_OPTIONS(FUSETRAIN_COMMON_MEMBER)
#undef FUSETRAIN_COMMON_MEMBER
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
// The record value of a choice option: the index of `value` among `choices` ("a|b|..."; `allowed` says them).
inline double choice(const char* option, const std::string& value, const std::string& choices, const char* allowed) {
  size_t start = 0;
  for (int index = 0; start <= choices.size(); ++index) {
    const size_t end = std::min(choices.find('|', start), choices.size());
    if (choices.compare(start, end - start, value) == 0 && value.size() == end - start) return index;
    start = end + 1;
  }
  TORCH_CHECK_VALUE(false, option, " must be one of ", allowed, ", got '", value, "'");
}
}  // namespace options_detail

// The options of one optimizer: the common ones here (their setters return
// Derived&, so they chain with its own), its own in Derived (generated from
// the optimizer table), which lists them for (de)serialization in
// `static void fields(Archive&, Self&)`.
template <typename Derived>
struct FusedOptions : torch::optim::OptimizerCloneableOptions<Derived>, FusedCommonOptions {
  explicit FusedOptions(double lr) { lr_ = lr; }
#define FUSETRAIN_COMMON_OPTION(T, name, initial)      \
  Derived& name(const T& value) noexcept {             \
    name##_ = value;                                   \
    return static_cast<Derived&>(*this);               \
  }                                                    \
  const T& name() const noexcept { return name##_; }
  FUSETRAIN_COMMON_OPTIONS(FUSETRAIN_COMMON_OPTION)
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
#define FUSETRAIN_COMMON_IO(T, name, initial) options_detail::io(archive, #name, self.name##_);
    FUSETRAIN_COMMON_OPTIONS(FUSETRAIN_COMMON_IO)
#undef FUSETRAIN_COMMON_IO
    Derived::fields(archive, self);
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
// csrc/ops/kind_registry.h): the kind table orders them.
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
  // Detaches the attached ModelEMA, which would otherwise keep a pointer to
  // this optimizer and reach it from its own detach() or destructor.
  ~FusedOptimizer() override;

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
  // in csrc/common/update_launch.h) where the group's options changed since the
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
  // Checks kind_fields against the kind table (each field named once) and the
  // options of every group: lr and max_grad_norm >= 0, maximize where `name`
  // takes it, the table's allowed values, rules and param rules (a
  // c10::ValueError naming `name`, the option and the value). Every
  // constructor calls it.
  void check_kind(const char* name, bool takes_maximize = true);

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

// The optimizer of a class of the optimizer table: its Options (generated in
// fusetrain/optim_table.h) say its kind, its record and its options.
template <typename Options>
class TableOptimizer : public FusedOptimizer {
 public:
  explicit TableOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, Options defaults = {})
      : FusedOptimizer(param_groups, std::make_unique<Options>(defaults)) {
    check_kind(Options::kName, Options::kMaximize);
  }
  explicit TableOptimizer(std::vector<at::Tensor> params, Options defaults = {})
      : TableOptimizer(std::vector<torch::optim::OptimizerParamGroup>{
                           torch::optim::OptimizerParamGroup(std::move(params))},
                       std::move(defaults)) {}
  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<FusedParamState, Options>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<FusedParamState, Options>(archive, *this);
  }

 protected:
  const char* kind() const override { return Options::kKind; }
  void kind_fields(const torch::optim::OptimizerOptions& o, KindValues& values) const override {
    static_cast<const Options&>(o).record(values, defaults().get_lr());
  }
};

}  // namespace fusetrain

#include <fusetrain/optim_table.h>
