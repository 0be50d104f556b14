// CPU kernels for the fused optimizer update (every kind of kind_dispatch.h).
//
// Work is split into (tensor, chunk) items run by at::parallel_for. Inside an
// item, elements are processed in blocks: params/grads are converted to fp32
// block buffers, the shared math of optim_math.h runs on Vectorized<float>
// (Vectorized<double> for float64 params, whose state is float64 too), and the
// results are written back (master weights, rounded params, EMA) while the
// block is still in L1. Each element is read and written once.
#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace fusetrain {
namespace detail {
// Overloads for the templated math; declared before optim_math.h so that the
// templates see them (Vectorized lives in another namespace, so ADL would not).
template <typename C>
inline at::vec::Vectorized<C> vsqrt(at::vec::Vectorized<C> x) { return x.sqrt(); }
template <typename C>
inline at::vec::Vectorized<C> vmax(at::vec::Vectorized<C> a, at::vec::Vectorized<C> b) {
  return at::vec::maximum(a, b);
}
template <typename C>
inline at::vec::Vectorized<C> vsign(at::vec::Vectorized<C> x) {
  using V = at::vec::Vectorized<C>;
  return x.gt(V(C(0))) - x.lt(V(C(0)));
}
}  // namespace detail
}  // namespace fusetrain

#include "../common/kind_dispatch.h"
#include "../common/lean_state.h"
#include "../common/op_kernels.h"
#include "../common/step_math.h"
#include "bf16_lanes.h"
#include "blocks.h"
#include "q8_lanes.h"
#include "parallel.h"
#include "work_items.h"

namespace fusetrain {
namespace detail {
namespace {

constexpr int64_t kChunk = 32768;  // elements per parallel work item
constexpr int64_t kBlock = 512;    // elements per L1-resident block


const float* scalar_ptr(const at::Tensor& t) { return t.defined() ? t.const_data_ptr<float>() : nullptr; }

// The precision of the update: double for float64 params, else float.
template <typename P>
using Compute = std::conditional_t<std::is_same_v<P, double>, double, float>;

// The values of `n` codes from element `first` (a block boundary) of a state
// whose blocks of `block` elements have the scales `scales` (q8_load).
inline void load_q8(const int8_t* src, const float* scales, float* dst, int64_t n, int64_t first, int64_t block) {
  for (int64_t b = 0; b < n; b += block) {
    load_q8_block(src + b, scales[(first + b) / block], dst + b, std::min(block, n - b));
  }
}

// How the blocks of the `m` values at a and at b (where b is set) are
// stored (q8_block). A block's largest magnitude is the largest of its
// values' bits without their sign (as integers they order as the
// magnitudes do, and a NaN's are above an infinity's), and a value below
// zero has bits above -0's as unsigned integers (a negative NaN's too: a
// block holding a NaN or an infinity is not finite, and then neither its
// largest magnitude nor its map matters).
inline void q8_blocks_of(const float* a, const float* b, int64_t m, Q8Block& qa, Q8Block& qb) {
  uint32_t top[2] = {0, 0}, raw[2] = {0, 0};
  const float* src[2] = {a, b};
  const int slots = b != nullptr ? 2 : 1;
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i vtop[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  __m256i vraw[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  const auto gather = [&](auto two) {
    constexpr int kSlots = decltype(two)::value ? 2 : 1;
    for (; i + 8 <= m; i += 8) {
      for (int k = 0; k < kSlots; ++k) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[k] + i));
        vtop[k] = _mm256_max_epi32(vtop[k], _mm256_and_si256(v, magnitude));
        vraw[k] = _mm256_max_epu32(vraw[k], v);
      }
    }
  };
  if (slots == 2) {
    gather(std::true_type{});
  } else {
    gather(std::false_type{});
  }
  for (int k = 0; k < slots; ++k) {
    alignas(32) uint32_t lanes[2][8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[0]), vtop[k]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[1]), vraw[k]);
    for (int l = 0; l < 8; ++l) {
      top[k] = std::max(top[k], lanes[0][l]);
      raw[k] = std::max(raw[k], lanes[1][l]);
    }
  }
#endif
  for (int k = 0; k < slots; ++k) {
    for (int64_t j = i; j < m; ++j) {
      top[k] = std::max(top[k], float_bits(src[k][j]) & 0x7FFFFFFFu);
      raw[k] = std::max(raw[k], float_bits(src[k][j]));
    }
  }
  qa = q8_block(bits_float(top[0]), raw[0] > 0x80000000u, top[0] < 0x7F800000u);
  if (b != nullptr) qb = q8_block(bits_float(top[1]), raw[1] > 0x80000000u, top[1] < 0x7F800000u);
}

