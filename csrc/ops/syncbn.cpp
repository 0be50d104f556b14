// Batch-norm ops for fusetrain.nn.SyncBatchNorm: per-channel statistics and
// gradient reductions (the parts whose results are exchanged between ranks)
// and the two element-wise passes that use the global results.
//
//   bn_stats(x) -> (count, mean, m2)
//   bn_backward_reduce(dy, x, mean) -> (sum_dy, sum_dy_xmu)
//   bn_elemt(x, mean, invstd, weight?, bias?) -> y
//   bn_backward_elemt(dy, x, mean, invstd, weight?, sum_dy, sum_dy_xmu, count) -> dx
//
// x is (N, C, *) float32/float16/bfloat16; per-channel results are float32.
// Contiguous and channels-last inputs are read in place (see BnLayout); other
// strides are copied once into the suggested memory format. Outputs keep the
// dtype and memory format of x.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "../common/syncbn.h"
#include "../common/op_kernels.h"

namespace fusetrain {
namespace detail {
namespace {

bool is_float_type(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// The layout of t read as (N, C, S), if the kernels can read it in place.
std::optional<BnLayout> layout_of(const at::Tensor& t) {
  // (N, C) and (N, C, 1, ...) contiguous tensors are rows of C: NSC with S = 1
  // reads them with channel-vectorized loads.
  int64_t s = 1;
  for (int64_t d = 2; d < t.dim(); ++d) s *= t.size(d);
  if (t.is_contiguous()) return s == 1 ? BnLayout::NSC : BnLayout::NCS;
  if (t.movedim(1, -1).is_contiguous()) return BnLayout::NSC;
  return std::nullopt;
}

// Checks x and returns it readable in place (a copy when its strides are not
// one of the two layouts) together with its (N, C, S) shape.
at::Tensor prepare_input(const char* op, const char* name, const at::Tensor& x, BnShape& shape) {
  TORCH_CHECK(x.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(x.dim() >= 2, op, ": ", name, " must have shape (N, C, *) with at least 2 dims, got shape ", x.sizes());
  TORCH_CHECK(is_float_type(x.scalar_type()), op, ": ", name, " has dtype ", x.scalar_type(),
              "; supported: float32, float16, bfloat16");
  TORCH_CHECK(x.layout() == at::kStrided, op, ": ", name, " must be a strided (dense) tensor, got ", x.layout());
  TORCH_CHECK(x.device().is_cpu() || x.device().is_cuda(), op, ": ", name, " must be on CPU or CUDA, got ",
              x.device());
  at::Tensor r = x;
  auto layout = layout_of(x);
  if (!layout.has_value()) {
    r = x.contiguous(x.suggest_memory_format());
    layout = layout_of(r);
    TORCH_INTERNAL_ASSERT(layout.has_value());
  }
  shape.N = x.size(0);
  shape.C = x.size(1);
  shape.S = 1;
  for (int64_t d = 2; d < x.dim(); ++d) shape.S *= x.size(d);
  shape.layout = *layout;
  return r;
}

// dy read in the layout of x (copied into x's strides when it differs).
at::Tensor prepare_grad(const char* op, const at::Tensor& dy, const at::Tensor& x, const BnShape& shape) {
  TORCH_CHECK(dy.defined(), op, ": dy is undefined");
  TORCH_CHECK(dy.sizes() == x.sizes(), op, ": dy has shape ", dy.sizes(), " but x has shape ", x.sizes());
  TORCH_CHECK(dy.scalar_type() == x.scalar_type(), op, ": dy has dtype ", dy.scalar_type(), " but x has dtype ",
              x.scalar_type());
  TORCH_CHECK(dy.device() == x.device(), op, ": dy is on ", dy.device(), " but x is on ", x.device());
  TORCH_CHECK(dy.layout() == at::kStrided, op, ": dy must be a strided (dense) tensor, got ", dy.layout());
  auto layout = layout_of(dy);
  if (layout.has_value() && *layout == shape.layout) return dy;
  at::Tensor r = at::empty_like(x);
  r.copy_(dy);
  return r;
}

// Outputs have the strides of empty_like(x_in) (what the fake kernels
// promise); when those are not the layout the kernel reads x in, the kernel
// writes into a temporary in x's layout that is then copied over.
at::Tensor output_in_layout(const at::Tensor& result, const at::Tensor& x, const BnShape& shape) {
  auto layout = layout_of(result);
  if (layout.has_value() && *layout == shape.layout) return result;
  return at::empty_like(x);
}

// A float32 vector of C elements on x's device (copied to contiguous if needed).
at::Tensor channel_vector(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x, int64_t C) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == C, op, ": ", name, " must have shape (", C, ",) (the channels of x), got ",
              t.sizes());
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but x is on ", x.device());
  return t.contiguous();
}

// weight/bias: float32/float16/bfloat16 with C elements, used as float32.
at::Tensor affine_vector(const char* op, const char* name, const std::optional<at::Tensor>& t, const at::Tensor& x,
                         int64_t C) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  TORCH_CHECK(is_float_type(t->scalar_type()), op, ": ", name, " has dtype ", t->scalar_type(),
              "; supported: float32, float16, bfloat16");
  TORCH_CHECK(t->dim() == 1 && t->size(0) == C, op, ": ", name, " must have shape (", C,
              ",) (the channels of x), got ", t->sizes());
  TORCH_CHECK(t->device() == x.device(), op, ": ", name, " is on ", t->device(), " but x is on ", x.device());
  return t->to(at::kFloat).contiguous();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_impl(BnStatsKernel kernel, const at::Tensor& x_in) {
  const char* op = "bn_stats";
  BnShape shape;
  at::Tensor x = prepare_input(op, "x", x_in, shape);
  auto opts = x.options().dtype(at::kFloat);
  at::Tensor count = at::full({}, static_cast<double>(shape.per_channel()), opts);
  at::Tensor mean = at::empty({shape.C}, opts);
  at::Tensor m2 = at::empty({shape.C}, opts);
  if (x.device().is_cpu()) check_cpu_features(op);
  kernel(x, shape, mean, m2);
  return {count, mean, m2};
}

std::tuple<at::Tensor, at::Tensor> bn_backward_reduce_impl(BnBackwardReduceKernel kernel,
                                                           const at::Tensor& dy_in, const at::Tensor& x_in,
                                                           const at::Tensor& mean_in) {
  const char* op = "bn_backward_reduce";
  BnShape shape;
  at::Tensor x = prepare_input(op, "x", x_in, shape);
  at::Tensor dy = prepare_grad(op, dy_in, x, shape);
  at::Tensor mean = channel_vector(op, "mean", mean_in, x, shape.C);
  auto opts = x.options().dtype(at::kFloat);
  at::Tensor sum_dy = at::empty({shape.C}, opts);
  at::Tensor sum_dy_xmu = at::empty({shape.C}, opts);
  if (x.device().is_cpu()) check_cpu_features(op);
  kernel(dy, x, shape, mean, sum_dy, sum_dy_xmu);
  return {sum_dy, sum_dy_xmu};
}

at::Tensor bn_elemt_impl(BnElemtKernel kernel, const at::Tensor& x_in, const at::Tensor& mean_in, const at::Tensor& invstd_in,
                         const std::optional<at::Tensor>& weight_in, const std::optional<at::Tensor>& bias_in) {
  const char* op = "bn_elemt";
  BnShape shape;
  at::Tensor x = prepare_input(op, "x", x_in, shape);
  at::Tensor mean = channel_vector(op, "mean", mean_in, x, shape.C);
  at::Tensor invstd = channel_vector(op, "invstd", invstd_in, x, shape.C);
  at::Tensor weight = affine_vector(op, "weight", weight_in, x, shape.C);
  at::Tensor bias = affine_vector(op, "bias", bias_in, x, shape.C);
  at::Tensor result = at::empty_like(x_in);
  at::Tensor out = output_in_layout(result, x, shape);
  if (x.device().is_cpu()) check_cpu_features(op);
  kernel(x, shape, mean, invstd, weight, bias, out);
  if (!out.is_same(result)) result.copy_(out);
  return result;
}

at::Tensor bn_backward_elemt_impl(BnBackwardElemtKernel kernel, const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& mean_in,
                                  const at::Tensor& invstd_in, const std::optional<at::Tensor>& weight_in,
                                  const at::Tensor& sum_dy_in, const at::Tensor& sum_dy_xmu_in,
                                  const at::Tensor& count) {
  const char* op = "bn_backward_elemt";
  BnShape shape;
  at::Tensor x = prepare_input(op, "x", x_in, shape);
  at::Tensor dy = prepare_grad(op, dy_in, x, shape);
  at::Tensor mean = channel_vector(op, "mean", mean_in, x, shape.C);
  at::Tensor invstd = channel_vector(op, "invstd", invstd_in, x, shape.C);
  at::Tensor weight = affine_vector(op, "weight", weight_in, x, shape.C);
  at::Tensor sum_dy = channel_vector(op, "sum_dy", sum_dy_in, x, shape.C);
  at::Tensor sum_dy_xmu = channel_vector(op, "sum_dy_xmu", sum_dy_xmu_in, x, shape.C);
  TORCH_CHECK(count.defined() && count.numel() == 1 && count.scalar_type() == at::kFloat, op,
              ": count must be a float32 tensor with one element, got ",
              count.defined() ? c10::str(count.scalar_type(), " of shape ", count.sizes()) : std::string("undefined"));
  TORCH_CHECK(count.device() == x.device(), op, ": count is on ", count.device(), " but x is on ", x.device());
  at::Tensor result = at::empty_like(x_in);
  at::Tensor dx = output_in_layout(result, x, shape);
  if (x.device().is_cpu()) check_cpu_features(op);
  kernel(dy, x, shape, mean, invstd, weight, sum_dy, sum_dy_xmu, count, dx);
  if (!dx.is_same(result)) result.copy_(dx);
  return result;
}

}  // namespace detail
}  // namespace fusetrain

// NOTE [flexible layout]: the kernels read (N, C, *) inputs contiguous or
// channels-last in place and return empty_like(x)-strided outputs (as the fake
// kernels do), so the ops are tagged flexible_layout: inductor, which lays
// convolution outputs out channels-last, then passes its layout through
// instead of copying every input to NCHW and every output back.
TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  const std::vector<at::Tag> tags{at::Tag::flexible_layout};
  m.def("bn_stats(Tensor x) -> (Tensor count, Tensor mean, Tensor m2)", tags);
  m.def("bn_backward_reduce(Tensor dy, Tensor x, Tensor mean) -> (Tensor sum_dy, Tensor sum_dy_xmu)", tags);
  m.def("bn_elemt(Tensor x, Tensor mean, Tensor invstd, Tensor? weight=None, Tensor? bias=None) -> Tensor", tags);
  m.def(
      "bn_backward_elemt(Tensor dy, Tensor x, Tensor mean, Tensor invstd, Tensor? weight, Tensor sum_dy, "
      "Tensor sum_dy_xmu, Tensor count) -> Tensor",
      tags);
}
