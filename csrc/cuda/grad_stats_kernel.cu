// CUDA kernel for fusetrain::grad_stats: each block reduces one chunk to a
// partial sum of squares and a non-finite flag; a second single-block kernel
// combines the partials (deterministically, in double) and writes the norm and
// the flag to device memory. No host synchronisation.
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "../common/op_kernels.h"
#include "multi_tensor_apply.cuh"

namespace fusetrain {
namespace detail {
namespace {

using cuda::kBlockThreads;
using cuda::kChunkSize;
using cuda::kILP;
using StatsMeta = cuda::TensorListMeta<1, 384, 1280>;
static_assert(cuda::fits_kernel_params<StatsMeta, double*, int*>(), "partial_stats_kernel arguments too large");

template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T* shared) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) / 32;
  v = threadIdx.x < warps ? shared[threadIdx.x] : T(0);
  if (warp == 0) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
  }
  __syncthreads();
  return v;
}

struct Add {
  template <typename T>
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct Or {
  __device__ int operator()(int a, int b) const { return a | b; }
};

__device__ __forceinline__ float fma_c(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_c(double a, double b, double c) { return fma(a, b, c); }

// Partial sums are kept in double (a float64 gradient's sum of squares may
// exceed the float range); the per-thread accumulator is float, or double for
// float64 gradients.
template <typename G>
__global__ void __launch_bounds__(kBlockThreads) partial_stats_kernel(StatsMeta meta, double* partial_sum,
                                                                      int* partial_nf) {
  using C = std::conditional_t<std::is_same_v<G, double>, double, float>;
  __shared__ C ssum[32];
  __shared__ int snf[32];
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t rem = meta.numel[t] - start;
  const int64_t len = rem < kChunkSize ? rem : kChunkSize;
  const G* g = static_cast<const G*>(meta.addrs[0][t]) + start;
  C acc = 0;
  int nf = 0;
  int64_t vec_end = 0;
  if (cuda::is_aligned(g)) {
    vec_end = len - len % kILP;
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * kILP; i < vec_end; i += kBlockThreads * kILP) {
      C x[kILP];
      cuda::load_vec(x, g + i);
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
        acc = fma_c(x[k], x[k], acc);
        nf |= !isfinite(x[k]);
      }
    }
  }
  for (int64_t i = vec_end + threadIdx.x; i < len; i += kBlockThreads) {
    const C x = static_cast<C>(g[i]);
    acc = fma_c(x, x, acc);
    nf |= !isfinite(x);
  }
  acc = block_reduce(acc, Add{}, ssum);
  nf = block_reduce(nf, Or{}, snf);
  if (threadIdx.x == 0) {
    partial_sum[meta.block_offset + blockIdx.x] = static_cast<double>(acc);
    partial_nf[meta.block_offset + blockIdx.x] = nf;
  }
}

__global__ void finish_stats_kernel(const double* partial_sum, const int* partial_nf, int64_t n,
                                    const float* inv_scale, float* norm_out, float* found_inf_out) {
  __shared__ double ssum[32];
  __shared__ int snf[32];
  double acc = 0.0;
  int nf = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    acc += partial_sum[i];
    nf |= partial_nf[i];
  }
  acc = block_reduce(acc, Add{}, ssum);
  nf = block_reduce(nf, Or{}, snf);
  if (threadIdx.x == 0) {
    float norm = static_cast<float>(sqrt(acc));
    if (inv_scale != nullptr) norm *= *inv_scale;
    *norm_out = norm;
    *found_inf_out = nf ? 1.f : 0.f;
  }
}

}  // namespace

void grad_stats_cuda(const std::vector<at::Tensor>& grads, const at::Tensor& inv_scale, const at::Tensor& norm_out,
                     const at::Tensor& found_inf_out) {
  c10::cuda::CUDAGuard guard(norm_out.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t chunks = cuda::count_chunks(grads);
  at::Tensor partial_sum = at::empty({std::max<int64_t>(chunks, 1)}, norm_out.options().dtype(at::kDouble));
  at::Tensor partial_nf = at::empty({std::max<int64_t>(chunks, 1)}, norm_out.options().dtype(at::kInt));
  // Lists are bucketed by dtype so that each launch has one element type;
  // partial outputs of later buckets follow those of earlier ones.
  int64_t base = 0;
  for (at::ScalarType st : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble}) {
    std::vector<at::Tensor> bucket;
    for (const auto& g : grads) {
      if (g.scalar_type() == st) bucket.push_back(g);
    }
    if (bucket.empty()) continue;
    double* ps = partial_sum.data_ptr<double>() + base;
    int* pn = partial_nf.data_ptr<int>() + base;
    const std::vector<const std::vector<at::Tensor>*> lists = {&bucket};
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "grad_stats_cuda", [&] {
      cuda::multi_tensor_apply<StatsMeta>(lists, {}, {}, [&](const StatsMeta& meta, int blocks) {
        partial_stats_kernel<scalar_t><<<blocks, kBlockThreads, 0, stream>>>(meta, ps, pn);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    base += cuda::count_chunks(bucket);
  }
  finish_stats_kernel<<<1, 1024, 0, stream>>>(partial_sum.data_ptr<double>(), partial_nf.data_ptr<int>(), chunks,
                                               inv_scale.defined() ? inv_scale.const_data_ptr<float>() : nullptr,
                                               norm_out.data_ptr<float>(), found_inf_out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace detail
}  // namespace fusetrain

// NOTE [kernel registration] in csrc/common/dispatch.h.
TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) {
  using namespace fusetrain::detail;
  m.impl("grad_stats", bind_kernel<&grad_stats_impl, &grad_stats_cuda>());
}