// One state slot of store_q8: its values (a block buffer), codes and block scales.
struct Q8Slot {
  const float* src;
  int8_t* codes;
  float* scales;
};

// Stores `n` values of slot `a` (and of slot `b` where b.src is set) from
// element `first` (a block boundary) as codes and block scales, rounded
// with the draws of the stream `key`: `a` with their bits shifted right by
// `shift`, `b` with their high halves (NOTE [paired draws]: one draw for
// both).
inline void store_q8(Q8Slot a, Q8Slot b, int shift, int64_t n, int64_t first, int64_t block, uint32_t key) {
  for (int64_t o = 0; o < n; o += block) {
    const int64_t m = std::min(block, n - o);
    const int64_t k = (first + o) / block;
    Q8Block qa{}, qb{};
    q8_blocks_of(a.src + o, b.src != nullptr ? b.src + o : nullptr, m, qa, qb);
    a.scales[k] = qa.scale;
    if (b.src == nullptr) {
      store_q8_block<false>(a.src + o, qa, a.codes + o, shift, nullptr, qa, nullptr, m, key, first + o);
      continue;
    }
    b.scales[k] = qb.scale;
    store_q8_block<true>(a.src + o, qa, a.codes + o, shift, b.src + o, qb, b.codes + o, m, key, first + o);
  }
}

// NOTE [stalled updates] (csrc/common/lean_state.h): the elements of a
// 16-bit param whose stored bits did not change although the update's value
// differs from the value they held.
template <typename P>
int64_t count_stalled(const P* after, const P* before, const float* value, int64_t n) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += after[i].x == before[i].x && value[i] != static_cast<float>(before[i]);
  return c;
}

