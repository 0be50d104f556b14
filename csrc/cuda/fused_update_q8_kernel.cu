// The CUDA kernel of the fused optimizer update for int8 states with block
// scales (NOTE [8-bit state] in csrc/common/lean_state.h): the same pass as
// fused_update_kernel.cu's, with each block's largest magnitude reduced on
// the way and its codes written after it.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "update_io.cuh"

namespace fusetrain {
namespace detail {
namespace {

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
// element's index in the tensor. On sm_90 the kernel takes 128 registers a
// thread (one block of 512 per SM; each lane's 8 independent elements keep
// its loads in flight), with a few spills in the instances that handle an
// EMA, masters and unaligned tails together.
constexpr int kLaneElems = 8;
constexpr int kWarpElems = 32 * kLaneElems;

// NOTE [q8 forms]: the general instance decides per chunk whether a param has
// an fp32 master, a remainder or neither, whether an EMA (with its remainder)
// follows it and whether each lane's eight elements are whole and aligned, and
// holds the registers of every case: 128 a thread on sm_90, with spills. The
// fixed forms decide all of that at compile time for the lean layouts of
// bfloat16 params with bfloat16 grads and no fp32 master (`remainder` without
// an EMA or with one kept with remainders, and a param alone, rounded
// stochastically or to nearest), over tensors whose every lane is whole: a
// length that is a multiple of 8 and addresses aligned for the eight-element
// accesses (a launch splits its tensors into those and the rest, which the
// general instance takes). An empty lane past a chunk's end reads the chunk's
// first eight elements (a chunk's length is then a multiple of 8) and stores
// nothing. A fixed form fits 64 registers (sm_90a, ptxas -v: AdamW's remainder
// form without spills, with an EMA 16 bytes of spills, a param alone 8), so
// two blocks of 512 share an SM; RMSprop's keep 128 (its three states spill
// 126 bytes at 64). FUSETRAIN_Q8_FORMS=1 turns the fixed forms on (read at
// each launch); they are off by default until a GPU run has checked and timed
// them against the general instance (benchmarks/optim_memory.py's _forms
// rows).
enum class Q8Form { General, Remainder, RemainderEma, Plain };

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
// Blocks of kBlockThreads an SM must hold (NOTE [q8 forms]).
template <OptimKind K, Q8Form F>
constexpr int q8_min_blocks() {
  return F != Q8Form::General && K != OptimKind::RMSprop ? 2 : 1;
}

template <OptimKind K, typename P, typename G, Q8Form F>
__global__ void __launch_bounds__(kBlockThreads, q8_min_blocks<K, F>())
    fused_update_q8_kernel(Q8Meta meta, KernelArgs a, int block) {
  using C = float;
  constexpr bool kBf16 = std::is_same_v<P, at::BFloat16>;
  // NOTE [q8 forms]: what a fixed form knows at compile time.
  constexpr bool kFixed = F != Q8Form::General;
  constexpr bool kFixedRem = F == Q8Form::Remainder || F == Q8Form::RemainderEma;
  static_assert(!kFixed || (kBf16 && std::is_same_v<G, P>), "the fixed q8 forms take bfloat16 params and grads");
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
  const bool has_master = !kFixed && io.master != nullptr;
  const bool has_rem = kFixed ? kFixedRem : io.rem != nullptr;
  const bool has_ema = kFixed ? F == Q8Form::RemainderEma : eio.ema != nullptr;
  const bool has_ema_rem = kFixed ? F == Q8Form::RemainderEma : eio.rem != nullptr;
  const bool full = has_master || has_rem;
  const bool count = a.stalled != nullptr && !full;  // NOTE [stalled updates]
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
  const bool aligned = kFixed || (eight_aligned(io.param) && eight_aligned(io.master) && eight_aligned(io.rem) &&
                                  eight_aligned(grad) && eight_aligned(eio.ema) && eight_aligned(eio.rem) &&
                                  eight_aligned(codes[0]) && eight_aligned(codes[1]) && eight_aligned(codes[2]));
  const int lane = threadIdx.x % 32;
  const int group = block / kLaneElems;  // the lanes of one block: 8, 16 or 32
  const int block_shift = __ffs(block) - 1;
  const unsigned group_mask = group == 32 ? 0xFFFFFFFFu : ((1u << group) - 1u) << (lane & ~(group - 1));

  // NOTE [optional states]: H1..H3 say at compile time which states are
  // present (with_states), so r stays in registers and no check is per element.
  auto update_lanes = [&](auto has1, auto has2, auto has3) {
    constexpr bool H1 = decltype(has1)::value, H2 = decltype(has2)::value, H3 = decltype(has3)::value;
    constexpr bool present[3] = {H1, H2, H3};
#pragma unroll 1
    for (int base = (threadIdx.x / 32) * kWarpElems; base < len; base += kWarps * kWarpElems) {
      const int i = base + lane * kLaneElems;
      const int n = len - i < 0 ? 0 : (len - i < kLaneElems ? len - i : kLaneElems);
      const bool whole = kFixed || (aligned && n == kLaneElems);
      // Where the lane reads: an empty lane of a fixed form at the chunk's start (NOTE [q8 forms]).
      const int at = kFixed && n == 0 ? 0 : i;
      const bool put = !kFixed || n > 0;  // whether the lane stores
      // Every load first: they are in flight together.
      Eight<int8_t> cv[3];
      float scale[3];
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        if (!present[k]) continue;
        cv[k] = load8(codes[k] + at, n, whole);
        scale[k] = n > 0 ? scales[k][i >> block_shift] : 0.f;
      }
      const Eight<G> gv = load8(grad + at, n, whole);
      Eight<float> mv;
      Eight<P> pv;
      Eight<int16_t> rv;
      if (has_master) {
        mv = load8(io.master + at, n, whole);
      } else {
        pv = load8(io.param + at, n, whole);
        if (has_rem) rv = load8(io.rem + at, n, whole);
      }
      Eight<P> ev;
      Eight<int16_t> erv;
      if (has_ema) {
        ev = load8(eio.ema + at, n, whole);
        if (has_ema_rem) erv = load8(eio.rem + at, n, whole);
      }

      // Element by element: the update, then the param's forms and the EMA
      // written over the loaded values (NOTE [lean state]).
      C r[3][kLaneElems];
#pragma unroll
      for (int j = 0; j < kLaneElems; ++j) {
        C p;
        if (has_master) {
          p = mv.v[j];
        } else if (kBf16 && has_rem) {
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
        if (kBf16 && has_rem) {
          if constexpr (kBf16) {
            uint16_t bits;
            split_remainder(p, bits, rv.v[j]);
            pv.v[j] = P(bits, P::from_bits());
          }
        } else {
          if (has_master) mv.v[j] = p;
          const P stored = store_value<P>(p, io.stochastic, io.key, start + i + j);
          if (count && j < n) n_stalled += stalled_update(stored, static_cast<C>(pv.v[j]), p);
          pv.v[j] = stored;
        }
        if (has_ema) {
          C e = static_cast<C>(ev.v[j]);
          if constexpr (kBf16) {
            if (has_ema_rem) e = join_remainder(ev.v[j].x, erv.v[j]);
          }
          e = lerp_small_weight(e, full ? p : static_cast<C>(pv.v[j]), ema_w);
          ev.v[j] = static_cast<P>(e);
          if constexpr (kBf16) {
            if (has_ema_rem) {
              uint16_t bits;
              split_remainder(e, bits, erv.v[j]);
              ev.v[j] = P(bits, P::from_bits());
            }
          }
        }
      }
      if (put) {
        store8(io.param + i, pv, n, whole);
        if (has_master) store8(io.master + i, mv, n, whole);
        if (has_rem) store8(io.rem + i, rv, n, whole);
        if (has_ema) {
          store8(eio.ema + i, ev, n, whole);
          if (has_ema_rem) store8(eio.rem + i, erv, n, whole);
        }
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
        if (present[k] && put) store8(codes[k] + i, out[k], n, whole);
      }
    }
  };
  with_states<K>(codes[0] != nullptr, codes[1] != nullptr, codes[2] != nullptr,
                [&](auto h1, auto h2, auto h3) { update_lanes(h1, h2, h3); });
  if (count) add_stalled(a.stalled, n_stalled);
}

// The fixed form (NOTE [q8 forms]) for a bucket's layout, or General.
Q8Form q8_form(const UpdateLists& l, const KernelArgs& a, const std::vector<at::Tensor>& ema_rem) {
  const char* env = std::getenv("FUSETRAIN_Q8_FORMS");
  const std::string_view on = env == nullptr ? "" : env;
  if (on != "1") {
    // A warning, not an error: the step's counters have advanced by now.
    if (!on.empty() && on != "0") {
      TORCH_WARN_ONCE("FUSETRAIN_Q8_FORMS='", on, "' is neither 0 nor 1: the 8-bit kernel's fixed forms stay off");
    }
    return Q8Form::General;
  }
  if (l.params[0].scalar_type() != at::kBFloat16 || l.grads[0].scalar_type() != at::kBFloat16) return Q8Form::General;
  const bool ema = !l.ema.empty();
  if (!l.master.empty()) {
    if (!a.remainder) return Q8Form::General;
    if (!ema) return Q8Form::Remainder;
    return ema_rem.empty() ? Q8Form::General : Q8Form::RemainderEma;
  }
  return ema ? Q8Form::General : Q8Form::Plain;
}

// Whether every lane of tensor i is whole in all of `lists` (NOTE [q8
// forms]): its length a multiple of 8 and each address aligned for eight
// elements (16 bytes at most); the scales (lists 8..10) are read one by one.
bool whole_lanes(const std::vector<const std::vector<at::Tensor>*>& lists, size_t i) {
  if ((*lists[0])[i].numel() % kLaneElems != 0) return false;
  for (size_t d = 0; d < 8; ++d) {
    if (lists[d]->empty()) continue;
    const at::Tensor& x = (*lists[d])[i];
    const auto alignment = static_cast<uintptr_t>(std::min<int64_t>(16, x.element_size() * kLaneElems));
    if (reinterpret_cast<uintptr_t>(x.const_data_ptr()) % alignment != 0) return false;
  }
  return true;
}

}  // namespace

void launch_q8_update(const UpdateLists& l, const OptimHyper& h, const KernelArgs& a,
                      const std::vector<at::Tensor>& ema_rem, cudaStream_t stream) {
  const std::vector<const std::vector<at::Tensor>*> lists = {
      &l.params, &l.grads, &l.state1, &l.state2, &l.state3, &l.master, &l.ema, &ema_rem,
      &l.scales[0], &l.scales[1], &l.scales[2]};
  const int block = static_cast<int>(l.state_block);
  TORCH_INTERNAL_ASSERT(block == 64 || block == 128 || block == 256, "int8 state block ", block);
  const Q8Form form = q8_form(l, a, ema_rem);
  // The tensors of the fixed form and the rest (NOTE [q8 forms]).
  std::vector<bool> fixed, rest;
  if (form != Q8Form::General) {
    for (size_t i = 0; i < l.params.size(); ++i) fixed.push_back(whole_lanes(lists, i));
    rest = fixed;
    rest.flip();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, l.params[0].scalar_type(), "launch_q8_update", [&] {
    using P = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, l.grads[0].scalar_type(), "launch_q8_update_g", [&] {
      using G = scalar_t;
      dispatch_kind(h.kind, [&](auto kind) {
        constexpr OptimKind K = decltype(kind)::value;
        constexpr bool kLean = lean_state_kind<K>() && !std::is_same_v<P, double> && kernel_grad<P, G>();
        if constexpr (kLean) {
          const auto launch = [&](auto f, const std::vector<bool>& include) {
            constexpr Q8Form F = decltype(f)::value;
            cuda::multi_tensor_apply<Q8Meta>(
                lists, l.steps, l.aux,
                [&](const Q8Meta& meta, int blocks) {
                  fused_update_q8_kernel<K, P, G, F><<<blocks, kBlockThreads, 0, stream>>>(meta, a, block);
                  C10_CUDA_KERNEL_LAUNCH_CHECK();
                },
                include);
          };
          using General = std::integral_constant<Q8Form, Q8Form::General>;
          if constexpr (std::is_same_v<P, at::BFloat16> && std::is_same_v<G, P>) {
            if (form == Q8Form::Remainder) {
              launch(std::integral_constant<Q8Form, Q8Form::Remainder>{}, fixed);
            } else if (form == Q8Form::RemainderEma) {
              launch(std::integral_constant<Q8Form, Q8Form::RemainderEma>{}, fixed);
            } else if (form == Q8Form::Plain) {
              launch(std::integral_constant<Q8Form, Q8Form::Plain>{}, fixed);
            }
          }
          launch(General{}, rest);  // every tensor where no fixed form launched
        } else {
          TORCH_INTERNAL_ASSERT(false, "fused optimizer: int8 state for this kind or grad dtype (the op checks)");
        }
      });
    });
  });
}

}  // namespace detail
}  // namespace fusetrain
