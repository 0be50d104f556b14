// CUDA kernels of the batch-norm ops (csrc/ops/syncbn.cpp).
//
// Reductions run in two launches: a partial kernel over a (channel, split)
// grid writes one partial result per (channel, split), and a finishing kernel
// merges the partials of each channel in double, in a fixed order (so results
// are deterministic). Partial kernels:
//   NCS: one block per (channel, split); the block's threads stride over the
//        channel's elements of the split in (n, s) order, so short rows (7x7
//        feature maps) keep every thread busy.
//   NSC: 2-D tiles: 32 channels (threadIdx.x, coalesced) x 8 row lanes
//        (threadIdx.y) per block, splits over rows in blockIdx.y.
// Statistics are per-thread Welford updates in fp32 merged with Chan's formula
// (NOTE [batch-norm statistics] in csrc/cpu/syncbn_kernel.cpp); gradient sums
// are fp32 per thread. Element-wise kernels are grid-stride loops.
//
// NOTE [32-bit indexing]: per-element index math (the channel of a flat index,
// the (n, s) of a channel element) uses 32-bit unsigned integers and ATen's
// IntDivider (a multiply-high and a shift instead of a division) whenever the
// tensor has fewer than 2^31 elements; larger tensors take a 64-bit variant.
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../common/bn_math.h"
#include "../common/syncbn.h"

namespace fusetrain {
namespace detail {
namespace {

constexpr int kThreads = 256;
constexpr int kTileC = 32;
constexpr int kTileR = 8;

// Three floats: (n, mean, m2) for statistics, (unused, sum_dy, sum_dy_xmu)
// for gradient sums.
struct Acc {
  float n, a, b;
};

template <bool kGrad>
__device__ __forceinline__ Acc merge(const Acc& x, const Acc& y) {
  if constexpr (kGrad) {
    return {0.f, x.a + y.a, x.b + y.b};
  } else {
    Acc r = x;
    chan_merge(r.n, r.a, r.b, y.n, y.a, y.b);
    return r;
  }
}

template <bool kGrad>
__device__ __forceinline__ void update(Acc& acc, float x, float dy, float mean) {
  if constexpr (kGrad) {
    acc.a += dy;
    acc.b = fmaf(dy, x - mean, acc.b);
  } else {
    acc.n += 1.f;
    const float d = x - acc.a;
    acc.a += d / acc.n;
    acc.b = fmaf(d, x - acc.a, acc.b);
  }
}

__device__ __forceinline__ Acc shfl_down(const Acc& v, int o) {
  return {__shfl_down_sync(0xffffffffu, v.n, o), __shfl_down_sync(0xffffffffu, v.a, o),
          __shfl_down_sync(0xffffffffu, v.b, o)};
}

// Partial reduction of the NCS layout: block (c, split) covers the elements
// [split * per_split, ...) of channel c, in (n, s) order.
template <typename T, typename index_t, bool kGrad>
__global__ void __launch_bounds__(kThreads) partial_ncs_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                                               const float* __restrict__ mean, index_t L, index_t C,
                                                               at::cuda::detail::IntDivider<index_t> div_s,
                                                               index_t per_split, Acc* partial) {
  const index_t c = blockIdx.x;
  const index_t S = div_s.divisor;
  const index_t begin = static_cast<index_t>(blockIdx.y) * per_split;
  const index_t end = min(L, begin + per_split);
  const float m = kGrad ? mean[c] : 0.f;
  Acc acc{0.f, 0.f, 0.f};
  for (index_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
    const auto ns = div_s.divmod(e);
    const index_t i = (ns.div * C + c) * S + ns.mod;
    const float xv = static_cast<float>(x[i]);
    const float gv = kGrad ? static_cast<float>(dy[i]) : 0.f;
    update<kGrad>(acc, xv, gv, m);
  }
  __shared__ Acc shared[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) acc = merge<kGrad>(acc, shfl_down(acc, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    Acc r = shared[0];
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) r = merge<kGrad>(r, shared[w]);
    partial[static_cast<int64_t>(c) * gridDim.y + blockIdx.y] = r;
  }
}

// Partial reduction of the NSC layout: rows r (= n*S + s) at x + r*C.
template <typename T, bool kGrad>
__global__ void __launch_bounds__(kTileC* kTileR) partial_nsc_kernel(const T* __restrict__ x,
                                                                      const T* __restrict__ dy,
                                                                      const float* __restrict__ mean, int64_t R,
                                                                      int64_t C, int64_t rows_per_split,
                                                                      Acc* partial) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kTileC + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_split;
  const int64_t r1 = min(R, r0 + rows_per_split);
  Acc acc{0.f, 0.f, 0.f};
  if (c < C) {
    const float m = kGrad ? mean[c] : 0.f;
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kTileR) {
      const float xv = static_cast<float>(x[r * C + c]);
      const float gv = kGrad ? static_cast<float>(dy[r * C + c]) : 0.f;
      update<kGrad>(acc, xv, gv, m);
    }
  }
  __shared__ Acc shared[kTileR][kTileC];
  shared[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    Acc res = shared[0][threadIdx.x];
    for (int k = 1; k < kTileR; ++k) res = merge<kGrad>(res, shared[k][threadIdx.x]);
    partial[c * gridDim.y + blockIdx.y] = res;
  }
}

