// CPU kernel of fusetrain::gated_copy_: the flag is read where it lives (host
// memory), then each dense pair is one memcpy of its bytes.
#include <torch/library.h>

#include <cstring>

#include "../common/op_kernels.h"

namespace fusetrain {
namespace detail {

void gated_copy_cpu(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src,
                    const at::Tensor& found_inf) {
  if (*found_inf.const_data_ptr<float>() != 0.f) return;
  for (size_t i = 0; i < dst.size(); ++i) {
    // Dense with one layout: the pair's elements are the same span of bytes.
    std::memcpy(dst[i].data_ptr(), src[i].const_data_ptr(), dst[i].numel() * dst[i].element_size());
  }
}

}  // namespace detail
}  // namespace fusetrain

// NOTE [kernel registration] in csrc/common/dispatch.h.
TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  using namespace fusetrain::detail;
  m.impl("gated_copy_", bind_kernel<&gated_copy_impl, &gated_copy_cpu>());
}
