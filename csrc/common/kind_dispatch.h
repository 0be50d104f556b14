// The kinds of the fused update at compile time, for the CPU and CUDA
// kernels: a kind's math (<Kind>Math of optim_math.h) found by its name in
// the optimizer table's list (kind_table.h, generated), the coefficients and
// element update of kind K, which state slots it reads, its tensor scalar,
// and the switch from a run-time kind to a compile-time one. Nothing here
// names a kind: the table's list expands into it.
#pragma once

#include <type_traits>

#include "kind_table.h"
#include "optim_math.h"
#include "update_launch.h"

namespace fusetrain {
namespace detail {

// The math of kind K: <Kind>Math (optim_math.h, rms_math.h, staged_math.h).
template <OptimKind K>
struct KindMath;
#define FUSETRAIN_KIND_MATH(Name) \
  template <>                     \
  struct KindMath<OptimKind::Name> : Name##Math {};
FUSETRAIN_KERNEL_KINDS(FUSETRAIN_KIND_MATH)
#undef FUSETRAIN_KIND_MATH

// `aux`: the tensor's scalar of NOTE [tensor scalars] (update_launch.h), 1
// when the launch has none.
template <OptimKind K, typename T>
FT_HD auto make_coeffs(const OptimHyper& h, float lr, float step, float aux) {
  return KindMath<K>::template coeffs<T>(KindTraits<K>::Fields::from(h.fields), lr, step, aux);
}

template <OptimKind K, typename V, typename Co>
FT_HD void apply_update(V& p, V g, V* r1, V* r2, V* r3, const Co& c) {
  KindMath<K>::update(p, g, r1, r2, r3, c);
}

// NOTE [optional states]: the state slots (1..3) that apply_update<K> takes as
// a pointer that may be null (a group without that state: Adam's
// max_exp_avg_sq, SGD's momentum buffer, RMSprop's momentum buffer and
// grad_avg, the direction's weights: the table's states with a condition);
// every other slot it uses is always present. The kernels instantiate their
// vector loops for each combination of the optional slots only (with_states):
// no per-element branch on a slot, no register array reached through a
// pointer chosen at run time (which CUDA would put in local memory), and no
// loop compiled for a combination that cannot occur.
template <OptimKind K>
constexpr bool state_may_be_absent(int slot) {
  return KindTraits<K>::kSlotOptional[slot - 1];
}

// Whether apply_update<K> reads state slot `slot` (1..3) at all.
template <OptimKind K>
constexpr bool slot_used(int slot) {
  return KindTraits<K>::kSlotUsed[slot - 1];
}

// Whether the kernels take kind K with bfloat16 or int8 state (NOTE [lean
// state]): the element-wise kinds.
template <OptimKind K>
constexpr bool lean_state_kind() {
  return KindTraits<K>::kLean;
}

// NOTE [kernel grads]: the update kernels are compiled for grads of the
// param's dtype, or float32 for float16/bfloat16 params; the op converts any
// other grads of a launch to float32 first (a copy, with the values the
// kernel would have widened them to). Mixed grads are rare, and every grad
// dtype compiled for every param dtype would multiply the kernels' build time.
template <typename P, typename G>
constexpr bool kernel_grad() {
  return std::is_same_v<G, P> || (std::is_same_v<G, float> && !std::is_same_v<P, double>);
}

// f(std::true_type) when state slot Slot is present, f(std::false_type) when
// absent; only the slots that may be absent branch (NOTE [optional states]),
// and a slot the kind never reads is absent.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <OptimKind K, int Slot, class F>
FT_HD void with_state(bool present, F&& f) {
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

// f(has1, has2, has3): with_state for the three slots at once.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <OptimKind K, class F>
FT_HD void with_states(bool present1, bool present2, bool present3, F&& f) {
  with_state<K, 1>(present1, [&](auto h1) {
    with_state<K, 2>(present2, [&](auto h2) { with_state<K, 3>(present3, [&](auto h3) { f(h1, h2, h3); }); });
  });
}

// Whether kind K's tensor scalar (NOTE [tensor scalars]) advances with the
// step (a scalar state of the table, e.g. NAdam's mu_product); the others'
// is a read-only input, or there is none.
template <OptimKind K>
constexpr bool advances_tensor_scalar() {
  return KindTraits<K>::kScalar == TensorScalar::State;
}

// The tensor scalar after a step's increment of `step`.
template <OptimKind K>
FT_HD float next_tensor_scalar(const OptimHyper& h, float step, float aux) {
  if constexpr (advances_tensor_scalar<K>()) {
    return KindMath<K>::next_aux(KindTraits<K>::Fields::from(h.fields), step, aux);
  } else {
    return aux;
  }
}

// Calls f(std::integral_constant<OptimKind, k>{}) for the run-time kind k.
template <class F>
void dispatch_kind(OptimKind kind, F&& f) {
  switch (kind) {
#define FUSETRAIN_KIND_CASE(Name) \
  case OptimKind::Name:           \
    return f(std::integral_constant<OptimKind, OptimKind::Name>{});
    FUSETRAIN_KERNEL_KINDS(FUSETRAIN_KIND_CASE)
#undef FUSETRAIN_KIND_CASE
  }
  TORCH_INTERNAL_ASSERT(false, "unknown optimizer kind ", static_cast<int>(kind));
}

}  // namespace detail
}  // namespace fusetrain
