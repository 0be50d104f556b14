// The run-time kind table of fusetrain::fused_step_: each optimizer kind's
// entry, looked up by name.
//
// NOTE [kind table]: an entry (generated into kind_specs.h from the optimizer
// table, NOTE [optimizer table] in python/fusetrain/optim/_table.py) names the
// fields of a kind's group record in order (after the common fields of NOTE
// [group records] in fused_step.cpp) with their defaults and allowed values,
// the per-param state it keeps in the slots state1..3 and when, the rules
// between its fields and its params. fused_step_ slices its lists by it and
// checks every record against it; an element-wise kind runs through one
// generic run (run_kind: its record becomes the fields of the fused update
// kernel, kind_dispatch.h), a composite kind through the run function its
// file sets (set_kind_run, csrc/ops/fused_<kind>.cpp). A kind's schedulable
// fields are read on the device (NOTE [device values] in
// csrc/common/update_launch.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "../common/lean_state.h"
#include "../common/op_kernels.h"
#include "../common/update_launch.h"

namespace fusetrain {
namespace detail {

struct KindField {
  const char* name;
  const char* type;  // "real", "flag" (0 or 1), "int" or "choice" (the index of its option's value)
  double default_value;
  double low, high;   // allowed: [low, high), or [low, high] when high_closed; low -inf: any number
  bool high_closed;
  bool schedulable;   // read on the device from the group's values tensor (NOTE [device values])
  const char* choices;  // a choice field: its option's values, "a|b|..."; else null
  const char* doc;
};

// A per-param state tensor of slot state1..3, kept when the field `when` is
// non-zero (when_set) or zero (!when_set); `when` null: always. It starts at
// `initial` (when the field `initial_when` is non-zero, if named; else at 0).
struct KindState {
  int slot;
  const char* name;
  const char* when;
  bool when_set;
  bool scalar;  // a 0-d float32 tensor beside the step (NOTE [tensor scalars])
  double initial;
  const char* initial_when;
};

// When the field `when` is non-zero, field `field` must be `op` (">", "==", "!=") `value`.
struct KindRule {
  const char* when;
  const char* field;
  const char* op;
  double value;
};

// When the field `when` is non-zero, every param has at least `min_dim` dims.
struct KindParamRule {
  const char* when;
  int min_dim;
  const char* hint;  // what to do instead
};

struct KindSpec;

// A group record's own fields (after the common ones), read by name.
struct KindRecord {
  const KindSpec* spec = nullptr;
  const double* fields = nullptr;

  // The field `name` (a name the kind's entry declares).
  double operator[](const char* name) const;
  bool flag(const char* name) const { return (*this)[name] != 0.0; }
};

// One group's update: its record, its slices of fused_step_'s lists and tail.
struct KindCall : KindRecord {
  const char* op = "fused_step_";
  UpdateKernel kernel = nullptr;
  at::TensorList params, grads, steps, state[3], masters, emas;
  at::TensorList scales[3];  // NOTE [8-bit state]: per param of state[k]; undefined for a non-int8 state
  std::vector<at::Tensor> ema_rems;  // NOTE [ema remainder]: per ema entry, or empty; undefined: none
  at::Tensor lr;
  at::Tensor values;  // the group's schedulable fields on its device (NOTE [device values]); undefined: the record's
  bool maximize = false;
  MasterMode master_mode = MasterMode::None;  // the group's master_weights (NOTE [lean state])
  OptT inv_scale, found_inf, grad_norm, ema_decay;
  at::Tensor stalled;  // NOTE [stalled updates]; undefined: not counted
  double max_grad_norm = 0.0;
};

struct KindSpec {
  const char* name = nullptr;
  const char* doc = nullptr;
  std::vector<KindField> fields;
  std::vector<KindState> states;
  std::vector<KindRule> rules;
  std::vector<KindParamRule> param_rules;
  // Whether it takes lean state (NOTE [lean state] in csrc/common/lean_state.h):
  // remainder or stochastic masters and bfloat16 or int8 state.
  bool lean = false;
  // An element-wise kind's OptimKind (its record is the kernel's fields); -1: a composite kind.
  int kernel_kind = -1;
  // A composite kind's run (set_kind_run); null for an element-wise one.
  void (*run)(const KindCall& call) = nullptr;
  // The positions in `fields` of the schedulable fields, in order (the layout
  // of a group's values tensor); filled when the table is built.
  std::vector<int> value_positions{};

  int field_index(const char* field) const;  // -1 when absent
  // Whether a group with these fields keeps state slot k (0..2).
  bool uses_slot(const double* fields, int k) const { return slot_state(fields, k) != nullptr; }
  // The state a group with these fields keeps in slot k, or null.
  const KindState* slot_state(const double* fields, int k) const;
  // The value a state of a group with these fields starts at.
  double initial_value(const KindState& state, const double* fields) const;
  // Checks a record's fields (their allowed values and the rules): a
  // ValueError naming the field otherwise; `op` names the caller.
  void check(const std::string& op, const double* fields) const;
  // Checks a group's params against the param rules (`fields`: its record).
  void check_params(const std::string& op, const double* fields, at::TensorList params) const;
};

// The kind named `name`, or a ValueError listing the kinds.
const KindSpec& find_kind(const std::string& name);
// Every kind, in name order.
std::vector<const KindSpec*> all_kinds();
// The digest of the optimizer table the kind table was generated from.
const char* optim_table_digest();
// Sets a composite kind's run function (from the kind's file, at load time); returns true.
bool set_kind_run(const char* name, void (*run)(const KindCall& call));
// Runs one group's update: the composite kind's run, or an element-wise kind's.
void run_kind(const KindCall& call);

// What an element-wise kind does with its call (and the composite kinds with
// their passes): the lists and tail into UpdateLists/UpdateScalars, then
// run_fused_update. `s1..s3`: the slots the hyper's kind reads, empty where
// unused; `aux`: NOTE [tensor scalars].
void run_kind_update(const KindCall& c, OptimHyper h, at::TensorList s1, at::TensorList s2, at::TensorList s3,
                     at::TensorList aux = {});

}  // namespace detail
}  // namespace fusetrain
