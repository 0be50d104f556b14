// fusetrain._C.StepPlan: the per-step fast path of the Python optimizers.
//
// NOTE [step plan]: between two steps of an optimizer usually only the
// gradients change. Collecting the op's lists in Python (the state checks,
// state tensors, masters, EMA copies, for DTensors their local shards) and
// converting nine lists at the op boundary cost about a microsecond per
// tensor, on every step. A plan is made from the lists of a step that
// collected them (python/fusetrain/optim/_base.py), keeps them in C++, and
// later steps only re-check, at C speed, that they still hold:
//   * the optimizer's param_groups list, each group dict, its "params" list
//     and every element are the objects the plan was made from;
//   * every param has the same dtype, device and strides (its state follows
//     its layout, NOTE [state layout] in python/fusetrain/optim/_state_layout.py), and
//     a gradient exactly when it had one (dense; a DTensor gradient gives its
//     local shard);
//   * a param with a master copy has the same version counter and data
//     pointer (NOTE [master re-sync] in python/fusetrain/optim/_param_state.py);
//   * the optimizer's state dict maps each stepped param to the same dict,
//     whose tensor entries are the same objects; a DTensor param has the same
//     local shard.
// collect() reads the gradients (in C++) or answers false, after which the
// Python side collects the lists afresh and makes a new plan; run() calls
// fusetrain::fused_step_ with the kept lists, the gradients and the group
// records (lr, hyper) that Python computes per step from the groups. For
// DTensor params, local_stats() gives this rank's part of the global norm and
// flag (NOTE [sharded steps] in python/fusetrain/optim/_sharded.py).
// The plan holds the params as Python objects only, never a reference to
// their tensors: torch.utils.swap_tensors (module conversions with
// torch.__future__.set_swap_module_params_on_conversion) needs a param's
// tensor to be referenced by the param alone. Each collect() reads the
// params' tensors afresh; run() lets go of them.
#include <torch/csrc/autograd/python_variable.h>
#include <pybind11/stl.h>

#include <ATen/TensorOperators.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/zeros.h>
#include <c10/util/SmallVector.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "fusetrain/ops.h"

namespace py = pybind11;

