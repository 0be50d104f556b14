// fusetrain._C: the Python extension. The ops themselves are registered with
// the PyTorch dispatcher by libfusetrain_core (loaded with this module); this
// module exposes what is not an op.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <c10/util/Exception.h>
#include <exception>

#include "../ops/capture.h"
#include "../ops/kind_registry.h"
#include "fusetrain/build_info.h"

namespace py = pybind11;

namespace fusetrain {
void bind_step_plan(py::module_& m);  // csrc/python/step_plan.cpp
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "fusetrain native core";
  // NOTE [c10 errors in Python]: a check in a function of this module raises what the same check raises in an
  // op (torch.ops.fusetrain): TORCH_CHECK_VALUE a ValueError, TORCH_CHECK_TYPE a TypeError, TORCH_CHECK a
  // RuntimeError, each with the message alone (pybind11 would make them all RuntimeErrors with a C++ backtrace).
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });
  m.def("built_with_cuda", &fusetrain::built_with_cuda, "Whether the CUDA kernels were compiled in.");
  m.def("build_info", []() {
    py::dict d;
    d["cuda"] = fusetrain::built_with_cuda();
#ifdef FUSETRAIN_CUDA_ARCHS
    d["cuda_archs"] = FUSETRAIN_CUDA_ARCHS;
#else
    d["cuda_archs"] = "";
#endif
#ifdef FUSETRAIN_CPU_AVX2
    d["cpu_avx2"] = true;
#else
    d["cpu_avx2"] = false;
#endif
    return d;
  });
  m.def(
      "_abandon_capture",
      [](int device, std::pair<unsigned long long, unsigned long long> pool) {
        fusetrain::detail::abandon_capture(static_cast<c10::DeviceIndex>(device), pool);
      },
      "After a failed CUDA-graph capture: end the allocators' routing into the graph's pool and release it "
      "(NOTE [failed capture] in csrc/ops/capture.h).");
  m.def(
      "optim_kinds",
      []() {
        py::list out;
        auto name_or_none = [](const char* n) { return n ? py::object(py::str(n)) : py::object(py::none()); };
        for (const auto* spec : fusetrain::detail::all_kinds()) {
          py::list fields, states;
          for (const auto& f : spec->fields)
            fields.append(py::dict(py::arg("name") = f.name, py::arg("type") = f.type, py::arg("doc") = f.doc,
                                   py::arg("default") = f.default_value, py::arg("low") = f.low,
                                   py::arg("high") = f.high, py::arg("high_closed") = f.high_closed,
                                   py::arg("choices") = name_or_none(f.choices)));
          for (const auto& s : spec->states) {
            states.append(py::dict(py::arg("slot") = s.slot, py::arg("name") = s.name,
                                   py::arg("when") = name_or_none(s.when), py::arg("when_set") = s.when_set,
                                   py::arg("scalar") = s.scalar, py::arg("initial") = s.initial,
                                   py::arg("initial_when") = name_or_none(s.initial_when)));
          }
          py::list values;
          for (int i : spec->value_positions) values.append(spec->fields[i].name);
          out.append(py::dict(py::arg("name") = spec->name, py::arg("doc") = spec->doc, py::arg("fields") = fields,
                              py::arg("states") = states, py::arg("value_fields") = values,
                              py::arg("lean") = spec->lean));
        }
        return out;
      },
      "The optimizer kinds of fusetrain::fused_step_ (NOTE [kind table] in csrc/ops/kind_registry.h), generated "
      "from the optimizer table: each kind's name, its record's fields in order (default, allowed range), its "
      "per-param state, its schedulable fields and whether it takes lean state (NOTE [lean state] in "
      "csrc/common/lean_state.h).");
  m.def("optim_table_digest", &fusetrain::detail::optim_table_digest,
        "The digest of the optimizer table (python/fusetrain/optim/_table.py) this library was generated from.");
  m.def(
      "check_kind_record",
      [](const std::string& kind, const std::vector<double>& fields) {
        const auto& spec = fusetrain::detail::find_kind(kind);
        TORCH_CHECK_VALUE(fields.size() == spec.fields.size(), "check_kind_record: kind '", kind, "' has ",
                          spec.fields.size(), " fields, got ", fields.size());
        spec.check(kind, fields.data());  // NOTE [c10 errors in Python]: a ValueError naming the field
      },
      py::arg("kind"), py::arg("fields"),
      "Checks a group record's own fields (in the kind's order) as fusetrain::fused_step_ does: a ValueError "
      "naming the field otherwise.");
  fusetrain::bind_step_plan(m);
}
