// The pieces both CUDA update kernels share (fused_update_kernel.cu, the
// vectorised one; fused_update_q8_kernel.cu, the 8-bit one): their launch
// arguments, the block's copy of the settings, how a chunk's params and EMA
// are read and written in each form of NOTE [lean state], and the stalled
// count. Internal header.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime_api.h>

#include <type_traits>
#include <vector>

#include "../common/kind_dispatch.h"
#include "../common/lean_state.h"
#include "../common/step_math.h"
#include "multi_tensor_apply.cuh"

namespace fusetrain {
namespace detail {

using cuda::kBlockThreads;
using cuda::kChunkSize;
using cuda::kILP;

struct KernelArgs {
  OptimHyper hyper;      // with maximize and max_grad_norm
  const double* values;  // NOTE [device values]; null when absent
  const float* lr;
  const float* inv_scale;
  const float* found_inf;
  const float* grad_norm;
  const float* ema_decay;
  bool remainder;  // the masters are int16 remainders of bfloat16 params (NOTE [lean state])
  unsigned long long* stalled;  // NOTE [stalled updates]; null: not counted
};

// NOTE [block hyper]: the step's settings with the device values written over
// them (read_device_values), made once per CUDA block in shared memory. The
// values land in fields known only at run time, so a copy in each thread's
// registers cannot be: it would be a stack frame of the struct's size in
// local memory, written by every thread of every block (the update pass
// reached 81% of the copy bandwidth on an H200 so, 99% with the block's
// copy). Both update kernels read the block's copy.
__device__ __forceinline__ const OptimHyper& block_hyper(const KernelArgs& a) {
  __shared__ alignas(OptimHyper) unsigned char storage[sizeof(OptimHyper)];
  OptimHyper& h = *reinterpret_cast<OptimHyper*>(storage);
  if (threadIdx.x == 0) {
    h = a.hyper;
    read_device_values(h, a.values);
  }
  __syncthreads();
  return h;
}

// The precision of the update: double for float64 params, else float.
template <typename P>
using Compute = std::conditional_t<std::is_same_v<P, double>, double, float>;

// x as a T; a bfloat16 rounded stochastically with the bits of element i of
// the stream `key`, shifted right by `shift`, when `stochastic` (NOTE [lean
// state], NOTE [paired draws]).
template <typename T, typename C>
__device__ __forceinline__ T store_value(C x, bool stochastic, uint32_t key, int64_t i, int shift = 0) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (stochastic) {
      return T(stochastic_bf16_bits(static_cast<float>(x), rounding_bits(key, i) >> shift), T::from_bits());
    }
  }
  return static_cast<T>(x);
}

// NOTE [stalled updates]: whether a 16-bit param's stored value `stored`
// kept the bits of `before` although the update computed `after`.
template <typename P, typename C>
__device__ __forceinline__ int stalled_update(P stored, C before, C after) {
  if constexpr (std::is_same_v<P, at::BFloat16> || std::is_same_v<P, at::Half>) {
    return stored.x == static_cast<P>(before).x && after != before;
  }
  return 0;
}

// Adds each thread's count to the counter, one atomic per warp; every thread
// of the block calls it (the counter is the same for the whole block).
__device__ __forceinline__ void add_stalled(unsigned long long* counter, int n) {
  for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xFFFFFFFFu, n, o);
  if (threadIdx.x % 32 == 0 && n != 0) atomicAdd(counter, static_cast<unsigned long long>(n));
}

// kILP values of the remainder form (NOTE [lean state]) from element i of a
// bfloat16 tensor and its int16 remainders, with vector loads and stores
// (i aligned as cuda::is_aligned says).
template <typename C>
__device__ __forceinline__ void load_joined(C* out, const at::BFloat16* hi, const int16_t* rem, int64_t i) {
  const auto pv = *reinterpret_cast<const cuda::AlignedVec<at::BFloat16>*>(hi + i);
  const auto rv = *reinterpret_cast<const cuda::AlignedVec<int16_t>*>(rem + i);
#pragma unroll
  for (int k = 0; k < kILP; ++k) out[k] = static_cast<C>(join_remainder(pv.v[k].x, rv.v[k]));
}
template <typename C>
__device__ __forceinline__ void store_split(at::BFloat16* hi, int16_t* rem, int64_t i, const C* in) {
  cuda::AlignedVec<at::BFloat16> pv;
  cuda::AlignedVec<int16_t> rv;
#pragma unroll
  for (int k = 0; k < kILP; ++k) {
    uint16_t bits;
    split_remainder(static_cast<float>(in[k]), bits, rv.v[k]);
    pv.v[k] = at::BFloat16(bits, at::BFloat16::from_bits());
  }
  *reinterpret_cast<cuda::AlignedVec<at::BFloat16>*>(hi + i) = pv;
  *reinterpret_cast<cuda::AlignedVec<int16_t>*>(rem + i) = rv;
}