namespace fusetrain {
namespace detail {
namespace {

struct PlanParam {
  py::object obj;  // the param as the group lists it
  at::ScalarType dtype;
  c10::Device device;
  c10::SmallVector<int64_t, 5> strides;  // inline: collect() reads it for every param
  bool stepped;  // had a gradient when the plan was made
  bool watched;  // has a master copy: written outside the optimizer, it needs a re-sync
  int64_t version;
  const void* data;
};

struct PlanGroup {
  py::object dict, params;  // the group dict and its "params" list
  std::vector<PlanParam> members;
};

std::vector<at::Tensor> tensors(const py::list& list, const char* name) {
  std::vector<at::Tensor> out;
  out.reserve(list.size());
  for (const auto& item : list) {
    TORCH_CHECK_TYPE(THPVariable_Check(item.ptr()), "StepPlan: ", name, " must hold tensors");
    out.push_back(THPVariable_Unpack(item.ptr()));
  }
  return out;
}

// Where a tensor's elements start (nullptr for a wrapper without storage, e.g. a DTensor).
const void* data_of(const at::Tensor& t) {
  return t.has_storage() ? t.const_data_ptr() : nullptr;
}

// A borrowed reference to dict[key] without __missing__ (nullptr when absent).
PyObject* dict_item(PyObject* dict, PyObject* key) {
  PyObject* v = PyDict_GetItemWithError(dict, key);
  if (v == nullptr && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// The same with the key's hash known: a tensor's hash is a Python method
// (Tensor.__hash__, its id), which costs more than the lookup itself.
PyObject* dict_item(PyObject* dict, PyObject* key, Py_hash_t hash) {
#if PY_VERSION_HEX < 0x030D0000
  PyObject* v = _PyDict_GetItem_KnownHash(dict, key, hash);
  if (v == nullptr && PyErr_Occurred()) throw py::error_already_set();
  return v;
#else
  (void)hash;
  return dict_item(dict, key);
#endif
}

class StepPlan {
 public:
  StepPlan(std::string kind, const py::list& groups, const py::dict& state, const py::object& dtensor,
           const py::list& params, const py::list& steps, const py::list& s1, const py::list& s2, const py::list& s3,
           const py::list& masters, const py::list& emas, std::vector<int64_t> sizes, const py::list& stepped,
           const py::list& state_dicts, const py::list& item_dicts, const py::list& item_keys,
           const py::list& item_vals, const py::list& locals, const std::vector<int64_t>& copies,
           const std::vector<int64_t>& watched, const py::list& scales, const py::list& ema_rems)
      : kind_(std::move(kind)), groups_(groups), state_(state), dtensor_(dtensor),
        steps_(tensors(steps, "steps")), s1_(tensors(s1, "state1")),
        s2_(tensors(s2, "state2")), s3_(tensors(s3, "state3")), masters_(tensors(masters, "masters")),
        emas_(tensors(emas, "emas")), scales_(tensors(scales, "scales")), ema_rems_(tensors(ema_rems, "ema_rems")),
        sizes_(std::move(sizes)) {
    const size_t n_params = params.size();
    size_t with_grad = 0;
    for (const auto& g : groups) {
      TORCH_CHECK_TYPE(PyDict_Check(g.ptr()), "StepPlan: param_groups must hold dicts");
      PyObject* plist = dict_item(g.ptr(), params_key_.ptr());
      TORCH_CHECK_TYPE(plist != nullptr && PyList_Check(plist), "StepPlan: a group's params must be a list");
      PlanGroup pg{py::reinterpret_borrow<py::object>(g), py::reinterpret_borrow<py::object>(plist), {}};
      for (Py_ssize_t i = 0; i < PyList_GET_SIZE(plist); ++i) {
        PyObject* p = PyList_GET_ITEM(plist, i);
        TORCH_CHECK_TYPE(THPVariable_Check(p), "StepPlan: params must be tensors");
        const at::Tensor& t = THPVariable_Unpack(p);
        const bool has_grad = t.grad().defined();
        with_grad += has_grad;
        pg.members.push_back({py::reinterpret_borrow<py::object>(p), t.scalar_type(), t.device(),
                              c10::SmallVector<int64_t, 5>(t.strides().begin(), t.strides().end()), has_grad,
                              false, t._version(), data_of(t)});
      }
      groups_info_.push_back(std::move(pg));
    }
    TORCH_CHECK_VALUE(with_grad == n_params && stepped.size() == n_params && state_dicts.size() == n_params &&
                          locals.size() == n_params,
                      "StepPlan: ", n_params, " params in the lists, ", with_grad, " with a gradient, ",
                      stepped.size(), " stepped, ", state_dicts.size(), " state dicts, ", locals.size(), " locals");
    TORCH_CHECK_VALUE(item_keys.size() == item_dicts.size() && item_vals.size() == item_dicts.size(),
                      "StepPlan: the state item guards differ in length");
    for (size_t i = 0; i < n_params; ++i) {
      const Py_hash_t h = PyObject_Hash(stepped[i].ptr());
      if (h == -1) throw py::error_already_set();
      hashes_.push_back(h);
      stepped_.push_back(stepped[i]);
      state_dicts_.push_back(state_dicts[i]);
      locals_.push_back(locals[i]);
    }
    TORCH_CHECK_VALUE(copies.empty() || copies.size() == n_params, "StepPlan: ", copies.size(),
                      " replica counts for ", n_params, " params");
    std::vector<bool> watch(n_params, false);
    for (int64_t i : watched) {
      TORCH_CHECK_INDEX(i >= 0 && static_cast<size_t>(i) < n_params, "StepPlan: watched index ", i,
                        " out of range for ", n_params, " stepped params");
      watch[i] = true;
    }
    size_t k = 0;  // the members with a gradient are the stepped params, in order
    for (auto& pg : groups_info_) {
      for (auto& m : pg.members) {
        if (m.stepped) m.watched = watch[k++];
      }
    }
    std::map<int64_t, size_t> seen;
    for (size_t i = 0; i < copies.size(); ++i) {
      TORCH_CHECK_VALUE(copies[i] > 0, "StepPlan: replica counts must be positive, got ", copies[i]);
      auto [it, fresh] = seen.emplace(copies[i], classes_.size());
      if (fresh) classes_.push_back({copies[i], {}});
      classes_[it->second].second.push_back(i);
    }
    for (size_t i = 0; i < item_dicts.size(); ++i) {
      TORCH_CHECK_TYPE(PyDict_Check(item_dicts[i].ptr()), "StepPlan: item_dicts must hold dicts");
      item_dicts_.push_back(item_dicts[i]);
      item_keys_.push_back(item_keys[i]);
      item_vals_.push_back(item_vals[i]);
    }
  }

  // Whether the plan still holds for these param_groups and state (NOTE [step
  // plan]); if so, the gradients are read and kept for run().
  bool collect(const py::object& groups, const py::object& state) {
    grads_.clear();
    params_.clear();
    if (!groups.is(groups_) || !state.is(state_) || !read_grads()) return fail();
    PyObject* st = state_.ptr();
    for (size_t i = 0; i < stepped_.size(); ++i) {
      if (dict_item(st, stepped_[i].ptr(), hashes_[i]) != state_dicts_[i].ptr()) return fail();
    }
    for (size_t i = 0; i < item_dicts_.size(); ++i) {
      if (dict_item(item_dicts_[i].ptr(), item_keys_[i].ptr()) != item_vals_[i].ptr()) return fail();
    }
    for (size_t i = 0; i < locals_.size(); ++i) {
      if (locals_[i].is_none()) continue;
      py::object now = py::reinterpret_steal<py::object>(PyObject_GetAttrString(stepped_[i].ptr(), "_local_tensor"));
      if (!now) throw py::error_already_set();
      if (!now.is(locals_[i])) return fail();
    }
    return true;
  }

  // This rank's share of the squared global norm and its non-finite flag, as
  // python/fusetrain/optim/_sharded.py's local_stats computes them (the same
  // ops in the same order): per group of equal replica counts n, in the order
  // first seen, sq += norm^2 / n.
  std::tuple<at::Tensor, at::Tensor> local_stats(const std::optional<at::Tensor>& inv_scale) const {
    TORCH_CHECK(grads_.size() == params_.size() && !grads_.empty(), "StepPlan.local_stats: call collect() first");
    TORCH_CHECK(!classes_.empty(), "StepPlan.local_stats: the plan was made without replica counts");
    py::gil_scoped_release no_gil;
    const auto opts = grads_[0].options().dtype(at::kFloat);
    at::Tensor sq = at::zeros({}, opts), flag = at::zeros({}, opts);
    for (const auto& [n, idx] : classes_) {
      std::vector<at::Tensor> gs;
      gs.reserve(idx.size());
      for (size_t i : idx) gs.push_back(grads_[i]);
      auto [norm, f] = grad_stats(gs, inv_scale);
      sq = sq + norm * norm / n;
      flag = at::maximum(flag, f);
    }
    return {sq, flag};
  }

  void run(const std::vector<at::Tensor>& lrs, const std::vector<double>& hyper,
           const std::optional<at::Tensor>& inv_scale, const std::optional<at::Tensor>& found_inf,
           const std::optional<at::Tensor>& ema_decay, const std::optional<at::Tensor>& grad_norm_out,
           const std::optional<at::Tensor>& found_inf_out, const std::optional<at::Tensor>& grad_norm,
           const std::vector<at::Tensor>& group_values, const std::optional<at::Tensor>& stalled_out) {
    TORCH_CHECK(!grads_.empty() && grads_.size() == params_.size(),
                "StepPlan.run: call collect() first (it answered false or was not called)");
    // Neither the gradients nor the params are kept past the step:
    // zero_grad(set_to_none=True) frees the one, swap_tensors needs the other.
    const std::vector<at::Tensor> grads = std::move(grads_);
    const std::vector<at::Tensor> params = std::move(params_);
    grads_.clear();
    params_.clear();
    py::gil_scoped_release no_gil;
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // NOTE [below autograd] in csrc/ops/fused_step.cpp
    fused_step_(kind_, params, grads, steps_, s1_, s2_, s3_, masters_, emas_, sizes_, lrs, hyper, inv_scale,
                found_inf, ema_decay, grad_norm_out, found_inf_out, grad_norm,
                group_values.empty() ? std::nullopt : std::optional<at::TensorList>(group_values),
                scales_.empty() ? std::nullopt : std::optional<at::TensorList>(scales_),
                ema_rems_.empty() ? std::nullopt : std::optional<at::TensorList>(ema_rems_), stalled_out);
  }

 private:
  bool fail() {
    grads_.clear();
    params_.clear();
    return false;
  }

  bool read_grads() {
    PyObject* gl = groups_.ptr();
    if (!PyList_Check(gl) || static_cast<size_t>(PyList_GET_SIZE(gl)) != groups_info_.size()) return false;
    grads_.reserve(stepped_.size());
    params_.reserve(stepped_.size());
    for (size_t g = 0; g < groups_info_.size(); ++g) {
      const PlanGroup& pg = groups_info_[g];
      PyObject* gd = PyList_GET_ITEM(gl, g);
      if (gd != pg.dict.ptr() || dict_item(gd, params_key_.ptr()) != pg.params.ptr()) return false;
      PyObject* plist = pg.params.ptr();
      if (static_cast<size_t>(PyList_GET_SIZE(plist)) != pg.members.size()) return false;
      for (size_t i = 0; i < pg.members.size(); ++i) {
        const PlanParam& m = pg.members[i];
        if (PyList_GET_ITEM(plist, i) != m.obj.ptr()) return false;
        const at::Tensor& t = THPVariable_Unpack(m.obj.ptr());
        if (t.scalar_type() != m.dtype || t.device() != m.device) return false;
        if (t.strides() != c10::IntArrayRef(m.strides)) return false;
        if (m.watched && (t._version() != m.version || data_of(t) != m.data)) return false;
        const at::Tensor& grad = t.grad();
        if (grad.defined() != m.stepped) return false;
        if (!m.stepped) continue;
        at::Tensor g_local = dtensor_.is_none() ? grad : local_of(grad);
        if (g_local.layout() != at::kStrided || g_local.is_complex()) return false;
        const size_t k = grads_.size();
        params_.push_back(locals_[k].is_none() ? t : THPVariable_Unpack(locals_[k].ptr()));
        grads_.push_back(std::move(g_local));
      }
    }
    return true;
  }

  // A DTensor's local shard (the tensor itself when it is no DTensor).
  at::Tensor local_of(const at::Tensor& t) const {
    py::object obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
    if (!obj) throw py::error_already_set();
    const int is_dtensor = PyObject_IsInstance(obj.ptr(), dtensor_.ptr());
    if (is_dtensor < 0) throw py::error_already_set();
    if (!is_dtensor) return t;
    py::object local = py::reinterpret_steal<py::object>(PyObject_GetAttrString(obj.ptr(), "_local_tensor"));
    if (!local) throw py::error_already_set();
    TORCH_CHECK_TYPE(THPVariable_Check(local.ptr()), "StepPlan: a DTensor's _local_tensor is not a tensor");
    return THPVariable_Unpack(local.ptr());
  }

  std::string kind_;
  py::str params_key_{"params"};  // made once: collect() looks it up in every group dict
  py::object groups_, state_, dtensor_;
  std::vector<at::Tensor> steps_, s1_, s2_, s3_, masters_, emas_;
  std::vector<at::Tensor> scales_;  // NOTE [8-bit state]: fused_step_'s state_scales
  std::vector<at::Tensor> ema_rems_;  // NOTE [ema remainder]: fused_step_'s ema_remainders
  std::vector<int64_t> sizes_;
  std::vector<PlanGroup> groups_info_;
  std::vector<py::object> stepped_, state_dicts_, locals_, item_dicts_, item_keys_, item_vals_;
  std::vector<Py_hash_t> hashes_;  // of stepped_, as the state dict stored them
  std::vector<std::pair<int64_t, std::vector<size_t>>> classes_;  // replica count, stepped indices
  std::vector<at::Tensor> params_, grads_;  // from collect() to run()
};

}  // namespace
}  // namespace detail

void bind_step_plan(py::module_& m) {
  using detail::StepPlan;
  py::class_<StepPlan>(m, "StepPlan", "An optimizer's step lists kept in C++ (NOTE [step plan] in "
                                      "csrc/python/step_plan.cpp).")
      .def(py::init<std::string, const py::list&, const py::dict&, const py::object&, const py::list&,
                    const py::list&, const py::list&, const py::list&, const py::list&, const py::list&,
                    const py::list&, std::vector<int64_t>, const py::list&, const py::list&, const py::list&,
                    const py::list&, const py::list&, const py::list&, const std::vector<int64_t>&,
                    const std::vector<int64_t>&, const py::list&, const py::list&>(),
           py::arg("kind"), py::arg("param_groups"), py::arg("state"), py::arg("dtensor"), py::arg("params"),
           py::arg("steps"), py::arg("state1"), py::arg("state2"), py::arg("state3"), py::arg("masters"),
           py::arg("emas"), py::arg("group_sizes"), py::arg("stepped"), py::arg("state_dicts"),
           py::arg("item_dicts"), py::arg("item_keys"), py::arg("item_vals"), py::arg("locals"),
           py::arg("copies") = std::vector<int64_t>(), py::arg("watched") = std::vector<int64_t>(),
           py::arg("scales") = py::list(), py::arg("ema_remainders") = py::list())
      .def("collect", &StepPlan::collect, py::arg("param_groups"), py::arg("state"),
           "Whether the plan still holds; if so, reads the gradients for run().")
      .def("local_stats", &StepPlan::local_stats, py::arg("inv_scale") = py::none(),
           "This rank's squared norm share and flag over the collected gradients (NOTE [sharded steps]).")
      .def("run", &StepPlan::run, py::arg("lrs"), py::arg("hyper"), py::arg("inv_scale") = py::none(),
           py::arg("found_inf") = py::none(), py::arg("ema_decay") = py::none(),
           py::arg("grad_norm_out") = py::none(), py::arg("found_inf_out") = py::none(),
           py::arg("grad_norm") = py::none(), py::arg("group_values") = std::vector<at::Tensor>(),
           py::arg("stalled_out") = py::none(),
           "fusetrain::fused_step_ over the kept lists and collected gradients.");
}

}  // namespace fusetrain