// One thread per channel merges its `splits` partials in double.
template <bool kGrad>
__global__ void finish_kernel(const Acc* partial, int64_t C, int splits, float* out_a, float* out_b) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double n = 0.0, a = 0.0, b = 0.0;
  for (int k = 0; k < splits; ++k) {
    const Acc p = partial[c * splits + k];
    if constexpr (kGrad) {
      a += p.a;
      b += p.b;
    } else {
      chan_merge(n, a, b, static_cast<double>(p.n), static_cast<double>(p.a), static_cast<double>(p.b));
    }
  }
  out_a[c] = static_cast<float>(a);
  out_b[c] = static_cast<float>(b);
}

int target_blocks() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 4; }

// NOTE [32-bit indexing]
bool fits_32bit(const at::Tensor& x) { return x.numel() < (int64_t{1} << 31); }

template <bool kGrad>
void reduce_launch(const at::Tensor& x, const at::Tensor& dy, const BnShape& sh, const at::Tensor& mean,
                   const at::Tensor& out_a, const at::Tensor& out_b) {
  c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t L = sh.per_channel();
  if (sh.C == 0) return;
  if (L == 0) {
    out_a.zero_();
    out_b.zero_();
    return;
  }
  const int64_t target = target_blocks();
  int64_t splits;
  dim3 grid, block;
  if (sh.layout == BnLayout::NCS) {
    // At least 4096 elements per block; enough blocks to fill the device.
    splits = std::max<int64_t>(1, std::min<int64_t>((target + sh.C - 1) / sh.C, (L + 4095) / 4096));
    splits = std::min<int64_t>(splits, 65535);
    grid = dim3(static_cast<unsigned>(sh.C), static_cast<unsigned>(splits));
    block = dim3(kThreads);
    TORCH_CHECK(sh.C <= 2147483647, "batch norm: too many channels for one launch: ", sh.C);
  } else {
    const int64_t tiles = (sh.C + kTileC - 1) / kTileC;
    splits = std::max<int64_t>(1, std::min<int64_t>((target + tiles - 1) / tiles, (L + 255) / 256));
    splits = std::min<int64_t>(splits, 65535);
    grid = dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(splits));
    block = dim3(kTileC, kTileR);
  }
  at::Tensor partial = at::empty({sh.C * splits * 3}, x.options().dtype(at::kFloat));
  Acc* pp = reinterpret_cast<Acc*>(partial.data_ptr<float>());
  const float* mp = kGrad ? mean.const_data_ptr<float>() : nullptr;
  const bool small = fits_32bit(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bn_reduce_cuda", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* gp = kGrad ? dy.const_data_ptr<scalar_t>() : nullptr;
    if (sh.layout == BnLayout::NCS) {
      const int64_t per_split = (L + splits - 1) / splits;
      const int64_t S = std::max<int64_t>(sh.S, 1);
      if (small) {
        using I = uint32_t;
        partial_ncs_kernel<scalar_t, I, kGrad><<<grid, block, 0, stream>>>(
            xp, gp, mp, static_cast<I>(L), static_cast<I>(sh.C), at::cuda::detail::IntDivider<I>(static_cast<I>(S)),
            static_cast<I>(per_split), pp);
      } else {
        partial_ncs_kernel<scalar_t, int64_t, kGrad><<<grid, block, 0, stream>>>(
            xp, gp, mp, L, sh.C, at::cuda::detail::IntDivider<int64_t>(S), per_split, pp);
      }
    } else {
      const int64_t rows_per_split = (L + splits - 1) / splits;
      partial_nsc_kernel<scalar_t, kGrad><<<grid, block, 0, stream>>>(xp, gp, mp, L, sh.C, rows_per_split, pp);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  const int fin_threads = 256;
  const unsigned fin_blocks = static_cast<unsigned>((sh.C + fin_threads - 1) / fin_threads);
  finish_kernel<kGrad><<<fin_blocks, fin_threads, 0, stream>>>(pp, sh.C, static_cast<int>(splits),
                                                               out_a.data_ptr<float>(), out_b.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// out = p*(dy) + q*(x - mean) + r with per-channel p, q, r computed from the
// arguments in the kernel (forward: p = 0, q = invstd*w, r = b). The channel of
// flat index i is i mod C (NSC) or (i / S) mod C (NCS).
template <typename T, typename index_t, bool kBackward, bool kNsc>
__global__ void elemt_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ out, index_t total,
                             at::cuda::detail::IntDivider<index_t> div_c, at::cuda::detail::IntDivider<index_t> div_s,
                             const float* __restrict__ mean, const float* __restrict__ invstd,
                             const float* __restrict__ weight, const float* __restrict__ bias,
                             const float* __restrict__ sum_dy, const float* __restrict__ sum_dy_xmu,
                             const float* __restrict__ count) {
  float inv_n = 0.f;
  if constexpr (kBackward) {
    const float n = *count;
    inv_n = n > 0.f ? 1.f / n : 0.f;
  }
  const index_t stride = static_cast<index_t>(gridDim.x) * blockDim.x;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const index_t c = kNsc ? div_c.mod(i) : div_c.mod(div_s.div(i));
    const float is = invstd[c];
    const float a = weight != nullptr ? is * weight[c] : is;
    const float xm = static_cast<float>(x[i]) - mean[c];
    float v;
    if constexpr (kBackward) {
      const float k1 = sum_dy[c] * inv_n;
      const float k2 = is * is * sum_dy_xmu[c] * inv_n;
      v = a * (static_cast<float>(dy[i]) - k1 - xm * k2);
    } else {
      v = fmaf(a, xm, bias != nullptr ? bias[c] : 0.f);
    }
    out[i] = static_cast<T>(v);
  }
}

template <bool kBackward>
void elemt_launch(const at::Tensor& x, const at::Tensor& dy, const BnShape& sh, const at::Tensor& mean,
                  const at::Tensor& invstd, const at::Tensor& weight, const at::Tensor& bias,
                  const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu, const at::Tensor& count,
                  const at::Tensor& out) {
  c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t total = x.numel();
  if (total == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, static_cast<int64_t>(target_blocks()) * 8);
  const float* wp = weight.defined() ? weight.const_data_ptr<float>() : nullptr;
  const float* bp = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  const float* sdp = kBackward ? sum_dy.const_data_ptr<float>() : nullptr;
  const float* sdxp = kBackward ? sum_dy_xmu.const_data_ptr<float>() : nullptr;
  const float* cp = kBackward ? count.const_data_ptr<float>() : nullptr;
  const bool nsc = sh.layout == BnLayout::NSC;
  const int64_t S = std::max<int64_t>(sh.S, 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bn_elemt_cuda", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* gp = kBackward ? dy.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    const float* mp = mean.const_data_ptr<float>();
    const float* ip = invstd.const_data_ptr<float>();
    auto launch = [&](auto index_tag, auto nsc_tag) {
      using I = decltype(index_tag);
      constexpr bool kNsc = decltype(nsc_tag)::value;
      elemt_kernel<scalar_t, I, kBackward, kNsc><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
          xp, gp, op, static_cast<I>(total), at::cuda::detail::IntDivider<I>(static_cast<I>(sh.C)),
          at::cuda::detail::IntDivider<I>(static_cast<I>(S)), mp, ip, wp, bp, sdp, sdxp, cp);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    using Nsc = std::true_type;
    using Ncs = std::false_type;
    if (fits_32bit(x)) {
      nsc ? launch(uint32_t{}, Nsc{}) : launch(uint32_t{}, Ncs{});
    } else {
      nsc ? launch(int64_t{}, Nsc{}) : launch(int64_t{}, Ncs{});
    }
  });
}

}  // namespace

