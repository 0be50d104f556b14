// CUDA kernel of fusetrain::ema_update_: chunked multi-tensor launches
// (multi_tensor_apply.cuh), decay and found_inf read on the device.
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <type_traits>

#include "../common/lean_state.h"
#include "../common/op_kernels.h"
#include "multi_tensor_apply.cuh"

namespace fusetrain {
namespace detail {
namespace {

using cuda::kBlockThreads;
using cuda::kChunkSize;
using cuda::kILP;
// Depth 3: ema, src, the ema's int16 remainder (NOTE [ema remainder]; bfloat16 only).
using EmaMeta = cuda::TensorListMeta<3, 192, 1280>;
static_assert(cuda::fits_kernel_params<EmaMeta, const float*, const float*>(), "ema_update_kernel arguments too large");

template <typename T>
__global__ void __launch_bounds__(kBlockThreads) ema_update_kernel(EmaMeta meta, const float* decay,
                                                                   const float* found_inf) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;  // the math's precision
  if (found_inf != nullptr && *found_inf != 0.f) return;
  const C w = static_cast<C>(1.f - *decay);
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t left = meta.numel[t] - start;
  const int64_t len = left < kChunkSize ? left : kChunkSize;
  T* ema = static_cast<T*>(meta.addrs[0][t]) + start;
  const T* src = static_cast<const T*>(meta.addrs[1][t]) + start;
  int16_t* rem = meta.addrs[2][t] ? static_cast<int16_t*>(meta.addrs[2][t]) + start : nullptr;
  // The EMA's value: joined with its remainder when it has one.
  auto load = [&](int64_t i) -> C {
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (rem) return join_remainder(ema[i].x, rem[i]);
    }
    return static_cast<C>(ema[i]);
  };
  auto store = [&](int64_t i, C e) {
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (rem) {
        uint16_t bits;
        split_remainder(e, bits, rem[i]);
        ema[i] = T(bits, T::from_bits());
        return;
      }
    }
    ema[i] = static_cast<T>(e);
  };
  int64_t vec_end = 0;
  if (cuda::is_aligned(ema) && cuda::is_aligned(src) && (!rem || cuda::is_aligned(rem))) {
    vec_end = len - len % kILP;
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * kILP; i < vec_end; i += kBlockThreads * kILP) {
      C e[kILP], s[kILP];
      if (rem) {
#pragma unroll
        for (int k = 0; k < kILP; ++k) e[k] = load(i + k);
      } else {
        cuda::load_vec(e, ema + i);
      }
      cuda::load_vec(s, src + i);
#pragma unroll
      for (int k = 0; k < kILP; ++k) e[k] = lerp_small_weight(e[k], s[k], w);
      if (rem) {
#pragma unroll
        for (int k = 0; k < kILP; ++k) store(i + k, e[k]);
      } else {
        cuda::store_vec(ema + i, e);
      }
    }
  }
  for (int64_t i = vec_end + threadIdx.x; i < len; i += kBlockThreads) {
    store(i, lerp_small_weight(load(i), static_cast<C>(src[i]), w));
  }
}

}  // namespace

void ema_update_cuda(const std::vector<at::Tensor>& ema, const std::vector<at::Tensor>& src,
                     const std::vector<at::Tensor>& rem, const at::Tensor& decay, const at::Tensor& found_inf) {
  if (ema.empty()) return;
  c10::cuda::CUDAGuard guard(decay.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const float* fi = found_inf.defined() ? found_inf.const_data_ptr<float>() : nullptr;
  // One launch sequence per dtype, bfloat16 with and without remainders apart.
  for (int bucket = 0; bucket < 5; ++bucket) {
    const at::ScalarType st = bucket == 4 ? at::kBFloat16 : std::array<at::ScalarType, 4>{
        at::kFloat, at::kHalf, at::kBFloat16, at::kDouble}[bucket];
    const bool with_rem = bucket == 4;
    std::vector<at::Tensor> eb, sb, rb;
    for (size_t i = 0; i < ema.size(); ++i) {
      if (ema[i].scalar_type() == st && rem[i].defined() == with_rem) {
        eb.push_back(ema[i]);
        sb.push_back(src[i]);
        if (with_rem) rb.push_back(rem[i]);
      }
    }
    if (eb.empty()) continue;
    const std::vector<const std::vector<at::Tensor>*> lists = {&eb, &sb, &rb};
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "ema_update_cuda", [&] {
      cuda::multi_tensor_apply<EmaMeta>(lists, {}, {}, [&](const EmaMeta& meta, int blocks) {
        ema_update_kernel<scalar_t><<<blocks, kBlockThreads, 0, stream>>>(meta, decay.const_data_ptr<float>(), fi);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
}

}  // namespace detail
}  // namespace fusetrain

// NOTE [kernel registration] in csrc/common/dispatch.h.
TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) {
  using namespace fusetrain::detail;
  m.impl("ema_update_", bind_kernel<&ema_update_impl, &ema_update_cuda>());
}
