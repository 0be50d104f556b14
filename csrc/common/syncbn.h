// Internal interface between the batch-norm ops (csrc/ops/syncbn.cpp) and
// their kernels (csrc/cpu/syncbn_kernel.cpp, csrc/cuda/syncbn_kernel.cu).
// Not part of the public API.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "dispatch.h"

namespace fusetrain {
namespace detail {

// A batch-norm input (N, C, *) seen as (N, C, S) with S the product of the
// trailing dims, in one of the two memory layouts the kernels read directly:
//   NCS: element (n, c, s) at (n*C + c)*S + s   (contiguous)
//   NSC: element (n, c, s) at (n*S + s)*C + c   (channels_last / (N, C) rows)
enum class BnLayout : int { NCS = 0, NSC = 1 };

struct BnShape {
  int64_t N = 0, C = 0, S = 0;
  BnLayout layout = BnLayout::NCS;
  int64_t per_channel() const { return N * S; }
};

using BnStatsKernel = void (*)(const at::Tensor& x, const BnShape& shape, const at::Tensor& mean,
                               const at::Tensor& m2);
using BnBackwardReduceKernel = void (*)(const at::Tensor& dy, const at::Tensor& x, const BnShape& shape,
                                        const at::Tensor& mean, const at::Tensor& sum_dy,
                                        const at::Tensor& sum_dy_xmu);
using BnElemtKernel = void (*)(const at::Tensor& x, const BnShape& shape, const at::Tensor& mean,
                               const at::Tensor& invstd, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& out);
using BnBackwardElemtKernel = void (*)(const at::Tensor& dy, const at::Tensor& x, const BnShape& shape,
                                       const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& weight,
                                       const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu,
                                       const at::Tensor& count, const at::Tensor& dx);

// The ops (csrc/ops/syncbn.cpp), registered by the kernel files with their
// kernel bound (NOTE [kernel registration] in dispatch.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_stats_impl(BnStatsKernel kernel, const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> bn_backward_reduce_impl(BnBackwardReduceKernel kernel, const at::Tensor& dy,
                                                           const at::Tensor& x, const at::Tensor& mean);
at::Tensor bn_elemt_impl(BnElemtKernel kernel, const at::Tensor& x, const at::Tensor& mean,
                         const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& bias);
at::Tensor bn_backward_elemt_impl(BnBackwardElemtKernel kernel, const at::Tensor& dy, const at::Tensor& x,
                                  const at::Tensor& mean, const at::Tensor& invstd,
                                  const std::optional<at::Tensor>& weight, const at::Tensor& sum_dy,
                                  const at::Tensor& sum_dy_xmu, const at::Tensor& count);

// All per-channel tensors are float32, contiguous, with C elements, on the
// device of x; weight/bias are undefined when absent; count is one float32.
void bn_stats_cpu(const at::Tensor& x, const BnShape& shape, const at::Tensor& mean, const at::Tensor& m2);
void bn_backward_reduce_cpu(const at::Tensor& dy, const at::Tensor& x, const BnShape& shape, const at::Tensor& mean,
                            const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu);
void bn_elemt_cpu(const at::Tensor& x, const BnShape& shape, const at::Tensor& mean, const at::Tensor& invstd,
                  const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& out);
void bn_backward_elemt_cpu(const at::Tensor& dy, const at::Tensor& x, const BnShape& shape, const at::Tensor& mean,
                           const at::Tensor& invstd, const at::Tensor& weight, const at::Tensor& sum_dy,
                           const at::Tensor& sum_dy_xmu, const at::Tensor& count, const at::Tensor& dx);

void bn_stats_cuda(const at::Tensor& x, const BnShape& shape, const at::Tensor& mean, const at::Tensor& m2);
void bn_backward_reduce_cuda(const at::Tensor& dy, const at::Tensor& x, const BnShape& shape, const at::Tensor& mean,
                             const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu);
void bn_elemt_cuda(const at::Tensor& x, const BnShape& shape, const at::Tensor& mean, const at::Tensor& invstd,
                   const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& out);
void bn_backward_elemt_cuda(const at::Tensor& dy, const at::Tensor& x, const BnShape& shape, const at::Tensor& mean,
                            const at::Tensor& invstd, const at::Tensor& weight, const at::Tensor& sum_dy,
                            const at::Tensor& sum_dy_xmu, const at::Tensor& count, const at::Tensor& dx);

}  // namespace detail
}  // namespace fusetrain
