// The kind table and the update-kernel registry (NOTE [kind table] in
// optim_kind.h).
#include "optim_kind.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>

namespace fusetrain {
namespace detail {
namespace {

// Function-local statics: the kind files register at load time, in any order.
std::map<std::string, std::unique_ptr<KindSpec>>& kinds() {
  static std::map<std::string, std::unique_ptr<KindSpec>> table;
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

double KindRecord::operator[](const char* name) const {
  const int i = spec->field_index(name);
  TORCH_INTERNAL_ASSERT(i >= 0, "kind '", spec->name, "' has no field '", name, "'");
  return fields[i];
}

void check_in(const std::string& op, const KindRecord& r, const char* name, double low, double high,
              bool high_closed) {
  const double v = r[name];
  const bool bounded = high != std::numeric_limits<double>::infinity();
  const bool ok = v >= low && (!bounded || (high_closed ? v <= high : v < high));
  if (bounded) {
    TORCH_CHECK_VALUE(ok, op, ": ", name, " must be in [", low, ", ", high, high_closed ? "]" : ")", ", got ", v);
  }
  TORCH_CHECK_VALUE(ok, op, ": ", name, " must be >= ", low, ", got ", v);
}

const KindSpec& register_kind(KindSpec spec) {
  for (const auto& s : spec.states)
    TORCH_INTERNAL_ASSERT(s.slot >= 0 && s.slot < 3 && (s.when == nullptr || spec.field_index(s.when) >= 0) &&
                              (s.initial_when == nullptr || spec.field_index(s.initial_when) >= 0),
                          "kind '", spec.name, "': state '", s.name, "' has a bad slot or condition");
  spec.value_positions.clear();
  for (size_t i = 0; spec.schedulable && i < spec.fields.size(); ++i)
    if (std::strcmp(spec.fields[i].type, "real") == 0) spec.value_positions.push_back(static_cast<int>(i));
  auto& entry = kinds()[spec.name];
  TORCH_INTERNAL_ASSERT(!entry, "kind '", spec.name, "' is registered twice");
  entry = std::make_unique<KindSpec>(std::move(spec));
  return *entry;
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

void register_update_kernel(c10::DeviceType type, UpdateKernel kernel) { kernels()[type] = kernel; }

UpdateKernel update_kernel(c10::DeviceType type) {
  const auto it = kernels().find(type);
  TORCH_CHECK(it != kernels().end(), "fused_step_: params are on ", type, ", for which this build has no kernels");
  return it->second;
}

void bind_values(const KindCall& c, OptimHyper& h, std::initializer_list<std::pair<const char*, double&>> members) {
  const std::vector<int>& positions = c.spec->value_positions;
  h.values.count = 0;
  for (const auto& [name, member] : members) {
    member = c[name];
    if (!c.values.defined()) continue;
    const auto it = std::find(positions.begin(), positions.end(), c.spec->field_index(name));
    TORCH_INTERNAL_ASSERT(it != positions.end() && h.values.count < DeviceValues::kMax, "kind '", c.spec->name,
                          "': '", name, "' is not a schedulable field");
    h.values.offset[h.values.count] =
        static_cast<int>(reinterpret_cast<const char*>(&member) - reinterpret_cast<const char*>(&h));
    h.values.index[h.values.count] = static_cast<int>(it - positions.begin());
    ++h.values.count;
  }
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
  TORCH_INTERNAL_ASSERT(!c.values.defined() || h.values.count == static_cast<int>(c.spec->value_positions.size()),
                        "kind '", c.spec->name, "' runs without binding its schedulable fields (bind_values)");
  UpdateScalars sc{c.lr, opt_or_undef(c.inv_scale), opt_or_undef(c.found_inf), opt_or_undef(c.grad_norm),
                   opt_or_undef(c.ema_decay), c.values, c.stalled};
  run_fused_update(c.op, l, h, sc, c.kernel);
}

}  // namespace detail
}  // namespace fusetrain
