// Batch-norm math shared by the CPU and CUDA kernels (csrc/cpu/syncbn_kernel.cpp,
// csrc/cuda/syncbn_kernel.cu), written once like optim_math.h.
#pragma once

#include "device_math.h"  // FT_HD

namespace fusetrain {
namespace detail {

// Chan's pairwise merge of (count, mean, M2) statistics: (n, mean, m2) becomes
// the statistics of the union with a set of nb elements of mean mean_b and sum
// of squared deviations m2_b. T is the accumulation type: float in the CUDA
// warp/block reductions, double wherever partials of a channel are combined.
template <typename T>
FT_HD void chan_merge(T& n, T& mean, T& m2, T nb, T mean_b, T m2_b) {
  if (nb == T(0)) return;
  const T tot = n + nb;
  const T delta = mean_b - mean;
  const T fb = nb / tot;
  mean += delta * fb;
  m2 += m2_b + delta * delta * n * fb;
  n = tot;
}

}  // namespace detail
}  // namespace fusetrain