// A chunk's EMA tensor (NOTE [ema source]), in the param's dtype or, for a
// bfloat16 EMA with an int16 remainder, the exact float32 EMA (NOTE [ema
// remainder] in csrc/common/lean_state.h).
template <typename P, typename C>
struct EmaIO {
  static constexpr bool kBf16 = std::is_same_v<P, at::BFloat16>;
  P* ema;
  int16_t* rem;
  __device__ EmaIO(void* e, void* r, int64_t first)
      : ema(e ? static_cast<P*>(e) + first : nullptr), rem(kBf16 && e && r ? static_cast<int16_t*>(r) + first : nullptr) {}
  __device__ C load(int64_t i) const {
    if constexpr (kBf16) {
      if (rem) return static_cast<C>(join_remainder(ema[i].x, rem[i]));
    }
    return static_cast<C>(ema[i]);
  }
  __device__ void store(int64_t i, C e) const {
    if constexpr (kBf16) {
      if (rem) {
        uint16_t bits;
        split_remainder(static_cast<float>(e), bits, rem[i]);
        ema[i] = P(bits, P::from_bits());
        return;
      }
    }
    ema[i] = static_cast<P>(e);
  }
  __device__ void load_vec(C* e, int64_t i) const {
    if constexpr (kBf16) {
      if (rem) return load_joined(e, ema, rem, i);
    }
    cuda::load_vec(e, ema + i);
  }
  __device__ void store_vec(int64_t i, const C* e) const {
    if constexpr (kBf16) {
      if (rem) return store_split(ema, rem, i, e);
    }
    cuda::store_vec(ema + i, e);
  }
  __device__ bool aligned() const { return !ema || (cuda::is_aligned(ema) && (!rem || cuda::is_aligned(rem))); }
};

// A chunk's params as the update reads and writes them (NOTE [lean state]):
// through the fp32 master, the bfloat16 param joined with its int16
// remainder, or the param itself (rounded stochastically when `stochastic`).
template <typename P, typename C>
struct ParamIO {
  static constexpr bool kBf16 = std::is_same_v<P, at::BFloat16>;
  P* param;
  float* master;
  int16_t* rem;
  bool stochastic;
  uint32_t key;   // the param's rounding stream
  int64_t start;  // the chunk's first element in the tensor

  // addrs: the param's and master's addresses in a multi-tensor launch.
  __device__ ParamIO(void* p, void* m, bool remainder, const OptimHyper& h, float step, int64_t tensor, int64_t first)
      : param(static_cast<P*>(p) + first),
        master(m && !remainder ? static_cast<float*>(m) + first : nullptr),
        rem(kBf16 && m && remainder ? static_cast<int16_t*>(m) + first : nullptr),
        stochastic(kBf16 && h.stochastic_params && !m),
        key(rounding_key(step, tensor, 0)),
        start(first) {}
  // Whether the update's value is kept beyond the stored param.
  __device__ bool full() const { return master != nullptr || rem != nullptr; }
  __device__ C load(int64_t i) const {
    if (master) return static_cast<C>(master[i]);
    if constexpr (kBf16) {
      if (rem) return static_cast<C>(join_remainder(param[i].x, rem[i]));
    }
    return static_cast<C>(param[i]);
  }
  // Stores p; returns the param's stored value.
  __device__ P store(int64_t i, C p) const {
    if (master) master[i] = static_cast<float>(p);
    if constexpr (kBf16) {
      if (rem) {
        uint16_t bits;
        split_remainder(static_cast<float>(p), bits, rem[i]);
        param[i] = P(bits, P::from_bits());
        return param[i];
      }
    }
    const P v = store_value<P>(p, stochastic, key, start + i);
    param[i] = v;
    return v;
  }
  // kILP values of the remainder form from element i (load_joined, store_split).
  __device__ void load_joined(C* p, int64_t i) const {
    if constexpr (kBf16) fusetrain::detail::load_joined(p, param, rem, i);
  }
  __device__ void store_split(int64_t i, const C* p) const {
    if constexpr (kBf16) fusetrain::detail::store_split(param, rem, i, p);
  }
  // The value the EMA follows (NOTE [ema source] in csrc/cpu/fused_update_kernel.cpp).
  __device__ C ema_source(int64_t i, C p) const { return full() ? p : static_cast<C>(param[i]); }
};

// Launches the 8-bit update (fused_update_q8_kernel.cu) of a bucket whose
// states are int8 codes with block scales; `ema_rem` is the EMA remainders'
// list or an empty one.
void launch_q8_update(const UpdateLists& l, const OptimHyper& h, const KernelArgs& a,
                      const std::vector<at::Tensor>& ema_rem, cudaStream_t stream);

}  // namespace detail
}  // namespace fusetrain
