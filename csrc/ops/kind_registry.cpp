// The run-time kind table (NOTE [kind table] in kind_registry.h), the
// element-wise kinds' run and the update-kernel registry.
#include "kind_registry.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>

#include "kind_specs.h"

namespace fusetrain {
namespace detail {
namespace {

// Function-local statics: the kernel files and composite kinds register at
// load time, in any order.
std::map<std::string, std::unique_ptr<KindSpec>>& kinds() {
  static std::map<std::string, std::unique_ptr<KindSpec>> table = [] {
    std::map<std::string, std::unique_ptr<KindSpec>> t;
    for (KindSpec& spec : declared_kinds()) {
      for (size_t i = 0; i < spec.fields.size(); ++i)
        if (spec.fields[i].schedulable) spec.value_positions.push_back(static_cast<int>(i));
      TORCH_INTERNAL_ASSERT(spec.kernel_kind < 0 || spec.fields.size() <= static_cast<size_t>(kMaxKindFields),
                            "kind '", spec.name, "' has more fields than OptimHyper holds");
      t[spec.name] = std::make_unique<KindSpec>(std::move(spec));
    }
    return t;
  }();
  return table;
}
std::map<c10::DeviceType, UpdateKernel>& kernels() {
  static std::map<c10::DeviceType, UpdateKernel> table;
  return table;
}

bool holds(const KindSpec& spec, const KindState& s, const double* fields) {
  if (s.when == nullptr) return true;
  return (fields[spec.field_index(s.when)] != 0.0) == s.when_set;
}

// The choices of a choice field, as "'a', 'b'".
std::string choice_list(const char* choices) {
  std::string out = "'";
  for (const char* c = choices; *c != '\0'; ++c) out += *c == '|' ? std::string("', '") : std::string(1, *c);
  return out + "'";
}

bool rule_holds(const char* op, double v, double bound) {
  if (std::strcmp(op, ">") == 0) return v > bound;
  if (std::strcmp(op, "==") == 0) return v == bound;
  TORCH_INTERNAL_ASSERT(std::strcmp(op, "!=") == 0, "unknown rule operator '", op, "'");
  return v != bound;
}

// An element-wise kind: its record is the kernel's fields; its schedulable
// fields come from the values tensor when there is one; a scalar state rides
// beside the step (NOTE [tensor scalars]).
void run_elementwise(const KindCall& c) {
  const KindSpec& spec = *c.spec;
  OptimHyper h;
  h.kind = static_cast<OptimKind>(spec.kernel_kind);
  std::copy(c.fields, c.fields + spec.fields.size(), h.fields);
  if (c.values.defined()) {
    h.values.count = static_cast<int>(spec.value_positions.size());
    std::copy(spec.value_positions.begin(), spec.value_positions.end(), h.values.field);
  }
  at::TensorList slots[3], aux;
  for (int k = 0; k < 3; ++k) {
    const KindState* s = spec.slot_state(c.fields, k);
    if (s == nullptr) continue;
    (s->scalar ? aux : slots[k]) = c.state[k];
  }
  run_kind_update(c, h, slots[0], slots[1], slots[2], aux);
}

}  // namespace

int KindSpec::field_index(const char* field) const {
  for (size_t i = 0; i < fields.size(); ++i)
    if (std::strcmp(fields[i].name, field) == 0) return static_cast<int>(i);
  return -1;
}

const KindState* KindSpec::slot_state(const double* f, int k) const {
  for (const auto& s : states)
    if (s.slot == k && holds(*this, s, f)) return &s;
  return nullptr;
}

double KindSpec::initial_value(const KindState& s, const double* f) const {
  if (s.initial_when == nullptr) return s.initial;
  return f[field_index(s.initial_when)] != 0.0 ? s.initial : 0.0;
}

void KindSpec::check(const std::string& op, const double* f) const {
  for (size_t i = 0; i < fields.size(); ++i) {
    const KindField& d = fields[i];
    const double v = f[i];
    const char* name = d.name;
    if (std::strcmp(d.type, "flag") == 0) {
      TORCH_CHECK_VALUE(v == 0.0 || v == 1.0, op, ": ", name, " must be 0 or 1, got ", v);
      continue;
    }
    if (std::strcmp(d.type, "choice") == 0) {
      TORCH_CHECK_VALUE(v >= 0.0 && v < d.high && v == std::floor(v), op, ": ", name, " must be the index of one of ",
                        choice_list(d.choices), " (0 to ", d.high - 1, "), got ", v);
      continue;
    }
    const bool integral = std::strcmp(d.type, "int") == 0;
    TORCH_CHECK_VALUE(!integral || v == std::floor(v), op, ": ", name, " must be an integer, got ", v);
    // No record field takes NaN or an infinity (a lr-free setting at infinity is no setting either).
    if (std::isinf(d.low) && d.low < 0) {
      TORCH_CHECK_VALUE(std::isfinite(v), op, ": ", name, " must be a finite number, got ", v);
      continue;
    }
    const bool bounded = !std::isinf(d.high);
    const bool ok = v >= d.low && (!bounded || (d.high_closed ? v <= d.high : v < d.high));
    if (bounded) {
      TORCH_CHECK_VALUE(ok, op, ": ", name, " must be in [", d.low, ", ", d.high, d.high_closed ? "]" : ")", ", got ",
                        v);
    }
    TORCH_CHECK_VALUE(ok, op, ": ", name, " must be >= ", d.low, ", got ", v);
    TORCH_CHECK_VALUE(std::isfinite(v), op, ": ", name, " must be a finite number >= ", d.low, ", got ", v);
  }
  for (const auto& r : rules) {
    if (f[field_index(r.when)] == 0.0) continue;
    const double v = f[field_index(r.field)];
    TORCH_CHECK_VALUE(rule_holds(r.op, v, r.value), op, ": ", r.when, " needs ", r.field, " ", r.op, " ", r.value,
                      ", got ", r.field, "=", v);
  }
}

void KindSpec::check_params(const std::string& op, const double* f, at::TensorList params) const {
  for (const auto& r : param_rules) {
    if (f[field_index(r.when)] == 0.0) continue;
    for (size_t i = 0; i < params.size(); ++i)
      TORCH_CHECK_VALUE(params[i].dim() >= r.min_dim, op, ": params[", i, "] has shape ", params[i].sizes(), "; ",
                        r.hint);
  }
}

double KindRecord::operator[](const char* name) const {
  const int i = spec->field_index(name);
  TORCH_INTERNAL_ASSERT(i >= 0, "kind '", spec->name, "' has no field '", name, "'");
  return fields[i];
}

const KindSpec& find_kind(const std::string& name) {
  const auto it = kinds().find(name);
  if (it != kinds().end()) return *it->second;
  std::ostringstream known;
  for (const auto& [n, _] : kinds()) known << (known.tellp() > 0 ? ", '" : "'") << n << "'";
  TORCH_CHECK_VALUE(false, "fused_step_: optimizer must be one of ", known.str(), ", got '", name, "'");
}

std::vector<const KindSpec*> all_kinds() {
  std::vector<const KindSpec*> out;
  for (const auto& [_, spec] : kinds()) out.push_back(spec.get());
  return out;
}

const char* optim_table_digest() { return kOptimTableDigest; }

bool set_kind_run(const char* name, void (*run)(const KindCall& call)) {
  const auto it = kinds().find(name);
  TORCH_INTERNAL_ASSERT(it != kinds().end() && it->second->kernel_kind < 0 && it->second->run == nullptr,
                        "set_kind_run: '", name, "' is no composite kind of the table, or has its run");
  it->second->run = run;
  return true;
}

void run_kind(const KindCall& call) {
  if (call.spec->kernel_kind >= 0) return run_elementwise(call);
  TORCH_INTERNAL_ASSERT(call.spec->run != nullptr, "kind '", call.spec->name, "' has no run function");
  call.spec->run(call);
}

void register_update_kernel(c10::DeviceType type, UpdateKernel kernel) { kernels()[type] = kernel; }

UpdateKernel update_kernel(c10::DeviceType type) {
  const auto it = kernels().find(type);
  TORCH_CHECK(it != kernels().end(), "fused_step_: params are on ", type, ", for which this build has no kernels");
  return it->second;
}

void run_kind_update(const KindCall& c, OptimHyper h, at::TensorList s1, at::TensorList s2, at::TensorList s3,
                     at::TensorList aux) {
  UpdateLists l;
  for (int k = 0; k < 3; ++k) {
    if (const KindState* s = c.spec->slot_state(c.fields, k)) l.state_names[k] = s->name;
  }
  l.params = c.params.vec();
  l.grads = c.grads.vec();
  l.state1 = s1.vec();
  l.state2 = s2.vec();
  l.state3 = s3.vec();
  const at::TensorList given[3] = {s1, s2, s3};
  for (int k = 0; k < 3; ++k) {
    if (!given[k].empty() && !c.scales[k].empty()) l.scales[k] = c.scales[k].vec();
  }
  l.steps = c.steps.vec();
  l.aux = aux.vec();
  for (const auto& s : c.spec->states)
    if (s.scalar) l.aux_name = s.name;
  l.master = c.masters.vec();
  l.ema = c.emas.vec();
  l.ema_rem = c.ema_rems;
  h.maximize = c.maximize;
  h.max_grad_norm = c.max_grad_norm;
  h.stochastic_params = c.master_mode == MasterMode::Stochastic;
  UpdateScalars sc{c.lr, opt_or_undef(c.inv_scale), opt_or_undef(c.found_inf), opt_or_undef(c.grad_norm),
                   opt_or_undef(c.ema_decay), h.values.count > 0 ? c.values : at::Tensor(), c.stalled};
  run_fused_update(c.op, l, h, sc, c.kernel);
}

}  // namespace detail
}  // namespace fusetrain
