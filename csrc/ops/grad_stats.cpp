// fusetrain::grad_stats — one read-only pass over a list of gradients that
// yields, in device memory, the global L2 norm (optionally of the unscaled
// gradients) and a non-finite flag. No host synchronisation.
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "../common/op_kernels.h"

namespace fusetrain {
namespace detail {

std::tuple<at::Tensor, at::Tensor> grad_stats_impl(GradStatsKernel kernel, at::TensorList grads,
                                                   const OptT& inv_scale) {
  const char* op = "grad_stats";
  at::Device dev = at::kCPU;
  if (!grads.empty()) {
    dev = grads[0].device();
  } else if (inv_scale.has_value()) {
    dev = inv_scale->device();
  }
  at::Tensor inv;
  if (inv_scale.has_value()) {
    inv = *inv_scale;
    TORCH_CHECK(inv.numel() == 1 && inv.scalar_type() == at::kFloat, op,
                ": inv_scale must be a float32 tensor with one element, got dtype ", inv.scalar_type(),
                " and shape ", inv.sizes());
    TORCH_CHECK(inv.device() == dev, op, ": inv_scale is on ", inv.device(), " but grads are on ", dev);
  }
  std::vector<at::Tensor> gs;
  gs.reserve(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    TORCH_CHECK(g.defined(), op, ": grads[", i, "] is undefined");
    TORCH_CHECK(g.device() == dev, op, ": grads[", i, "] is on ", g.device(), " but grads[0] is on ", dev);
    TORCH_CHECK(g.layout() == at::kStrided, op, ": grads[", i, "] is ", g.layout(),
                "; sparse gradients are not supported");
    const auto t = g.scalar_type();
    TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble, op, ": grads[", i,
                "] has dtype ", t, "; supported: float32, float16, bfloat16, float64");
    if (g.numel() == 0) continue;
    // Any dense layout can be read linearly; other views are copied once.
    gs.push_back(g.is_non_overlapping_and_dense() ? g : g.contiguous());
  }
  auto opts = at::TensorOptions().dtype(at::kFloat).device(dev);
  at::Tensor norm = at::zeros({}, opts);
  at::Tensor found_inf = at::zeros({}, opts);
  if (dev.is_cpu()) check_cpu_features(op);
  kernel(gs, inv, norm, found_inf);
  return {norm, found_inf};
}

}  // namespace detail
}  // namespace fusetrain

TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  m.def("grad_stats(Tensor[] grads, Tensor? inv_scale=None) -> (Tensor norm, Tensor found_inf)");
}
