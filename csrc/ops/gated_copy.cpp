// fusetrain::gated_copy_ — dst[i] <- src[i] for every pair, unless found_inf
// is non-zero (decided on the device): the copies of an EMA step (buffers,
// integer params) in one pass however many tensors, the same bytes whatever
// the dtype and values. Each pair has one dtype, shape and strides, and is
// dense; the dtype and layout conversions stay with ema_step_.
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include "../common/op_kernels.h"

namespace fusetrain {
namespace detail {

bool gated_copy_takes(const at::Tensor& dst, const at::Tensor& src) {
  return dst.device() == src.device() && dst.scalar_type() == src.scalar_type() && dst.sizes() == src.sizes() &&
         dst.strides() == src.strides() && dst.layout() == at::kStrided && dst.is_non_overlapping_and_dense() &&
         at::get_overlap_status(dst, src) != at::MemOverlapStatus::Partial;
}

void gated_copy_impl(GatedCopyKernel kernel, at::TensorList dst, at::TensorList src, const at::Tensor& found_inf) {
  const char* op = "gated_copy_";
  TORCH_CHECK_VALUE(dst.size() == src.size(), op, ": got ", dst.size(), " dst tensors but ", src.size(),
                    " src tensors");
  TORCH_CHECK_VALUE(found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat, op,
                    ": found_inf must be a float32 tensor with one element, got ", found_inf.scalar_type(),
                    " of shape ", found_inf.sizes());
  const at::Device dev = found_inf.device();
  std::vector<at::Tensor> ds, ss;
  for (size_t i = 0; i < dst.size(); ++i) {
    const at::Tensor& d = dst[i];
    const at::Tensor& s = src[i];
    TORCH_CHECK_VALUE(d.device() == dev && s.device() == dev, op, ": dst[", i, "] is on ", d.device(), " and src[",
                      i, "] on ", s.device(), " but found_inf is on ", dev);
    TORCH_CHECK_VALUE(d.scalar_type() == s.scalar_type(), op, ": src[", i, "] has dtype ", s.scalar_type(),
                      " but dst[", i, "] has dtype ", d.scalar_type());
    TORCH_CHECK_VALUE(d.sizes() == s.sizes() && d.strides() == s.strides(), op, ": src[", i, "] (shape ", s.sizes(),
                      ", strides ", s.strides(), ") and dst[", i, "] (shape ", d.sizes(), ", strides ", d.strides(),
                      ") must have one shape and one layout");
    TORCH_CHECK_VALUE(d.layout() == at::kStrided && d.is_non_overlapping_and_dense(), op, ": dst[", i,
                      "] must be a dense tensor");
    if (d.numel() == 0 || d.is_same(s)) continue;
    TORCH_CHECK_VALUE(at::get_overlap_status(d, s) != at::MemOverlapStatus::Partial, op, ": dst[", i, "] and src[", i,
                      "] overlap in part; allowed: separate tensors (or one tensor, left alone)");
    ds.push_back(d);
    ss.push_back(s);
  }
  kernel(ds, ss, found_inf);
}

}  // namespace detail
}  // namespace fusetrain

TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  m.def("gated_copy_(Tensor(a!)[] dst, Tensor[] src, Tensor found_inf) -> ()");
}
