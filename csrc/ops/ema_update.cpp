// fusetrain::ema_update_ — ema += (1 - decay) * (src - ema) over lists of
// tensors in one multi-tensor pass, decay read from a device tensor, skipped
// on the device when found_inf is non-zero. `remainders`, when not empty,
// holds one int16 tensor per bfloat16 entry of ema, in order: with it, that
// entry is the exact float32 EMA (NOTE [ema remainder] in
// csrc/common/lean_state.h).
#include <ATen/ops/empty_strided.h>
#include <torch/library.h>

#include "../common/op_kernels.h"

namespace fusetrain {
namespace detail {

void ema_update_impl(EmaUpdateKernel kernel, at::TensorList ema, at::TensorList src, const at::Tensor& decay,
                     const std::optional<at::Tensor>& found_inf, const std::optional<at::TensorList>& remainders) {
  const char* op = "ema_update_";
  TORCH_CHECK(ema.size() == src.size(), op, ": got ", ema.size(), " ema tensors but ", src.size(), " src tensors");
  const at::Device dev = decay.device();
  TORCH_CHECK(decay.numel() == 1 && decay.scalar_type() == at::kFloat, op,
              ": decay must be a float32 tensor with one element, got ", decay.scalar_type(), " of shape ",
              decay.sizes());
  at::Tensor fi = opt_or_undef(found_inf);
  if (fi.defined()) {
    TORCH_CHECK(fi.numel() == 1 && fi.scalar_type() == at::kFloat, op,
                ": found_inf must be a float32 tensor with one element");
    TORCH_CHECK(fi.device() == dev, op, ": found_inf is on ", fi.device(), " but decay is on ", dev);
  }
  const at::TensorList rems = remainders.has_value() ? *remainders : at::TensorList();
  size_t n_bf16 = 0;
  for (const auto& e : ema) n_bf16 += e.scalar_type() == at::kBFloat16;
  TORCH_CHECK(rems.empty() || rems.size() == n_bf16, op, ": remainders must be empty or hold one int16 tensor per "
              "bfloat16 ema tensor (", n_bf16, "), got ", rems.size());
  size_t next_rem = 0;
  std::vector<at::Tensor> es, ss, rs;
  for (size_t i = 0; i < ema.size(); ++i) {
    const at::Tensor& e = ema[i];
    at::Tensor s = src[i];
    TORCH_CHECK(e.device() == dev, op, ": ema[", i, "] is on ", e.device(), " but decay is on ", dev);
    TORCH_CHECK(s.device() == dev, op, ": src[", i, "] is on ", s.device(), " but decay is on ", dev);
    const auto t = e.scalar_type();
    TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble, op, ": ema[", i,
                "] has dtype ", t, "; supported: float32, float16, bfloat16, float64");
    TORCH_CHECK(s.scalar_type() == e.scalar_type(), op, ": src[", i, "] has dtype ", s.scalar_type(), " but ema[",
                i, "] has dtype ", e.scalar_type());
    TORCH_CHECK(s.sizes() == e.sizes(), op, ": src[", i, "] has shape ", s.sizes(), " but ema[", i, "] has shape ",
                e.sizes());
    TORCH_CHECK(e.layout() == at::kStrided && e.is_non_overlapping_and_dense(), op, ": ema[", i,
                "] must be a dense tensor");
    if (s.strides() != e.strides()) s = at::empty_strided(e.sizes(), e.strides(), s.options()).copy_(s);
    at::Tensor r;
    if (!rems.empty() && t == at::kBFloat16) {
      r = rems[next_rem++];
      TORCH_CHECK(r.scalar_type() == at::kShort && r.device() == dev && r.sizes() == e.sizes() &&
                      r.strides() == e.strides(),
                  op, ": the remainder of ema[", i, "] must be an int16 tensor with its shape ", e.sizes(),
                  ", strides ", e.strides(), " and device ", dev, ", got ", r.scalar_type(), " of shape ", r.sizes(),
                  ", strides ", r.strides(), " on ", r.device());
    }
    if (e.numel() == 0) continue;
    es.push_back(e);
    ss.push_back(s);
    rs.push_back(r);
  }
  if (dev.is_cpu()) check_cpu_features(op);
  kernel(es, ss, rs, decay, fi);
}

}  // namespace detail
}  // namespace fusetrain

TORCH_LIBRARY_FRAGMENT(fusetrain, m) {
  m.set_python_module("fusetrain._ops");
  m.def("ema_update_(Tensor(a!)[] ema, Tensor[] src, Tensor decay, Tensor? found_inf=None, "
        "Tensor(b!)[]? remainders=None) -> ()");
}
