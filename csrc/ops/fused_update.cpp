// Checks and dtype bucketing shared by the fused optimizer updates (every
// kind of the kind table, csrc/ops/kind_registry.h); the kernel is the device's
// (register_update_kernel in csrc/common/update_launch.h).
#include <ATen/core/Tensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty_strided.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <string>
#include <map>
#include <utility>

#include "../common/kind_dispatch.h"
#include "../common/op_kernels.h"

namespace fusetrain {
namespace detail {
namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

// NOTE [float64 params]: a float64 param is updated in double precision with
// float64 gradients and float64 state (as torch.optim keeps it); the other
// params keep float32 state. The device scalars (lr, inverse scale, norm,
// decay) stay float32 for every dtype.
const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    default: return c10::toString(t);
  }
}

at::ScalarType state_dtype(const at::Tensor& p) {
  return p.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_scalar(const char* op, const char* name, const at::Tensor& t, const at::Device& dev) {
  if (!t.defined()) return;
  TORCH_CHECK(t.numel() == 1, op, ": ", name, " must be a tensor with one element, got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device() == dev, op, ": ", name, " is on ", t.device(), " but params are on ", dev);
}

// SameAsParam: EMA; State: float32 (float64 for float64 params) or, for the
// others, bfloat16 or int8 codes (NOTE [lean state], NOTE [8-bit state] in
// csrc/common/lean_state.h); Master: float32, or int16 for a bfloat16 param
// (its remainder).
enum class Dtype { SameAsParam, State, Master };

void check_companion(const char* op, const char* list, size_t i, const at::Tensor& t, const at::Tensor& p,
                     Dtype rule) {
  TORCH_CHECK(t.defined(), op, ": ", list, "[", i, "] is undefined");
  TORCH_CHECK(t.device() == p.device(), op, ": params[", i, "] is on ", p.device(), " but ", list, "[", i,
              "] is on ", t.device());
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", list, "[", i, "] must be a dense (strided) tensor, got ",
              t.layout());
  TORCH_CHECK(t.sizes() == p.sizes(), op, ": ", list, "[", i, "] has shape ", t.sizes(), " but params[", i,
              "] has shape ", p.sizes());
  TORCH_CHECK(t.strides() == p.strides(), op, ": ", list, "[", i, "] has strides ", t.strides(),
              " but params[", i, "] has strides ", p.strides(), "; state must share the parameter's layout");
  const at::ScalarType want = rule == Dtype::SameAsParam ? p.scalar_type()
                             : rule == Dtype::State      ? state_dtype(p)
                                                         : at::kFloat;
  const bool lean_state = rule == Dtype::State && p.scalar_type() != at::kDouble;
  const at::ScalarType lean = lean_state                                                  ? at::kBFloat16
                            : rule == Dtype::Master && p.scalar_type() == at::kBFloat16 ? at::kShort
                                                                                         : want;
  const bool q8 = lean_state && t.scalar_type() == at::kChar;
  TORCH_CHECK(t.scalar_type() == want || t.scalar_type() == lean || q8, op, ": ", list, "[", i, "] has dtype ",
              dtype_name(t.scalar_type()), " but must be ", dtype_name(want),
              lean != want ? std::string(lean_state ? ", " : " or ") + dtype_name(lean) : std::string(),
              lean_state ? " or int8" : "", " (params[", i, "] is ", dtype_name(p.scalar_type()), ")");
}

// The dtype of params[i]'s state tensors (float32 when it has none); they
// must agree.
at::ScalarType state_type(const UpdateLists& l, size_t i) {
  at::ScalarType t = at::ScalarType::Undefined;
  for (const auto* st : {&l.state1, &l.state2, &l.state3}) {
    if (st->empty()) continue;
    const at::ScalarType s = (*st)[i].scalar_type();
    TORCH_CHECK(t == at::ScalarType::Undefined || t == s, "fused optimizer: the state tensors of params[", i,
                "] have different dtypes (", dtype_name(t), ", ", dtype_name(s), "); they must share one");
    t = s;
  }
  return t == at::ScalarType::Undefined ? at::kFloat : t;
}

std::array<int, 6> family(const at::Tensor& p, const at::Tensor& g, at::ScalarType state, at::ScalarType master,
                          int64_t block, bool ema_rem) {
  return {static_cast<int>(p.scalar_type()), static_cast<int>(g.scalar_type()), static_cast<int>(state),
          static_cast<int>(master), static_cast<int>(block), ema_rem ? 1 : 0};
}

// NOTE [8-bit state]: the block size of params[i]'s int8 states, read from
// the length of their scales: the smallest of 64, 128, 256 that gives it (a
// state of one block holds the same values whichever size covers it).
int64_t state_block_size(const char* op, const UpdateLists& l, size_t i, const at::Tensor& p) {
  const int64_t n = p.numel();
  int64_t block = 0;
  for (int k = 0; k < 3; ++k) {
    const std::vector<at::Tensor>& st = k == 0 ? l.state1 : k == 1 ? l.state2 : l.state3;
    if (st.empty()) continue;
    const char* name = l.state_names[k];
    TORCH_CHECK(l.scales[k].size() == st.size() && l.scales[k][i].defined(), op, ": ", name, "[", i,
                "] is int8 but has no block scales (state_scales; NOTE [8-bit state])");
    const at::Tensor& sc = l.scales[k][i];
    TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.dim() == 1 && sc.is_contiguous() && sc.device() == p.device(),
                op, ": the block scales of ", name, "[", i, "] must be a contiguous 1-D float32 tensor on ",
                p.device(), ", got ", sc.scalar_type(), " of shape ", sc.sizes(), " on ", sc.device());
    const int64_t nb = sc.numel();
    int64_t b = 0;
    for (int64_t cand : {64, 128, 256}) {
      if ((n + cand - 1) / cand == nb) {
        b = cand;
        break;
      }
    }
    TORCH_CHECK(n == 0 || b != 0, op, ": ", name, "[", i, "] has ", n, " elements and ", nb,
                " block scales; blocks of 64, 128 or 256 elements give ", (n + 63) / 64, ", ", (n + 127) / 128,
                " or ", (n + 255) / 256);
    TORCH_CHECK(block == 0 || block == b, op, ": the int8 states of params[", i, "] have different block sizes");
    block = b;
  }
  return block;
}

