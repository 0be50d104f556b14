// fusetrain._C: the Python extension. The ops themselves are registered with
// the PyTorch dispatcher by libfusetrain_core (loaded with this module); this
// module exposes what is not an op.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../api/capture.h"
#include "fusetrain/build_info.h"

namespace py = pybind11;

namespace fusetrain {
void bind_step_plan(py::module_& m);  // csrc/python/step_plan.cpp
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "fusetrain native core";
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
      "(NOTE [failed capture] in csrc/api/capture.h).");
  fusetrain::bind_step_plan(m);
}
