// CPU kernel of fusetrain::ema_update_: (tensor, chunk) items over
// at::parallel_for, Vectorized math on L1-resident blocks.
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../common/op_kernels.h"
#include "blocks.h"
#include "parallel.h"
#include "work_items.h"

namespace fusetrain {
namespace detail {
namespace {

constexpr int64_t kChunk = 32768;
constexpr int64_t kBlock = 512;

// fp32 math (fp64 for float64 tensors) on L1-resident blocks; `rem`: the
// int16 remainders of a bfloat16 EMA (NOTE [ema remainder]) or null.
template <typename T>
void ema_block(T* ema, const T* src, int16_t* rem, int64_t n, float w_f) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  using Vec = at::vec::Vectorized<C>;
  alignas(64) C eb[kBlock];
  alignas(64) C sb[kBlock];
  constexpr int64_t VS = Vec::size();
  const C w = static_cast<C>(w_f);
  for (int64_t off = 0; off < n; off += kBlock) {
    const int64_t m = std::min(kBlock, n - off);
    C* e;
    const C* s;
    if constexpr (std::is_same_v<T, C>) {
      e = ema + off;
      s = src + off;
    } else {
      load_block(ema + off, rem != nullptr ? rem + off : nullptr, eb, m);
      convert_block(src + off, sb, m);
      e = eb;
      s = sb;
    }
    for (int64_t i = 0; i < m; i += VS) {
      const int c = static_cast<int>(std::min<int64_t>(VS, m - i));
      Vec r = lerp_small_weight(Vec::loadu(e + i, c), Vec::loadu(s + i, c), w);
      r.store(e + i, c);
    }
    if constexpr (!std::is_same_v<T, C>) store_block(eb, ema + off, rem != nullptr ? rem + off : nullptr, m);
  }
}

}  // namespace

void ema_update_cpu(const std::vector<at::Tensor>& ema, const std::vector<at::Tensor>& src,
                    const std::vector<at::Tensor>& rem, const at::Tensor& decay, const at::Tensor& found_inf) {
  if (ema.empty()) return;
  if (found_inf.defined() && *found_inf.const_data_ptr<float>() != 0.f) return;
  const float w = 1.f - *decay.const_data_ptr<float>();
  const std::vector<WorkItem> items = make_work_items(ema, kChunk);
  parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const WorkItem& it = items[i];
      const at::Tensor& et = ema[it.tensor];
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, et.scalar_type(), "ema_update_cpu", [&] {
        const at::Tensor& rt = rem[it.tensor];
        ema_block(et.data_ptr<scalar_t>() + it.begin, src[it.tensor].const_data_ptr<scalar_t>() + it.begin,
                  rt.defined() ? rt.data_ptr<int16_t>() + it.begin : nullptr, it.end - it.begin, w);
      });
    }
  });
}

}  // namespace detail
}  // namespace fusetrain

// NOTE [kernel registration] in csrc/common/dispatch.h.
TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  using namespace fusetrain::detail;
  m.impl("ema_update_", bind_kernel<&ema_update_impl, &ema_update_cpu>());
}
