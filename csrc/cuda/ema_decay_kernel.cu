// CUDA kernel of fusetrain::ema_decay_: one thread evaluates the schedule
// (ema_decay_math in csrc/common/optim_math.h) in device memory.
#include <torch/library.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../common/op_kernels.h"

namespace fusetrain {
namespace detail {
namespace {

__global__ void ema_decay_kernel(float* decay_out, const float* step, const float* total, EmaSchedule schedule) {
  *decay_out = ema_decay_math(*step, total != nullptr ? *total : 1.f, schedule);
}

}  // namespace

void ema_decay_cuda(const at::Tensor& decay_out, const at::Tensor& step, const at::Tensor& total,
                    const EmaSchedule& schedule) {
  c10::cuda::CUDAGuard guard(decay_out.device());
  ema_decay_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      decay_out.data_ptr<float>(), step.const_data_ptr<float>(),
      total.defined() ? total.const_data_ptr<float>() : nullptr, schedule);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace detail
}  // namespace fusetrain

// NOTE [kernel registration] in csrc/common/dispatch.h.
TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) {
  using namespace fusetrain::detail;
  m.impl("ema_decay_", bind_kernel<&ema_decay_impl, &ema_decay_cuda>());
}
