// CPU kernel for fusetrain::grad_stats: one read of each gradient, producing
// the sum of squares (fp32 lanes, fp64 for float64 gradients, within small
// blocks; block sums in double) and a non-finite flag. NOTE [non-finite probe]: x * 0 is NaN exactly when x is inf
// or NaN, so summing x * 0 detects non-finite values without a compare and
// without being fooled by a sum of squares that overflows.
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../common/op_kernels.h"
#include "parallel.h"
#include "work_items.h"

namespace fusetrain {
namespace detail {
namespace {

constexpr int64_t kChunk = 65536;
constexpr int64_t kBlock = 1024;

template <typename C>
inline C reduce_lanes(const at::vec::Vectorized<C>& v) {
  alignas(64) C lanes[at::vec::Vectorized<C>::size()];
  v.store(lanes);
  C s = 0;
  for (int64_t i = 0; i < at::vec::Vectorized<C>::size(); ++i) s += lanes[i];
  return s;
}

// Lanes of C (float; double for float64 gradients) within a block of kBlock
// elements; block sums are added in double.
template <typename G>
void partial_stats(const G* g, int64_t n, double* sumsq_out, bool* nonfinite_out) {
  using C = std::conditional_t<std::is_same_v<G, double>, double, float>;
  using Vec = at::vec::Vectorized<C>;
  Vec probe(C(0));
  const Vec zero(C(0));
  alignas(64) C buf[kBlock];
  constexpr int64_t VS = Vec::size();
  double total = 0.0;
  for (int64_t off = 0; off < n; off += kBlock) {
    Vec acc0(C(0)), acc1(C(0));
    const int64_t m = std::min(kBlock, n - off);
    const C* x;
    if constexpr (std::is_same_v<G, C>) {
      x = g + off;
    } else {
      at::vec::convert(g + off, buf, m);
      x = buf;
    }
    int64_t i = 0;
    for (; i + 2 * VS <= m; i += 2 * VS) {
      Vec a = Vec::loadu(x + i);
      Vec b = Vec::loadu(x + i + VS);
      acc0 = at::vec::fmadd(a, a, acc0);
      acc1 = at::vec::fmadd(b, b, acc1);
      probe = probe + a * zero + b * zero;
    }
    for (; i < m; i += VS) {
      const int c = static_cast<int>(std::min<int64_t>(VS, m - i));
      Vec a = Vec::loadu(x + i, c);
      acc0 = at::vec::fmadd(a, a, acc0);
      probe = probe + a * zero;
    }
    total += static_cast<double>(reduce_lanes(acc0 + acc1));
  }
  *sumsq_out = total;
  *nonfinite_out = std::isnan(reduce_lanes(probe));
}

}  // namespace

void grad_stats_cpu(const std::vector<at::Tensor>& grads, const at::Tensor& inv_scale, const at::Tensor& norm_out,
                    const at::Tensor& found_inf_out) {
  const std::vector<WorkItem> items = make_work_items(grads, kChunk);
  std::vector<double> sums(items.size(), 0.0);
  std::vector<char> nonfinite(items.size(), 0);
  parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const WorkItem& it = items[i];
      const at::Tensor& g = grads[it.tensor];
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "grad_stats_cpu", [&] {
        bool nf = false;
        partial_stats(g.const_data_ptr<scalar_t>() + it.begin, it.end - it.begin, &sums[i], &nf);
        nonfinite[i] = nf;
      });
    }
  });
  double total = 0.0;
  bool any_nf = false;
  for (size_t i = 0; i < items.size(); ++i) {
    total += sums[i];
    any_nf = any_nf || nonfinite[i];
  }
  float norm = static_cast<float>(std::sqrt(total));
  if (inv_scale.defined()) norm *= *inv_scale.const_data_ptr<float>();
  *norm_out.data_ptr<float>() = norm;
  *found_inf_out.data_ptr<float>() = any_nf ? 1.f : 0.f;
}

}  // namespace detail
}  // namespace fusetrain

// NOTE [kernel registration] in csrc/common/dispatch.h.
TORCH_LIBRARY_IMPL(fusetrain, CPU, m) {
  using namespace fusetrain::detail;
  m.impl("grad_stats", bind_kernel<&grad_stats_impl, &grad_stats_cpu>());
}
// With an empty list and no inv_scale there is no tensor to dispatch on; the
// dispatcher then uses this registration (the result lives on the CPU).
TORCH_LIBRARY_IMPL(fusetrain, CompositeExplicitAutograd, m) {
  m.impl("grad_stats", [](at::TensorList grads, const std::optional<at::Tensor>& inv_scale) {
    TORCH_CHECK(grads.empty() && !inv_scale.has_value(), "grad_stats: no kernel for the device of ",
                grads.empty() ? inv_scale->device() : grads[0].device(), " in this build of fusetrain");
    return fusetrain::detail::grad_stats_impl(&fusetrain::detail::grad_stats_cpu, grads, inv_scale);
  });
}