bool takes_lean_state(OptimKind kind) {
  bool lean = false;
  dispatch_kind(kind, [&](auto k) { lean = lean_state_kind<decltype(k)::value>(); });
  return lean;
}

// The kernels read the state slots of NOTE [optional states]: each slot the
// kind always uses is given, and none it never reads (the op files build the
// lists, so a mismatch is a bug there, not a user's input).
void check_state_slots(const char* op, OptimKind kind, std::array<bool, 3> given) {
  dispatch_kind(kind, [&](auto k) {
    constexpr OptimKind K = decltype(k)::value;
    for (int slot = 1; slot <= 3; ++slot) {
      const bool ok = given[slot - 1] ? slot_used<K>(slot) : !slot_used<K>(slot) || state_may_be_absent<K>(slot);
      TORCH_INTERNAL_ASSERT(ok, op, ": state list ", slot, given[slot - 1] ? " given" : " missing",
                            " for this optimizer kind");
    }
  });
}

void check_list_size(const char* op, const char* list, const std::vector<at::Tensor>& v, size_t n) {
  TORCH_CHECK(v.empty() || v.size() == n, op, ": ", list, " must be empty or have one tensor per param (",
              n, "), got ", v.size());
}

}  // namespace

void run_fused_update(const char* op, const UpdateLists& lists, const OptimHyper& hyper,
                      const UpdateScalars& scalars, UpdateKernel kernel) {
  const size_t n = lists.params.size();
  TORCH_CHECK(lists.grads.size() == n, op, ": got ", n, " params but ", lists.grads.size(), " grads");
  TORCH_CHECK(lists.steps.size() == n, op, ": got ", n, " params but ", lists.steps.size(), " state_steps");
  check_list_size(op, lists.state_names[0], lists.state1, n);
  check_list_size(op, lists.state_names[1], lists.state2, n);
  check_list_size(op, lists.state_names[2], lists.state3, n);
  check_list_size(op, "master_params", lists.master, n);
  check_list_size(op, lists.aux_name, lists.aux, n);
  check_list_size(op, "ema_params", lists.ema, n);
  check_list_size(op, "ema remainders", lists.ema_rem, n);
  TORCH_CHECK(scalars.lr.defined(), op, ": lr is required");
  if (n == 0) return;
  check_state_slots(op, hyper.kind, {!lists.state1.empty(), !lists.state2.empty(), !lists.state3.empty()});

  const at::Device dev = lists.params[0].device();
  TORCH_CHECK(dev.is_cpu() || dev.is_cuda(), op, ": params must be on CPU or CUDA, got ", dev);
  check_scalar(op, "lr", scalars.lr, dev);
  check_scalar(op, "inv_scale", scalars.inv_scale, dev);
  check_scalar(op, "found_inf", scalars.found_inf, dev);
  check_scalar(op, "grad_norm", scalars.grad_norm, dev);
  check_scalar(op, "ema_decay", scalars.ema_decay, dev);
  TORCH_CHECK(lists.ema.empty() || scalars.ema_decay.defined(), op, ": ema_params given without ema_decay");
  if (scalars.stalled.defined()) {
    TORCH_CHECK(scalars.stalled.numel() == 1 && scalars.stalled.scalar_type() == at::kLong &&
                    scalars.stalled.device() == dev,
                op, ": the stalled-update counter must be an int64 tensor with one element on ", dev, ", got ",
                scalars.stalled.scalar_type(), " of shape ", scalars.stalled.sizes(), " on ",
                scalars.stalled.device());
  }

  // NOTE [strided params]: a param that is a strided view (a slice of a larger
  // tensor) is updated through a dense copy, written back after the kernels;
  // its state has the copy's (contiguous) layout, as torch's zeros_like gives.
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;
  // The tensors the kernels take instead of params[i] / grads[i] (dense copies).
  std::map<size_t, std::pair<at::Tensor, at::Tensor>> replaced;
  // Each param's kernel family; whether every one is the first one's.
  std::vector<std::array<int, 6>> keys;
  bool one_family = true;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p0 = lists.params[i];
    TORCH_CHECK(p0.defined(), op, ": params[", i, "] is undefined");
    TORCH_CHECK(p0.device() == dev, op, ": params[", i, "] is on ", p0.device(), " but params[0] is on ", dev,
                "; all params of one group must be on one device");
    TORCH_CHECK(p0.layout() == at::kStrided, op, ": params[", i, "] must be dense, got ", p0.layout());
    TORCH_CHECK(is_supported_float(p0.scalar_type()), op, ": params[", i, "] has dtype ", p0.scalar_type(),
                "; supported: float32, float16, bfloat16, float64");
    at::Tensor p, g;
    if (!p0.is_non_overlapping_and_dense()) {
      TORCH_CHECK(at::has_internal_overlap(p0) != at::MemOverlap::Yes, op, ": params[", i,
                  "] has elements that share memory (an expanded view); it cannot be updated in place");
      p = p0.contiguous();
      write_back.emplace_back(p0, p);
    }
    const at::Tensor& pp = p.defined() ? p : p0;
    const at::Tensor& g0 = lists.grads[i];
    TORCH_CHECK(g0.defined(), op, ": grads[", i, "] is undefined");
    TORCH_CHECK(g0.layout() == at::kStrided, op, ": grads[", i, "] is ", g0.layout(),
                "; sparse gradients are not supported");
    TORCH_CHECK(!g0.is_complex(), op, ": grads[", i, "] is complex; complex gradients are not supported");
    TORCH_CHECK(is_supported_float(g0.scalar_type()), op, ": grads[", i, "] has dtype ", g0.scalar_type(),
                "; supported: float32, float16, bfloat16, float64");
    TORCH_CHECK((g0.scalar_type() == at::kDouble) == (pp.scalar_type() == at::kDouble), op, ": grads[", i,
                "] has dtype ", g0.scalar_type(), " but params[", i, "] has dtype ", pp.scalar_type(),
                "; a float64 param needs a float64 gradient and the reverse (NOTE [float64 params])");
    TORCH_CHECK(g0.device() == dev, op, ": params[", i, "] is on ", dev, " but grads[", i, "] is on ",
                g0.device());
    TORCH_CHECK(g0.sizes() == pp.sizes(), op, ": grads[", i, "] has shape ", g0.sizes(), " but params[", i,
                "] has shape ", pp.sizes());
    // The grads the kernels read (NOTE [kernel grads] in csrc/common/kind_dispatch.h):
    // the param's dtype or float32; other dtypes are converted to float32.
    const at::ScalarType gt = g0.scalar_type() == pp.scalar_type() || g0.scalar_type() == at::kFloat
                                  ? g0.scalar_type()
                                  : at::kFloat;
    if (g0.strides() != pp.strides()) {
      // Read-only: a copy with the parameter's layout keeps the kernels linear.
      g = at::empty_strided(pp.sizes(), pp.strides(), g0.options().dtype(gt)).copy_(g0);
    } else if (gt != g0.scalar_type()) {
      g = g0.to(gt);
    }
    const at::Tensor& s = lists.steps[i];
    TORCH_CHECK(s.defined() && s.numel() == 1 && s.scalar_type() == at::kFloat, op, ": state_steps[", i,
                "] must be a float32 tensor with one element");
    TORCH_CHECK(s.device() == dev, op, ": params[", i, "] is on ", dev, " but state_steps[", i, "] is on ",
                s.device());

    if (!lists.aux.empty()) {
      const at::Tensor& a = lists.aux[i];
      TORCH_CHECK(a.defined() && a.numel() == 1 && a.scalar_type() == at::kFloat && a.device() == dev, op, ": ",
                  lists.aux_name, "[", i, "] must be a float32 tensor with one element on ", dev);
    }
    if (!lists.state1.empty()) check_companion(op, lists.state_names[0], i, lists.state1[i], pp, Dtype::State);
    if (!lists.state2.empty()) check_companion(op, lists.state_names[1], i, lists.state2[i], pp, Dtype::State);
    if (!lists.state3.empty()) check_companion(op, lists.state_names[2], i, lists.state3[i], pp, Dtype::State);
    if (!lists.master.empty()) {
      TORCH_CHECK(pp.scalar_type() != at::kDouble, op, ": params[", i, "] is float64 and has a master copy; "
                  "master weights are for float16/bfloat16 params (pass none for float64 params)");
      check_companion(op, "master_params", i, lists.master[i], pp, Dtype::Master);
    }
    if (!lists.ema.empty()) check_companion(op, "ema_params", i, lists.ema[i], pp, Dtype::SameAsParam);
    // NOTE [ema remainder] in csrc/common/lean_state.h.
    const bool ema_rem = !lists.ema_rem.empty() && lists.ema_rem[i].defined();
    if (ema_rem) {
      const at::Tensor& r = lists.ema_rem[i];
      TORCH_CHECK(!lists.ema.empty() && pp.scalar_type() == at::kBFloat16, op, ": params[", i, "] is ",
                  dtype_name(pp.scalar_type()), " and has an EMA remainder; remainders are for bfloat16 EMAs");
      TORCH_CHECK(r.scalar_type() == at::kShort && r.device() == dev && r.sizes() == pp.sizes() &&
                      r.strides() == lists.ema[i].strides(),
                  op, ": the EMA remainder of params[", i, "] must be an int16 tensor with the EMA's shape ",
                  pp.sizes(), ", strides ", lists.ema[i].strides(), " and device ", dev, ", got ",
                  dtype_name(r.scalar_type()), " of shape ", r.sizes(), ", strides ", r.strides(), " on ",
                  r.device());
    }
    const at::ScalarType sd = state_type(lists, i);
    TORCH_CHECK(sd == at::kFloat || sd == at::kDouble || takes_lean_state(hyper.kind),
                op, ": ", dtype_name(sd), " state is for the element-wise optimizers (NOTE [lean state])");
    const int64_t block = sd == at::kChar ? state_block_size(op, lists, i, pp) : 0;
    if (p.defined() || g.defined()) replaced[i] = {pp, g.defined() ? g : g0};
    keys.push_back(family(pp, g.defined() ? g : g0, sd,
                          lists.master.empty() ? at::kFloat : lists.master[i].scalar_type(), block, ema_rem));
    one_family = one_family && keys.back() == keys.front();
  }
  if (dev.is_cpu()) check_cpu_features(op);
  if (one_family && replaced.empty()) {
    // The common case: one kernel family, nothing copied; no second set of lists.
    if (keys.front()[4] == 0) {
      kernel(lists, hyper, scalars);
    } else {
      UpdateLists with_block = lists;
      with_block.state_block = keys.front()[4];
      kernel(with_block, hyper, scalars);
    }
    return;
  }

  // Bucket by kernel family (param, grad, state and master dtypes).
  std::map<std::array<int, 6>, UpdateLists> buckets;
  for (size_t i = 0; i < n; ++i) {
    const auto r = replaced.find(i);
    const at::Tensor& p = r == replaced.end() ? lists.params[i] : r->second.first;
    const at::Tensor& g = r == replaced.end() ? lists.grads[i] : r->second.second;
    UpdateLists& b = buckets[keys[i]];
    b.params.push_back(p);
    b.grads.push_back(g);
    b.steps.push_back(lists.steps[i]);
    if (!lists.aux.empty()) b.aux.push_back(lists.aux[i]);
    if (!lists.state1.empty()) b.state1.push_back(lists.state1[i]);
    if (!lists.state2.empty()) b.state2.push_back(lists.state2[i]);
    if (!lists.state3.empty()) b.state3.push_back(lists.state3[i]);
    if (!lists.master.empty()) b.master.push_back(lists.master[i]);
    if (!lists.ema.empty()) b.ema.push_back(lists.ema[i]);
    if (keys[i][5] != 0) b.ema_rem.push_back(lists.ema_rem[i]);
    if (keys[i][4] != 0) {
      b.state_block = keys[i][4];
      for (int k = 0; k < 3; ++k)
        if (!lists.scales[k].empty()) b.scales[k].push_back(lists.scales[k][i]);
    }
  }
  for (auto& kv : buckets) kernel(kv.second, hyper, scalars);
  for (auto& [view, dense] : write_back) view.copy_(dense);
}

}  // namespace detail
}  // namespace fusetrain
