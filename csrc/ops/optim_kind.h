// The optimizer kinds of fusetrain::fused_step_: one table entry per kind,
// declared once, in the kind's own file (csrc/ops/fused_<kind>.cpp).
//
// NOTE [kind table]: a kind's entry names the fields of its group record (in
// order, after the common fields of NOTE [group records] in fused_step.cpp),
// the per-param state it keeps in the slots state1..3 and when, the checks of
// a record, and the function that runs one group's update. Everything else
// reads the layout from here: fused_step_ slices its lists by it, the
// front ends build records by field name (fusetrain._C.optim_kinds() in
// Python; FusedOptimizer's check at construction in C++), and the record
// section of docs/ops.md is generated from it. A kind whose entry marks its
// real fields schedulable has them read on the device (NOTE [device values]
// in csrc/common/update_args.h): its update binds each of them to a member
// of the kernel arguments (bind_values).
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "../common/lean_state.h"
#include "../common/update_args.h"

namespace fusetrain {
namespace detail {

struct KindField {
  const char* name;
  const char* type;  // "real", "flag" (0 or 1) or "int"
  const char* doc;
};

// A per-param state tensor of slot state1..3, kept when the field `when` is
// non-zero (when_set) or zero (!when_set); `when` null: always. It starts at
// `initial` (when the field `initial_when` is non-zero, if named; else at 0).
struct KindState {
  int slot;
  const char* name;
  const char* when = nullptr;
  bool when_set = true;
  bool scalar = false;  // a 0-d float32 tensor beside the step (NOTE [tensor scalars])
  double initial = 0.0;
  const char* initial_when = nullptr;
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
  at::Tensor values;  // the group's schedulable fields (NOTE [device values]); undefined: the record's
  bool maximize = false;
  MasterMode master_mode = MasterMode::None;  // the group's master_weights (NOTE [lean state])
  OptT inv_scale, found_inf, grad_norm, ema_decay;
  at::Tensor stalled;  // NOTE [stalled updates]; undefined: not counted
  double max_grad_norm = 0.0;
};

struct KindSpec {
  const char* name;
  const char* doc;
  std::vector<KindField> fields;
  std::vector<KindState> states;
  // Checks a record's fields; `op` names the caller in messages.
  void (*check)(const std::string& op, const KindRecord& record);
  void (*run)(const KindCall& call);
  // Whether its "real" fields are schedulable: read on the device from the
  // group's values tensor, in the order of `fields`.
  bool schedulable = false;
  // Whether it takes lean state (NOTE [lean state] in csrc/common/lean_state.h):
  // remainder or stochastic masters and bfloat16 moments.
  bool lean = false;
  // The positions in `fields` of the schedulable fields, in order (the layout
  // of a group's values tensor); filled by register_kind.
  std::vector<int> value_positions{};

  int field_index(const char* field) const;  // -1 when absent
  // Whether a group with these fields keeps state slot k (0..2).
  bool uses_slot(const double* fields, int k) const { return slot_state(fields, k) != nullptr; }
  // The state a group with these fields keeps in slot k, or null.
  const KindState* slot_state(const double* fields, int k) const;
  // The value a state of a group with these fields starts at.
  double initial_value(const KindState& state, const double* fields) const;
};

// Adds a kind to the table (at load time, from the kind's file); returns it.
const KindSpec& register_kind(KindSpec spec);
// The kind named `name`, or a ValueError listing the kinds.
const KindSpec& find_kind(const std::string& name);
// Every kind, in name order.
std::vector<const KindSpec*> all_kinds();

// Checks that field `name` is in [low, high) (no upper bound when high is
// infinite, closed when high_closed): a ValueError naming the field otherwise.
void check_in(const std::string& op, const KindRecord& r, const char* name, double low,
              double high = std::numeric_limits<double>::infinity(), bool high_closed = false);

// Sets each member (a double inside `h`) to the record's field of its name
// and, when the call has a values tensor, binds it to that field's entry
// there (NOTE [device values]). Every schedulable field must be bound.
void bind_values(const KindCall& c, OptimHyper& h, std::initializer_list<std::pair<const char*, double&>> members);

// What an element-wise kind does with its call: the lists and tail into
// UpdateLists/UpdateScalars, then run_fused_update. `states`: the slots the
// hyper's kind reads, empty where unused; `aux`: NOTE [tensor scalars].
void run_kind_update(const KindCall& c, OptimHyper h, at::TensorList s1, at::TensorList s2, at::TensorList s3,
                     at::TensorList aux = {});

}  // namespace detail
}  // namespace fusetrain
