// The optimizer kinds of the fused update, for the CPU and CUDA kernels: the
// per-tensor coefficients of each kind and its element update on the state
// registers r1..r3 (state1..3 of UpdateLists; null when a group does not use
// that list). Adding an optimizer: its math (optim_math.h or rms_math.h), a
// line in each of make_coeffs, apply_update and dispatch_kind, its op file in
// csrc/ops and its front-end classes (docs/design.md, "Adding an optimizer").
#pragma once

#include <type_traits>

#include "update_args.h"

namespace fusetrain {
namespace detail {

// `aux`: the tensor's scalar of NOTE [tensor scalars] (update_args.h), 1 when
// the launch has none.
template <OptimKind K, typename T>
FT_HD auto make_coeffs(const OptimHyper& h, float lr, float step, float aux) {
  if constexpr (K == OptimKind::Adam) return make_adam_coeffs<T>(h.adam, lr, step);
  if constexpr (K == OptimKind::SGD) return make_sgd_coeffs<T>(h.sgd, lr, step);
  if constexpr (K == OptimKind::Lion) return make_lion_coeffs<T>(h.lion, lr, step);
  if constexpr (K == OptimKind::RMSprop) return make_rmsprop_coeffs<T>(h.rmsprop, lr, step);
  if constexpr (K == OptimKind::Adadelta) return make_adadelta_coeffs<T>(h.adadelta, lr, step);
  if constexpr (K == OptimKind::RAdam) return make_radam_coeffs<T>(h.radam, lr, step);
  if constexpr (K == OptimKind::NAdam) return make_nadam_coeffs<T>(h.nadam, lr, step, aux);
  if constexpr (K == OptimKind::Direction) return make_direction_coeffs<T>(h.direction, lr, step, aux);
  if constexpr (K == OptimKind::Apply) return make_apply_coeffs<T>(h.apply, lr, step, aux);
}

template <OptimKind K, typename V, typename Co>
FT_HD void apply_update(V& p, V g, V* r1, V* r2, V* r3, const Co& c) {
  if constexpr (K == OptimKind::Adam) adam_update(p, g, *r1, *r2, r3, c);
  if constexpr (K == OptimKind::SGD) sgd_update(p, g, r1, c);
  if constexpr (K == OptimKind::Lion) lion_update(p, g, *r1, c);
  if constexpr (K == OptimKind::RMSprop) rmsprop_update(p, g, *r1, r2, r3, c);
  if constexpr (K == OptimKind::Adadelta) adadelta_update(p, g, *r1, *r2, c);
  if constexpr (K == OptimKind::RAdam) radam_update(p, g, *r1, *r2, c);
  if constexpr (K == OptimKind::NAdam) nadam_update(p, g, *r1, *r2, c);
  if constexpr (K == OptimKind::Direction) direction_update(p, g, *r1, *r2, r3, c);
  if constexpr (K == OptimKind::Apply) apply_pass_update(p, g, c);
}

// NOTE [optional states]: the state slots (1..3) that apply_update<K> takes as
// a pointer that may be null (a group without that state: Adam's
// max_exp_avg_sq, SGD's momentum buffer, RMSprop's momentum buffer and
// grad_avg, the direction's weights); every other slot it uses is always
// present. The kernels instantiate their vector loops for each combination
// of the optional slots only (with_states): no per-element branch on a slot,
// no register array reached through a pointer chosen at run time (which CUDA
// would put in local memory), and no loop compiled for a combination that
// cannot occur.
template <OptimKind K>
constexpr bool state_may_be_absent(int slot) {
  return (K == OptimKind::Adam && slot == 3) || (K == OptimKind::SGD && slot == 1) ||
         (K == OptimKind::RMSprop && slot >= 2) || (K == OptimKind::Direction && slot == 3);
}

// Whether apply_update<K> reads state slot `slot` (1..3) at all.
template <OptimKind K>
constexpr bool slot_used(int slot) {
  if constexpr (K == OptimKind::SGD || K == OptimKind::Lion) return slot == 1;
  if constexpr (K == OptimKind::Adadelta || K == OptimKind::RAdam || K == OptimKind::NAdam) return slot <= 2;
  if constexpr (K == OptimKind::Apply) return false;
  return true;
}

// Whether the kernels take kind K with bfloat16 or int8 state (NOTE [lean
// state]): the element-wise kinds.
template <OptimKind K>
constexpr bool lean_state_kind() {
  return K != OptimKind::Direction && K != OptimKind::Apply;
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

// The tensor scalar after a step's increment of `step` (NOTE [tensor scalars]):
// NAdam's mu_product advances; for the other kinds it is read-only.
template <OptimKind K>
FT_HD float next_tensor_scalar(const OptimHyper& h, float step, float aux) {
  if constexpr (K == OptimKind::NAdam) return nadam_next_mu_product(h.nadam, step, aux);
  return aux;
}
template <OptimKind K>
constexpr bool advances_tensor_scalar() { return K == OptimKind::NAdam; }

// Calls f(std::integral_constant<OptimKind, k>{}) for the run-time kind k.
template <class F>
void dispatch_kind(OptimKind kind, F&& f) {
  using K = OptimKind;
  switch (kind) {
    case K::Adam: return f(std::integral_constant<K, K::Adam>{});
    case K::SGD: return f(std::integral_constant<K, K::SGD>{});
    case K::Lion: return f(std::integral_constant<K, K::Lion>{});
    case K::RMSprop: return f(std::integral_constant<K, K::RMSprop>{});
    case K::Adadelta: return f(std::integral_constant<K, K::Adadelta>{});
    case K::RAdam: return f(std::integral_constant<K, K::RAdam>{});
    case K::NAdam: return f(std::integral_constant<K, K::NAdam>{});
    case K::Direction: return f(std::integral_constant<K, K::Direction>{});
    case K::Apply: return f(std::integral_constant<K, K::Apply>{});
  }
  TORCH_INTERNAL_ASSERT(false, "unknown optimizer kind ", static_cast<int>(kind));
}

}  // namespace detail
}  // namespace fusetrain
