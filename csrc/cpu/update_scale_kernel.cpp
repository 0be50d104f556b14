// CPU kernel of fusetrain::update_scale_ (math in csrc/common/optim_math.h).
#include <torch/library.h>
#include <ATen/core/Tensor.h>

#include "../common/op_kernels.h"

namespace fusetrain {
namespace detail {

void update_scale_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                      double growth_factor, double backoff_factor, int64_t growth_interval) {
  update_scale_math(scale.data_ptr<float>(), growth_tracker.data_ptr<int>(), *found_inf.const_data_ptr<float>(),
                    growth_factor, backoff_factor,
                    static_cast<int>(growth_interval));
}

}  // namespace detail
}  // namespace fusetrain

// NOTE [kernel registration] in csrc/common/dispatch.h.
TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  using namespace fusetrain::detail;
  m.impl("update_scale_", bind_kernel<&update_scale_impl, &update_scale_cpu>());
}