// S: the state's storage type (the update's precision C, bfloat16, or int8
// codes with block scales). `stalled`: the counter of NOTE [stalled updates], or null.
template <OptimKind K, typename P, typename G, typename S>
void update_item(const UpdateLists& l, const OptimHyper& h, const WorkItem& it, float lr, float gmul, float ema_w_f,
                 bool has_ema, int64_t* stalled) {
  using C = Compute<P>;
  using Vec = at::vec::Vectorized<C>;
  // Whether the state is stored in bfloat16 (NOTE [lean state]): the vector
  // loop widens its lanes, a pass over the block rounds them back (NOTE [bf16 lanes]).
  constexpr bool kBf16State = std::is_same_v<S, at::BFloat16>;
  constexpr bool kQ8 = std::is_same_v<S, int8_t>;
  const int64_t t = it.tensor;
  P* param = l.params[t].data_ptr<P>() + it.begin;
  const G* grad = l.grads[t].const_data_ptr<G>() + it.begin;
  S* s[3] = {l.state1.empty() ? nullptr : l.state1[t].data_ptr<S>() + it.begin,
             l.state2.empty() ? nullptr : l.state2[t].data_ptr<S>() + it.begin,
             l.state3.empty() ? nullptr : l.state3[t].data_ptr<S>() + it.begin};
  const int64_t qblock = l.state_block;
  float* scales[3] = {nullptr, nullptr, nullptr};
  if constexpr (kQ8) {
    for (int k = 0; k < 3; ++k) {
      if (s[k] != nullptr) scales[k] = l.scales[k][t].data_ptr<float>();
    }
  }
  // Masters exist for float16/bfloat16 params only (the op layer checks):
  // an fp32 copy, or an int16 remainder of a bfloat16 param.
  const bool has_master = !l.master.empty();
  const bool remainder = has_master && l.master[t].scalar_type() == at::kShort;
  float* master = has_master && !remainder ? l.master[t].data_ptr<float>() + it.begin : nullptr;
  int16_t* rem = remainder ? l.master[t].data_ptr<int16_t>() + it.begin : nullptr;
  // Whether the update's value is kept beyond the stored param.
  const bool full = master != nullptr || rem != nullptr;
  constexpr bool kBf16Param = std::is_same_v<P, at::BFloat16>;
  const bool stochastic = kBf16Param && h.stochastic_params && !full;
  constexpr bool kLowParam = kBf16Param || std::is_same_v<P, at::Half>;
  const bool count = kLowParam && stalled != nullptr && !full;
  int64_t n_stalled = 0;
  alignas(64) P before[kLowParam ? kBlock : 1];
  P* ema = has_ema ? l.ema[t].data_ptr<P>() + it.begin : nullptr;
  // NOTE [ema remainder]: a bfloat16 EMA's int16 remainder, or null.
  int16_t* ema_rem =
      has_ema && !l.ema_rem.empty() && l.ema_rem[t].defined() ? l.ema_rem[t].data_ptr<int16_t>() + it.begin : nullptr;
  const float step = *l.steps[t].const_data_ptr<float>();
  const float aux = l.aux.empty() ? 1.f : *l.aux[t].const_data_ptr<float>();

  const auto co = make_coeffs<K, C>(h, lr, step, aux);
  [[maybe_unused]] const uint32_t pair_key = kBf16State || kQ8 ? rounding_key(step, t, 1) : 0u;
  [[maybe_unused]] const uint32_t key3 = kBf16State || kQ8 ? rounding_key(step, t, 3) : 0u;

  alignas(64) float pb[kBlock];
  alignas(64) C gb[kBlock];
  alignas(64) float eb[kBlock];
  alignas(64) C sb[3][kQ8 || kBf16State ? kBlock : 1];
  constexpr int64_t VS = Vec::size();
  // Whether the update runs on the param's own storage.
  constexpr bool kInPlace = std::is_same_v<P, C>;
  // The grad's multiplier, negated for maximize (the same bits as negating the product).
  const Vec vgmul(static_cast<C>(h.maximize ? -gmul : gmul));
  const C ema_w = static_cast<C>(ema_w_f);
  const int64_t len = it.end - it.begin;
  for (int64_t off = 0; off < len; off += kBlock) {
    const int64_t m = std::min(kBlock, len - off);
    // The values the update works on, in place where the storage has the
    // update's precision: the master, an fp32/fp64 param, or a converted copy
    // of a low-precision param (joined with its remainder).
    C* pw = nullptr;
    if constexpr (std::is_same_v<C, float>) {
      if (master != nullptr) pw = master + off;
    }
    if (pw == nullptr) {
      if constexpr (kInPlace) {
        pw = reinterpret_cast<C*>(param) + off;
      } else {
        load_block(param + off, rem != nullptr ? rem + off : nullptr, pb, m);
        pw = pb;
      }
    }
    // bfloat16 grads are widened in the vector loop, others converted here.
    constexpr bool kWidenGrad = std::is_same_v<G, at::BFloat16> && std::is_same_v<C, float>;
    const C* gw = nullptr;
    if constexpr (std::is_same_v<G, C>) {
      gw = reinterpret_cast<const C*>(grad) + off;
    } else if constexpr (!kWidenGrad) {
      convert_block(grad + off, gb, m);
      gw = gb;
    }
    // The state the vector loop reads and writes as C: in place (C state),
    // decoded into a block buffer (8-bit state); bfloat16 state is widened
    // in the loop and written to a block buffer (NOTE [bf16 lanes]).
    C* ms[3] = {nullptr, nullptr, nullptr};
    for (int k = 0; k < 3; ++k) {
      if (s[k] == nullptr) continue;
      if constexpr (kQ8 || kBf16State) {
        if constexpr (kQ8) load_q8(s[k] + off, scales[k], sb[k], m, it.begin + off, qblock);
        ms[k] = sb[k];
      } else {
        ms[k] = s[k] + off;
      }
    }
    // NOTE [optional states]: which state lists a group uses is decided once
    // per block, so that the per-vector loop holds no branch on it.
    with_states<K>(s[0] != nullptr, s[1] != nullptr, s[2] != nullptr, [&](auto has1, auto has2, auto has3) {
      constexpr bool H1 = decltype(has1)::value, H2 = decltype(has2)::value, H3 = decltype(has3)::value;
      const auto load_state = [&](int k, int64_t i, int c) {
        if constexpr (kBf16State) {
          return load_bf16_lanes(s[k] + off + i, c);
        } else {
          return Vec::loadu(ms[k] + i, c);
        }
      };
      // The update of the `c` elements from i; whole vectors take it with
      // a constant count, so that their loads and stores hold no branch.
      const auto update = [&](int64_t i, int c) {
        Vec p = Vec::loadu(pw + i, c);
        Vec g;
        if constexpr (kWidenGrad) {
          g = load_bf16_lanes(grad + off + i, c) * vgmul;
        } else {
          g = Vec::loadu(gw + i, c) * vgmul;
        }
        Vec r1, r2, r3;
        if constexpr (H1) r1 = load_state(0, i, c);
        if constexpr (H2) r2 = load_state(1, i, c);
        if constexpr (H3) r3 = load_state(2, i, c);
        apply_update<K>(p, g, H1 ? &r1 : nullptr, H2 ? &r2 : nullptr, H3 ? &r3 : nullptr, co);
        if constexpr (H1) r1.store(ms[0] + i, c);
        if constexpr (H2) r2.store(ms[1] + i, c);
        if constexpr (H3) r3.store(ms[2] + i, c);
        p.store(pw + i, c);
      };
      int64_t i = 0;
      for (; i + VS <= m; i += VS) update(i, static_cast<int>(VS));
      if (i < m) update(i, static_cast<int>(m - i));
      if constexpr (kBf16State) {
        // NOTE [paired draws]: slots 1 and 2 from stream 1's draws, slot 3 from stream 3's.
        const int64_t at = it.begin + off;
        if constexpr (H1 || H2) {
          store_bf16_pair_block<H1, H2>(sb[0], H1 ? s[0] + off : nullptr, sb[1], H2 ? s[1] + off : nullptr, m,
                                        pair_key, at);
        }
        if constexpr (H3) store_bf16_pair_block<true, false>(sb[2], s[2] + off, nullptr, nullptr, m, key3, at);
      }
    });
    if constexpr (kQ8) {
      // NOTE [paired draws]: slots 1 and 2 from stream 1's draws, slot 3 from stream 3's.
      const auto slot = [&](int k) { return Q8Slot{sb[k], s[k] + off, scales[k]}; };
      const int64_t at = it.begin + off;
      if (s[0] != nullptr) {
        store_q8(slot(0), s[1] != nullptr ? slot(1) : Q8Slot{}, 0, m, at, qblock, pair_key);
      } else if (s[1] != nullptr) {
        store_q8(slot(1), Q8Slot{}, 16, m, at, qblock, pair_key);
      }
      if (s[2] != nullptr) store_q8(slot(2), Q8Slot{}, 0, m, at, qblock, key3);
    }
    // Store the (rounded) param when the update did not run on its storage.
    if constexpr (kLowParam) {
      if (count) std::memcpy(before, param + off, m * sizeof(P));
    }
    if constexpr (kBf16Param) {
      if (stochastic) {
        store_bf16_pair_block<true, false>(pw, param + off, nullptr, nullptr, m, rounding_key(step, t, 0),
                                           it.begin + off);
      } else {
        store_block(pw, param + off, rem != nullptr ? rem + off : nullptr, m);
      }
    } else if (master != nullptr || !kInPlace) {
      convert_block(pw, param + off, m);
    }
    if constexpr (kLowParam) {
      if (count) n_stalled += count_stalled(param + off, before, pw, m);
    }
    if (ema != nullptr) {
      // NOTE [ema source]: the EMA follows the value the optimizer holds at
      // full precision: the fp32 master (or the param joined with its
      // remainder) when there is one, else the stored (rounded) parameter.
      const C* src = pw;
      C* ew;
      if constexpr (kInPlace) {
        ew = reinterpret_cast<C*>(ema) + off;
      } else {
        if (!full) {
          convert_block(param + off, pb, m);
          src = pb;
        }
        load_block(ema + off, ema_rem != nullptr ? ema_rem + off : nullptr, eb, m);
        ew = eb;
      }
      for (int64_t i = 0; i < m; i += VS) {
        const int c = static_cast<int>(std::min<int64_t>(VS, m - i));
        Vec e = lerp_small_weight(Vec::loadu(ew + i, c), Vec::loadu(src + i, c), ema_w);
        e.store(ew + i, c);
      }
      if constexpr (!kInPlace) store_block(eb, ema + off, ema_rem != nullptr ? ema_rem + off : nullptr, m);
    }
  }
  if (n_stalled != 0) __atomic_fetch_add(stalled, n_stalled, __ATOMIC_RELAXED);
}

