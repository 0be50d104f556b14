// CUDA kernels for the fused optimizer update (every kind of optim_kinds.h).
//
// One pass: each element of param, grad and state is read once and written
// once; the unscale/clip multiplier, the non-finite skip, master weights and
// the EMA are applied in registers. Every changing scalar (lr, step, inverse
// scale, found_inf, grad norm, EMA decay) is read from device memory, so the
// launch sequence is the same every step and can be captured in a CUDA graph.
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <type_traits>

#include "../common/lean_state.h"
#include "../common/optim_kinds.h"
#include "multi_tensor_apply.cuh"

namespace fusetrain {
namespace detail {
namespace {

using cuda::kBlockThreads;
using cuda::kChunkSize;
using cuda::kILP;

// Depth 8: param, grad, state1, state2, state3, master, ema, ema remainder.
using UpdateMeta = cuda::TensorListMeta<8, 96, 1280>;
constexpr int kMaxStepPtrs = 1024;

struct StepPtrs {
  float* p[kMaxStepPtrs];
  float* aux[kMaxStepPtrs];  // NOTE [tensor scalars]; null entries when absent
};

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

static_assert(cuda::fits_kernel_params<UpdateMeta, KernelArgs>(), "fused_update_kernel arguments too large");
static_assert(cuda::fits_kernel_params<StepPtrs, int, const float*, OptimHyper, const double*>(),
              "advance_steps_kernel arguments too large");

// Steps, then the tensor scalars that advance with them.
template <OptimKind K>
__global__ void advance_steps_kernel(StepPtrs steps, int n, const float* found_inf, OptimHyper hyper,
                                     const double* values) {
  if (found_inf != nullptr && *found_inf != 0.f) return;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float step = *steps.p[i] + 1.f;
  *steps.p[i] = step;
  if constexpr (advances_tensor_scalar<K>()) {
    if (steps.aux[i] != nullptr) {
      read_device_values(hyper, values);
      *steps.aux[i] = next_tensor_scalar<K>(hyper, step, *steps.aux[i]);
    }
  }
}

// NOTE [block hyper]: the step's settings with the device values written over
// them (read_device_values), made once per CUDA block in shared memory. The
// values land at byte offsets known only at run time, so a copy in each
// thread's registers cannot be: it is a stack frame of the struct's size
// (about 440 bytes) in local memory, written by every thread of every block
// (the update pass then reaches 81% of the copy bandwidth on an H200, 99%
// with the block's copy). Both update kernels read the block's copy.
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

// f(std::true_type) when state slot Slot is present, f(std::false_type) when
// absent; only the slots that may be absent branch (NOTE [optional states]),
// and a slot the kind never reads is absent.
template <OptimKind K, int Slot, class F>
__device__ __forceinline__ void with_state(bool present, F&& f) {
  if constexpr (!slot_used<K>(Slot)) {
    f(std::false_type{});
  } else if constexpr (state_may_be_absent<K>(Slot)) {
    if (present) {
      f(std::true_type{});
    } else {
      f(std::false_type{});
    }
  } else {
    f(std::true_type{});
  }
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

// kILP values stored as bfloat16, rounded with the given draws shifted right
// by `shift` (NOTE [paired draws]).
template <typename C>
__device__ __forceinline__ void store_rounded(at::BFloat16* dst, const C* src, const uint32_t* draws, int shift) {
  cuda::AlignedVec<at::BFloat16> v;
#pragma unroll
  for (int k = 0; k < kILP; ++k) {
    v.v[k] = at::BFloat16(stochastic_bf16_bits(static_cast<float>(src[k]), draws[k] >> shift),
                          at::BFloat16::from_bits());
  }
  *reinterpret_cast<cuda::AlignedVec<at::BFloat16>*>(dst) = v;
}

// kILP values stored as T (store_value), element `first` onwards; returns them.
template <typename T, typename C>
__device__ __forceinline__ cuda::AlignedVec<T> store_values(T* dst, const C* src, bool stochastic, uint32_t key,
                                                            int64_t first) {
  cuda::AlignedVec<T> v;
#pragma unroll
  for (int k = 0; k < kILP; ++k) v.v[k] = store_value<T>(src[k], stochastic, key, first + k);
  *reinterpret_cast<cuda::AlignedVec<T>*>(dst) = v;
  return v;
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

// NOTE [lean occupancy]: with bfloat16 state the update's registers (the
// rounding draws beside the values) exceed 64 a thread, which leaves one block
// of kBlockThreads per SM, too few loads in flight for a pass that moves 18
// bytes an element; capped at 64 (two blocks per SM, no spills on sm_90).
template <typename S>
constexpr int kMinBlocks = std::is_same_v<S, at::BFloat16> ? 2 : 1;

// S: the state's storage type (the update's precision C, or bfloat16).
template <OptimKind K, typename P, typename G, typename S>
__global__ void __launch_bounds__(kBlockThreads, kMinBlocks<S>) fused_update_kernel(UpdateMeta meta, KernelArgs a) {
  using C = Compute<P>;
  constexpr bool kLeanState = !std::is_same_v<S, C>;
  // NOTE [skip]: a step with non-finite gradients changes nothing.
  if (a.found_inf != nullptr && *a.found_inf != 0.f) return;
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t rem_len = meta.numel[t] - start;
  const int64_t len = rem_len < kChunkSize ? rem_len : kChunkSize;
  const float lr = *a.lr;
  const float step = *meta.step[t];
  const float aux = meta.aux[t] != nullptr ? *meta.aux[t] : 1.f;
  const auto co = make_coeffs<K, C>(block_hyper(a), lr, step, aux);
  const C gmul =
      static_cast<C>(grad_multiplier(a.inv_scale, a.grad_norm, static_cast<float>(a.hyper.max_grad_norm)));
  const C ema_w = a.ema_decay != nullptr ? static_cast<C>(1.f - *a.ema_decay) : C(0);

  const int64_t tensor = meta.index[t];
  // Masters exist for float16/bfloat16 params only (the op layer checks): an
  // fp32 copy, or an int16 remainder of a bfloat16 param.
  const ParamIO<P, C> io(meta.addrs[0][t], meta.addrs[5][t], a.remainder, a.hyper, step, tensor, start);
  P* param = io.param;
  float* master = io.master;
  int16_t* rem = io.rem;
  const bool stochastic = io.stochastic;
  const uint32_t key_p = io.key;
  const G* grad = static_cast<const G*>(meta.addrs[1][t]) + start;
  S* s1 = meta.addrs[2][t] ? static_cast<S*>(meta.addrs[2][t]) + start : nullptr;
  S* s2 = meta.addrs[3][t] ? static_cast<S*>(meta.addrs[3][t]) + start : nullptr;
  S* s3 = meta.addrs[4][t] ? static_cast<S*>(meta.addrs[4][t]) + start : nullptr;
  const EmaIO<P, C> eio(meta.addrs[6][t], meta.addrs[7][t], start);
  P* ema = eio.ema;
  // NOTE [paired draws]: state slots 1 and 2 round with stream 1's draws, slot 3 with stream 3's.
  const uint32_t key_pair = rounding_key(step, tensor, 1), key_third = rounding_key(step, tensor, 3);

  auto finish = [&](C g) {
    g *= gmul;
    if (a.hyper.maximize) g = -g;
    return g;
  };
  auto load_param = [&](int64_t i) -> C { return io.load(i); };
  // NOTE [stalled updates]: counted for 16-bit params without a master.
  const bool count = a.stalled != nullptr && !io.full();
  int n_stalled = 0;

  // NOTE [optional states] (optim_kinds.h): H1..H3 say at compile time whether a state is present.
  auto update_vectors = [&](int64_t vec_end, auto has1, auto has2, auto has3) {
    constexpr bool H1 = decltype(has1)::value, H2 = decltype(has2)::value, H3 = decltype(has3)::value;
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * kILP; i < vec_end; i += kBlockThreads * kILP) {
      C p[kILP], g[kILP], r1[kILP], r2[kILP], r3[kILP], e[kILP], before[kILP];
      if (master) {
        cuda::load_vec(p, master + i);
      } else if (rem) {
        io.load_joined(p, i);
      } else {
        cuda::load_vec(p, param + i);
      }
#pragma unroll
      for (int k = 0; k < kILP; ++k) before[k] = p[k];
      cuda::load_vec(g, grad + i);
      if (H1 && s1) cuda::load_vec(r1, s1 + i);
      if (H2 && s2) cuda::load_vec(r2, s2 + i);
      if (H3 && s3) cuda::load_vec(r3, s3 + i);
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
        const C gk = finish(g[k]);
        apply_update<K>(p[k], gk, H1 ? &r1[k] : nullptr, H2 ? &r2[k] : nullptr, H3 ? &r3[k] : nullptr, co);
      }
      if constexpr (kLeanState) {
        uint32_t draws[kILP];  // one per element for slots 1 and 2 (NOTE [paired draws])
        if ((H1 && s1) || (H2 && s2)) {
#pragma unroll
          for (int k = 0; k < kILP; ++k) draws[k] = rounding_bits(key_pair, start + i + k);
        }
        if (H1 && s1) store_rounded(s1 + i, r1, draws, 0);
        if (H2 && s2) store_rounded(s2 + i, r2, draws, 16);
        if (H3 && s3) store_values(s3 + i, r3, true, key_third, start + i);
      } else {
        if (H1 && s1) cuda::store_vec(s1 + i, r1);
        if (H2 && s2) cuda::store_vec(s2 + i, r2);
        if (H3 && s3) cuda::store_vec(s3 + i, r3);
      }
      if (rem) {
        io.store_split(i, p);
      } else {
        if (master) cuda::store_vec(master + i, p);
        const auto stored = store_values(param + i, p, stochastic, key_p, start + i);
        if (count) {
#pragma unroll
          for (int k = 0; k < kILP; ++k) n_stalled += stalled_update(stored.v[k], before[k], p[k]);
        }
      }
      if (ema) {
        eio.load_vec(e, i);
#pragma unroll
        for (int k = 0; k < kILP; ++k) {
          e[k] = lerp_small_weight(e[k], io.ema_source(i + k, p[k]), ema_w);
        }
        eio.store_vec(i, e);
      }
    }
  };

  const bool aligned = cuda::is_aligned(param) && cuda::is_aligned(grad) && (!s1 || cuda::is_aligned(s1)) &&
                       (!s2 || cuda::is_aligned(s2)) && (!s3 || cuda::is_aligned(s3)) &&
                       (!master || cuda::is_aligned(master)) && (!rem || cuda::is_aligned(rem)) &&
                       eio.aligned();
  int64_t vec_end = 0;
  if (aligned) {
    vec_end = len - len % kILP;
    with_state<K, 1>(s1 != nullptr, [&](auto h1) {
      with_state<K, 2>(s2 != nullptr, [&](auto h2) {
        with_state<K, 3>(s3 != nullptr, [&](auto h3) { update_vectors(vec_end, h1, h2, h3); });
      });
    });
  }
  for (int64_t i = vec_end + threadIdx.x; i < len; i += kBlockThreads) {
    C p = load_param(i);
    const C before = p;
    const C g = finish(static_cast<C>(grad[i]));
    C r[3];
    if (s1) r[0] = static_cast<C>(s1[i]);
    if (s2) r[1] = static_cast<C>(s2[i]);
    if (s3) r[2] = static_cast<C>(s3[i]);
    apply_update<K>(p, g, s1 ? &r[0] : nullptr, s2 ? &r[1] : nullptr, s3 ? &r[2] : nullptr, co);
    if (s1) s1[i] = store_value<S>(r[0], kLeanState, key_pair, start + i);
    if (s2) s2[i] = store_value<S>(r[1], kLeanState, key_pair, start + i, 16);
    if (s3) s3[i] = store_value<S>(r[2], kLeanState, key_third, start + i);
    const P stored = io.store(i, p);
    if (count) n_stalled += stalled_update(stored, before, p);
    if (ema) eio.store(i, lerp_small_weight(eio.load(i), io.ema_source(i, p), ema_w));
  }
  if (count) add_stalled(a.stalled, n_stalled);
}

// Depth 11: UpdateMeta's lists, then the block scales of state1..3.
using Q8Meta = cuda::TensorListMeta<11, 96, 1280>;
static_assert(cuda::fits_kernel_params<Q8Meta, KernelArgs, int>(), "fused_update_q8_kernel arguments too large");
constexpr int kWarps = kBlockThreads / 32;

// NOTE [q8 lanes on CUDA]: the 8-bit update gives each lane 8 neighbouring
// elements, so a warp covers 256 and a block of B elements (NOTE [8-bit
// state]) is B / 8 neighbouring lanes. A lane's values come and go in
// 16-byte accesses (8 bytes of codes) and its codes' draws are its own; the
// block's largest magnitude is a shuffle reduction over its lanes, the only
// step whose width depends on B. Each block's reciprocal is computed once
// and every value multiplied by it, so the loop holds no division besides
// the kind's own. Indices within a chunk are 32-bit; the draws take the
// element's index in the tensor.
constexpr int kLaneElems = 8;
constexpr int kWarpElems = 32 * kLaneElems;

// Eight neighbouring elements of T as one value (aligned for one access of
// up to 16 bytes).
template <typename T>
struct alignas(sizeof(T) * kLaneElems < 16 ? sizeof(T) * kLaneElems : 16) Eight {
  T v[kLaneElems];
};

// Whether p (null: absent) is aligned for Eight<T> accesses.
template <typename T>
__device__ __forceinline__ bool eight_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % alignof(Eight<T>) == 0;
}

// The eight elements at src: whole accesses where `whole`, else the first
// `n` one by one (the others are left undefined).
template <typename T>
__device__ __forceinline__ Eight<T> load8(const T* src, int n, bool whole) {
  if (whole) return *reinterpret_cast<const Eight<T>*>(src);
  Eight<T> e;
#pragma unroll
  for (int k = 0; k < kLaneElems; ++k) {
    if (k < n) e.v[k] = src[k];
  }
  return e;
}

template <typename T>
__device__ __forceinline__ void store8(T* dst, const Eight<T>& e, int n, bool whole) {
  if (whole) {
    *reinterpret_cast<Eight<T>*>(dst) = e;
    return;
  }
#pragma unroll
  for (int k = 0; k < kLaneElems; ++k) {
    if (k < n) dst[k] = e.v[k];
  }
}

// NOTE [8-bit state] (csrc/common/lean_state.h): int8 states with block
// scales, laid out over the lanes as NOTE [q8 lanes on CUDA] says. `block`
// is 64, 128 or 256 and divides kChunkSize.
template <OptimKind K, typename P, typename G>
__global__ void __launch_bounds__(kBlockThreads) fused_update_q8_kernel(Q8Meta meta, KernelArgs a, int block) {
  using C = float;
  constexpr bool kBf16 = std::is_same_v<P, at::BFloat16>;
  if (a.found_inf != nullptr && *a.found_inf != 0.f) return;
  // The normalised value of every code of both maps (q8_decode), so that a
  // decode is a lookup and a multiply (block_hyper below syncs the block).
  __shared__ float decoded[512];
  for (int c = threadIdx.x; c < 512; c += kBlockThreads) decoded[c] = q8_decode(static_cast<uint8_t>(c), c >= 256);
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t start = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t rem_len = meta.numel[t] - start;
  const int len = static_cast<int>(rem_len < kChunkSize ? rem_len : kChunkSize);
  const float step = *meta.step[t];
  const float aux = meta.aux[t] != nullptr ? *meta.aux[t] : 1.f;
  const auto co = make_coeffs<K, C>(block_hyper(a), *a.lr, step, aux);
  const C gmul = grad_multiplier(a.inv_scale, a.grad_norm, static_cast<float>(a.hyper.max_grad_norm));
  const C ema_w = a.ema_decay != nullptr ? 1.f - *a.ema_decay : 0.f;
  const bool maximize = a.hyper.maximize;
  const int64_t tensor = meta.index[t];
  const ParamIO<P, C> io(meta.addrs[0][t], meta.addrs[5][t], a.remainder, a.hyper, step, tensor, start);
  const G* grad = static_cast<const G*>(meta.addrs[1][t]) + start;
  const EmaIO<P, C> eio(meta.addrs[6][t], meta.addrs[7][t], start);
  const bool count = a.stalled != nullptr && !io.full();  // NOTE [stalled updates]
  int n_stalled = 0;
  int8_t* codes[3];
  float* scales[3];
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    codes[k] = meta.addrs[2 + k][t] ? static_cast<int8_t*>(meta.addrs[2 + k][t]) + start : nullptr;
    scales[k] = meta.addrs[8 + k][t] ? static_cast<float*>(meta.addrs[8 + k][t]) + start / block : nullptr;
  }
  // NOTE [paired draws]: slots 1 and 2 round with stream 1's draws, slot 3 with stream 3's.
  const uint32_t key_pair = rounding_key(step, tensor, 1), key_third = rounding_key(step, tensor, 3);
  const bool aligned = eight_aligned(io.param) && eight_aligned(io.master) && eight_aligned(io.rem) &&
                       eight_aligned(grad) && eight_aligned(eio.ema) && eight_aligned(eio.rem) &&
                       eight_aligned(codes[0]) && eight_aligned(codes[1]) && eight_aligned(codes[2]);
  const int lane = threadIdx.x % 32;
  const int group = block / kLaneElems;  // the lanes of one block: 8, 16 or 32
  const int block_shift = __ffs(block) - 1;
  const unsigned group_mask = group == 32 ? 0xFFFFFFFFu : ((1u << group) - 1u) << (lane & ~(group - 1));

