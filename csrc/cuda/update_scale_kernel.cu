// CUDA kernel of fusetrain::update_scale_: one thread applies the scale update
// (math in csrc/common/optim_math.h) in device memory.
#include <torch/library.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../common/op_kernels.h"

namespace fusetrain {
namespace detail {
namespace {

__global__ void update_scale_kernel(float* scale, int* growth_tracker, const float* found_inf, double growth_factor,
                                    double backoff_factor, int growth_interval) {
  update_scale_math(scale, growth_tracker, *found_inf, growth_factor, backoff_factor, growth_interval);
}

}  // namespace

void update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval) {
  c10::cuda::CUDAGuard guard(scale.device());
  update_scale_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      scale.data_ptr<float>(), growth_tracker.data_ptr<int>(), found_inf.const_data_ptr<float>(),
      growth_factor, backoff_factor, static_cast<int>(growth_interval));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace detail
}  // namespace fusetrain

// NOTE [kernel registration] in csrc/common/dispatch.h.
TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) {
  using namespace fusetrain::detail;
  m.impl("update_scale_", bind_kernel<&update_scale_impl, &update_scale_cuda>());
}