template <OptimKind K, typename P, typename G, typename S>
void update_bucket(const UpdateLists& l, const OptimHyper& h, float lr, float gmul, float ema_w, bool has_ema,
                   int64_t* stalled) {
  const std::vector<WorkItem> items = make_work_items(l.params, kChunk);
  parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) update_item<K, P, G, S>(l, h, items[i], lr, gmul, ema_w, has_ema, stalled);
  });
}

template <typename P, typename G>
void update_dispatch_kind(const UpdateLists& l, const OptimHyper& h, float lr, float gmul, float ema_w,
                          bool has_ema, int64_t* stalled) {
  const std::vector<at::Tensor>* states[3] = {&l.state1, &l.state2, &l.state3};
  at::ScalarType sd = at::kFloat;
  for (const auto* st : states) sd = st->empty() ? sd : st->front().scalar_type();
  dispatch_kind(h.kind, [&](auto kind) {
    constexpr OptimKind K = decltype(kind)::value;
    if constexpr (std::is_same_v<P, double>) {
      update_bucket<K, P, G, double>(l, h, lr, gmul, ema_w, has_ema, stalled);
    } else if constexpr (lean_state_kind<K>()) {
      if (sd == at::kChar) {
        update_bucket<K, P, G, int8_t>(l, h, lr, gmul, ema_w, has_ema, stalled);
      } else if (sd == at::kBFloat16) {
        update_bucket<K, P, G, at::BFloat16>(l, h, lr, gmul, ema_w, has_ema, stalled);
      } else {
        update_bucket<K, P, G, float>(l, h, lr, gmul, ema_w, has_ema, stalled);
      }
    } else {
      TORCH_INTERNAL_ASSERT(sd == at::kFloat, "fused optimizer: lean state for this kind (the op checks)");
      update_bucket<K, P, G, float>(l, h, lr, gmul, ema_w, has_ema, stalled);
    }
  });
}