  // NOTE [optional states]: H1..H3 say at compile time which states are
  // present (with_state), so r stays in registers and no check is per element.
  auto update_lanes = [&](auto has1, auto has2, auto has3) {
    constexpr bool H1 = decltype(has1)::value, H2 = decltype(has2)::value, H3 = decltype(has3)::value;
    constexpr bool present[3] = {H1, H2, H3};
#pragma unroll 1
    for (int base = (threadIdx.x / 32) * kWarpElems; base < len; base += kWarps * kWarpElems) {
      const int i = base + lane * kLaneElems;
      const int n = len - i < 0 ? 0 : (len - i < kLaneElems ? len - i : kLaneElems);
      const bool whole = aligned && n == kLaneElems;
      // Every load first: they are in flight together.
      Eight<int8_t> cv[3];
      float scale[3];
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        if (!present[k]) continue;
        cv[k] = load8(codes[k] + i, n, whole);
        scale[k] = n > 0 ? scales[k][i >> block_shift] : 0.f;
      }
      const Eight<G> gv = load8(grad + i, n, whole);
      Eight<float> mv;
      Eight<P> pv;
      Eight<int16_t> rv;
      if (io.master) {
        mv = load8(io.master + i, n, whole);
      } else {
        pv = load8(io.param + i, n, whole);
        if (io.rem) rv = load8(io.rem + i, n, whole);
      }
      Eight<P> ev;
      Eight<int16_t> erv;
      if (eio.ema) {
        ev = load8(eio.ema + i, n, whole);
        if (eio.rem) erv = load8(eio.rem + i, n, whole);
      }

      // Element by element: the update, then the param's forms and the EMA
      // written over the loaded values (NOTE [lean state]).
      C r[3][kLaneElems];
#pragma unroll
      for (int j = 0; j < kLaneElems; ++j) {
        C p;
        if (io.master) {
          p = mv.v[j];
        } else if (kBf16 && io.rem) {
          if constexpr (kBf16) p = join_remainder(pv.v[j].x, rv.v[j]);
        } else {
          p = static_cast<C>(pv.v[j]);
        }
        C gj = static_cast<C>(gv.v[j]) * gmul;
        if (maximize) gj = -gj;
#pragma unroll
        for (int k = 0; k < 3; ++k) {
          // q8_load: the map named by the scale's sign, times its magnitude.
          const uint32_t sb = float_bits(scale[k]);
          const int c = static_cast<uint8_t>(cv[k].v[j]) + static_cast<int>(sb >> 31) * 256;
          r[k][j] = present[k] ? decoded[c] * bits_float(sb & 0x7FFFFFFFu) : 0.f;
        }
        apply_update<K>(p, gj, H1 ? &r[0][j] : nullptr, H2 ? &r[1][j] : nullptr, H3 ? &r[2][j] : nullptr, co);
        if (kBf16 && io.rem) {
          if constexpr (kBf16) {
            uint16_t bits;
            split_remainder(p, bits, rv.v[j]);
            pv.v[j] = P(bits, P::from_bits());
          }
        } else {
          if (io.master) mv.v[j] = p;
          const P stored = store_value<P>(p, io.stochastic, io.key, start + i + j);
          if (count && j < n) n_stalled += stalled_update(stored, static_cast<C>(pv.v[j]), p);
          pv.v[j] = stored;
        }
        if (eio.ema) {
          C e = static_cast<C>(ev.v[j]);
          if constexpr (kBf16) {
            if (eio.rem) e = join_remainder(ev.v[j].x, erv.v[j]);
          }
          e = lerp_small_weight(e, io.full() ? p : static_cast<C>(pv.v[j]), ema_w);
          ev.v[j] = static_cast<P>(e);
          if constexpr (kBf16) {
            if (eio.rem) {
              uint16_t bits;
              split_remainder(e, bits, erv.v[j]);
              ev.v[j] = P(bits, P::from_bits());
            }
          }
        }
      }
      store8(io.param + i, pv, n, whole);
      if (io.master) store8(io.master + i, mv, n, whole);
      if (io.rem) store8(io.rem + i, rv, n, whole);
      if (eio.ema) {
        store8(eio.ema + i, ev, n, whole);
        if (eio.rem) store8(eio.rem + i, erv, n, whole);
      }

      // The states' blocks: the largest magnitude over the block's lanes, the
      // scale from its first lane, then the codes (slots 1 and 2 from one draw).
      Q8Block qb[3];
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        if (!present[k]) continue;
        // The largest magnitude as the largest magnitude's bits (integer
        // order is float order for them, and a NaN or an infinity is above
        // every finite value), the least value for the sign.
        uint32_t top_bits = 0;
        float least = 0.f;
#pragma unroll
        for (int j = 0; j < kLaneElems; ++j) {
          const float x = j < n ? r[k][j] : 0.f;
          top_bits = max(top_bits, float_bits(x) & 0x7FFFFFFFu);
          least = fminf(least, x);
        }
        for (int o = group / 2; o > 0; o >>= 1) top_bits = max(top_bits, __shfl_xor_sync(0xFFFFFFFFu, top_bits, o));
        const bool negative = (__ballot_sync(0xFFFFFFFFu, least < 0.f) & group_mask) != 0;
        qb[k] = q8_block(bits_float(top_bits), negative, top_bits < 0x7F800000u);
        if (n > 0 && (lane & (group - 1)) == 0) scales[k][i >> block_shift] = qb[k].scale;
      }
      // The lane's indices share their high word (i is a multiple of 8).
      const int64_t first = start + i;
      const uint32_t high = rounding_high_term(first);
      const uint32_t pair_low = key_pair ^ static_cast<uint32_t>(first);
      const uint32_t third_low = key_third ^ static_cast<uint32_t>(first);
      Eight<int8_t> out[3];
#pragma unroll
      for (int j = 0; j < kLaneElems; ++j) {
        if (present[0] || present[1]) {
          const uint32_t d = rounding_bits_of(pair_low ^ j, high);  // rounding_bits(key_pair, first + j)
          if (present[0]) out[0].v[j] = static_cast<int8_t>(q8_store(r[0][j], qb[0], d));
          if (present[1]) out[1].v[j] = static_cast<int8_t>(q8_store(r[1][j], qb[1], d >> 16));
        }
        if (present[2]) out[2].v[j] = static_cast<int8_t>(q8_store(r[2][j], qb[2], rounding_bits_of(third_low ^ j, high)));
      }
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        if (present[k]) store8(codes[k] + i, out[k], n, whole);
      }
    }
  };
  with_state<K, 1>(codes[0] != nullptr, [&](auto h1) {
    with_state<K, 2>(codes[1] != nullptr, [&](auto h2) {
      with_state<K, 3>(codes[2] != nullptr, [&](auto h3) { update_lanes(h1, h2, h3); });
    });
  });
  if (count) add_stalled(a.stalled, n_stalled);
}

