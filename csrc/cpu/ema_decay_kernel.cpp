// CPU kernel of fusetrain::ema_decay_: the schedule (ema_decay_math in
// csrc/common/optim_math.h) evaluated on the host's copy of the counter.
#include <torch/library.h>
#include <ATen/core/Tensor.h>

#include "../common/op_kernels.h"

namespace fusetrain {
namespace detail {

void ema_decay_cpu(const at::Tensor& decay_out, const at::Tensor& step, const at::Tensor& total,
                   const EmaSchedule& schedule) {
  const float t = total.defined() ? *total.const_data_ptr<float>() : 1.f;
  *decay_out.data_ptr<float>() = ema_decay_math(*step.const_data_ptr<float>(), t, schedule);
}

}  // namespace detail
}  // namespace fusetrain

// NOTE [kernel registration] in csrc/common/dispatch.h.
TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  using namespace fusetrain::detail;
  m.impl("ema_decay_", bind_kernel<&ema_decay_impl, &ema_decay_cpu>());
}