// Steps first (the update reads the incremented step, as torch.optim does),
// then the tensor scalars that advance with them (NOTE [tensor scalars]).
void advance_steps(const UpdateLists& l, const OptimHyper& h) {
  if (!h.count_step) return;
  for (const at::Tensor& st : l.steps) *st.data_ptr<float>() += 1.f;
  if (l.aux.empty()) return;
  dispatch_kind(h.kind, [&](auto kind) {
    constexpr OptimKind K = decltype(kind)::value;
    if constexpr (advances_tensor_scalar<K>()) {
      for (size_t i = 0; i < l.aux.size(); ++i) {
        float* a = l.aux[i].data_ptr<float>();
        *a = next_tensor_scalar<K>(h, *l.steps[i].const_data_ptr<float>(), *a);
      }
    }
  });
}

}  // namespace

void fused_update_cpu(const UpdateLists& l, const OptimHyper& launch, const UpdateScalars& s) {
  if (l.params.empty()) return;
  // A step with non-finite gradients leaves everything untouched (NOTE [skip]).
  if (s.found_inf.defined() && *s.found_inf.const_data_ptr<float>() != 0.f) return;
  OptimHyper h = launch;
  read_device_values(h, s.values.defined() ? s.values.const_data_ptr<double>() : nullptr);
  advance_steps(l, h);
  const float lr = *s.lr.const_data_ptr<float>();
  const float gmul = grad_multiplier(scalar_ptr(s.inv_scale), scalar_ptr(s.grad_norm),
                                     static_cast<float>(h.max_grad_norm));
  const bool has_ema = !l.ema.empty();
  const float ema_w = has_ema ? 1.f - *s.ema_decay.const_data_ptr<float>() : 0.f;
  const at::ScalarType pt = l.params[0].scalar_type();
  const at::ScalarType gt = l.grads[0].scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pt, "fused_update_cpu", [&] {
    using P = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gt, "fused_update_cpu_grad", [&] {
      using G = scalar_t;
      if constexpr (!kernel_grad<P, G>()) {
        TORCH_INTERNAL_ASSERT(false, "fused optimizer: grads of another dtype than the param's (the op converts them)");
      } else {
        update_dispatch_kind<P, G>(l, h, lr, gmul, ema_w, has_ema,
                                   s.stalled.defined() ? s.stalled.data_ptr<int64_t>() : nullptr);
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
    (fusetrain::detail::register_update_kernel(c10::DeviceType::CPU, &fusetrain::detail::fused_update_cpu), true);
}  // namespace