void bn_stats_cuda(const at::Tensor& x, const BnShape& shape, const at::Tensor& mean, const at::Tensor& m2) {
  reduce_launch<false>(x, at::Tensor(), shape, at::Tensor(), mean, m2);
}

void bn_backward_reduce_cuda(const at::Tensor& dy, const at::Tensor& x, const BnShape& shape, const at::Tensor& mean,
                             const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu) {
  reduce_launch<true>(x, dy, shape, mean, sum_dy, sum_dy_xmu);
}

void bn_elemt_cuda(const at::Tensor& x, const BnShape& shape, const at::Tensor& mean, const at::Tensor& invstd,
                   const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& out) {
  elemt_launch<false>(x, at::Tensor(), shape, mean, invstd, weight, bias, at::Tensor(), at::Tensor(), at::Tensor(),
                      out);
}

void bn_backward_elemt_cuda(const at::Tensor& dy, const at::Tensor& x, const BnShape& shape, const at::Tensor& mean,
                            const at::Tensor& invstd, const at::Tensor& weight, const at::Tensor& sum_dy,
                            const at::Tensor& sum_dy_xmu, const at::Tensor& count, const at::Tensor& dx) {
  elemt_launch<true>(x, dy, shape, mean, invstd, weight, at::Tensor(), sum_dy, sum_dy_xmu, count, dx);
}

}  // namespace detail
}  // namespace fusetrain

// NOTE [kernel registration] in csrc/common/dispatch.h.
TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) {
  using namespace fusetrain::detail;
  m.impl("bn_stats", bind_kernel<&bn_stats_impl, &bn_stats_cuda>());
  m.impl("bn_backward_reduce", bind_kernel<&bn_backward_reduce_impl, &bn_backward_reduce_cuda>());
  m.impl("bn_elemt", bind_kernel<&bn_elemt_impl, &bn_elemt_cuda>());
  m.impl("bn_backward_elemt", bind_kernel<&bn_backward_elemt_impl, &bn_backward_elemt_cuda>());
}
