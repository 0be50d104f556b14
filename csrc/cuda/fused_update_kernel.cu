// CUDA kernels for the fused optimizer update (every kind of kind_dispatch.h).
//
// One pass: each element of param, grad and state is read once and written
// once; the unscale/clip multiplier, the non-finite skip, master weights and
// the EMA are applied in registers. Every changing scalar (lr, step, inverse
// scale, found_inf, grad norm, EMA decay) is read from device memory, so the
// launch sequence is the same every step and can be captured in a CUDA graph.
// int8 states take the kernel of fused_update_q8_kernel.cu.
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <type_traits>

#include "update_io.cuh"

namespace fusetrain {
namespace detail {
namespace {

// Depth 8: param, grad, state1, state2, state3, master, ema, ema remainder.
using UpdateMeta = cuda::TensorListMeta<8, 96, 1280>;
constexpr int kMaxStepPtrs = 1024;

struct StepPtrs {
  float* p[kMaxStepPtrs];
  float* aux[kMaxStepPtrs];  // NOTE [tensor scalars]; null entries when absent
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

  // NOTE [optional states] (kind_dispatch.h): H1..H3 say at compile time whether a state is present.
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
    with_states<K>(s1 != nullptr, s2 != nullptr, s3 != nullptr,
                [&](auto h1, auto h2, auto h3) { update_vectors(vec_end, h1, h2, h3); });
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
      if constexpr (!kernel_grad<P, G>()) {
        TORCH_INTERNAL_ASSERT(false, "fused optimizer: grads of another dtype than the param's (the op converts them)");
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
          if constexpr (std::is_same_v<P, double>) {
            launch_with(double{});
          } else if constexpr (lean_state_kind<K>()) {
            if (q8) {
              launch_q8_update(l, h, a, ema_rem, stream);
            } else if (lean) {
              launch_with(at::BFloat16{});
            } else {
              launch_with(float{});
            }
          } else {
            TORCH_INTERNAL_ASSERT(!lean && !q8, "fused optimizer: lean state for this kind (the op checks)");
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
// in csrc/common/update_launch.h).
namespace {
const bool registered =
    (fusetrain::detail::register_update_kernel(c10::DeviceType::CUDA, &fusetrain::detail::fused_update_cuda), true);
}  // namespace