const float* scalar_ptr(const at::Tensor& t) { return t.defined() ? t.const_data_ptr<float>() : nullptr; }

}  // namespace

void fused_update_cuda(const UpdateLists& l, const OptimHyper& h, const UpdateScalars& s) {
  if (l.params.empty()) return;
  c10::cuda::CUDAGuard guard(l.params[0].device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  KernelArgs a;
  a.hyper = h;
  a.values = s.values.defined() ? s.values.const_data_ptr<double>() : nullptr;
  a.lr = scalar_ptr(s.lr);
  a.inv_scale = scalar_ptr(s.inv_scale);
  a.found_inf = scalar_ptr(s.found_inf);
  a.grad_norm = scalar_ptr(s.grad_norm);
  a.ema_decay = l.ema.empty() ? nullptr : scalar_ptr(s.ema_decay);
  a.remainder = !l.master.empty() && l.master.front().scalar_type() == at::kShort;
  a.stalled = s.stalled.defined() ? reinterpret_cast<unsigned long long*>(s.stalled.data_ptr<int64_t>()) : nullptr;
  at::ScalarType sd = at::kFloat;
  for (const auto* st : {&l.state1, &l.state2, &l.state3}) sd = st->empty() ? sd : st->front().scalar_type();
  const bool lean = sd == at::kBFloat16;
  const bool q8 = sd == at::kChar;

  // Steps first (the update reads the incremented step, as torch.optim does).
  cuda::check_driver_supports_large_params();
  for (size_t b = 0; h.count_step && b < l.steps.size(); b += kMaxStepPtrs) {
    StepPtrs sp;
    const int n = static_cast<int>(std::min<size_t>(kMaxStepPtrs, l.steps.size() - b));
    for (int i = 0; i < n; ++i) {
      sp.p[i] = l.steps[b + i].data_ptr<float>();
      sp.aux[i] = l.aux.empty() ? nullptr : l.aux[b + i].data_ptr<float>();
    }
    dispatch_kind(h.kind, [&](auto kind) {
      advance_steps_kernel<decltype(kind)::value><<<(n + 255) / 256, 256, 0, stream>>>(sp, n, a.found_inf, h,
                                                                                  a.values);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }

  // A launch's EMA tensors all have remainders or none (the op layer buckets them).
  const std::vector<at::Tensor> no_rem;
  const std::vector<at::Tensor>& ema_rem = !l.ema_rem.empty() && l.ema_rem.front().defined() ? l.ema_rem : no_rem;
  const std::vector<const std::vector<at::Tensor>*> lists = {&l.params, &l.grads,  &l.state1, &l.state2,
                                                             &l.state3, &l.master, &l.ema,    &ema_rem};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, l.params[0].scalar_type(), "fused_update_cuda", [&] {
    using P = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, l.grads[0].scalar_type(), "fused_update_cuda_g", [&] {
      using G = scalar_t;
      if constexpr (std::is_same_v<P, double> != std::is_same_v<G, double>) {
        TORCH_INTERNAL_ASSERT(false, "fused optimizer: float64 params need float64 grads (checked by the op)");
      } else {
        dispatch_kind(h.kind, [&](auto kind) {
          constexpr OptimKind K = decltype(kind)::value;
          auto launch_with = [&](auto state) {
            using S = decltype(state);
            cuda::multi_tensor_apply<UpdateMeta>(lists, l.steps, l.aux, [&](const UpdateMeta& meta, int blocks) {
              fused_update_kernel<K, P, G, S><<<blocks, kBlockThreads, 0, stream>>>(meta, a);
              C10_CUDA_KERNEL_LAUNCH_CHECK();
            });
          };
          // NOTE [lean kernels]: bfloat16 and int8 state are compiled for
          // the element-wise kinds with grads of the param's dtype or float32
          // (the op layer converts other grads of a lean group).
          constexpr bool kLeanKind = K != OptimKind::Direction && K != OptimKind::Apply;
          constexpr bool kLeanGrad = std::is_same_v<G, P> || std::is_same_v<G, float>;
          if constexpr (std::is_same_v<P, double>) {
            launch_with(double{});
          } else if constexpr (kLeanKind && kLeanGrad) {
            if (q8) {
              const std::vector<const std::vector<at::Tensor>*> q8_lists = {
                  &l.params, &l.grads, &l.state1, &l.state2, &l.state3, &l.master, &l.ema, &ema_rem,
                  &l.scales[0], &l.scales[1], &l.scales[2]};
              const int block = static_cast<int>(l.state_block);
              TORCH_INTERNAL_ASSERT(block == 64 || block == 128 || block == 256, "int8 state block ", block);
              cuda::multi_tensor_apply<Q8Meta>(q8_lists, l.steps, l.aux, [&](const Q8Meta& meta, int blocks) {
                fused_update_q8_kernel<K, P, G><<<blocks, kBlockThreads, 0, stream>>>(meta, a, block);
                C10_CUDA_KERNEL_LAUNCH_CHECK();
              });
            } else if (lean) {
              launch_with(at::BFloat16{});
            } else {
              launch_with(float{});
            }
          } else {
            TORCH_INTERNAL_ASSERT(!lean && !q8, "fused optimizer: lean state for this kind or grad dtype (the op checks)");
            launch_with(float{});
          }
        });
      }
    });
  });
}

}  // namespace detail
}  // namespace fusetrain

// The device's update kernel for fusetrain::fused_step_ (register_update_kernel
// in csrc/common/update_args.h).
namespace {
const bool registered =
    (fusetrain::detail::register_update_kernel(c10::DeviceType::CUDA, &fusetrain::detail::fused_update_cuda), true);
}  // namespace
