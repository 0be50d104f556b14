// The "lion" kind (sign of an interpolated momentum): its table entry and
// update, with unscale, clip, non-finite skip and EMA folded in.
#include "optim_kind.h"

namespace fusetrain {
namespace detail {
namespace {

void check(const std::string& op, const KindRecord& r) {
  check_in(op, r, "beta1", 0.0, 1.0);
  check_in(op, r, "beta2", 0.0, 1.0);
  check_in(op, r, "weight_decay", 0.0);
}

void run(const KindCall& c) {
  OptimHyper h;
  h.kind = OptimKind::Lion;
  LionHyper& l = h.lion;
  bind_values(c, h, {{"beta1", l.beta1}, {"beta2", l.beta2}, {"weight_decay", l.weight_decay}});
  run_kind_update(c, h, c.state[0], {}, {});
}

const KindSpec& kind = register_kind({
    "lion",
    "Lion",
    {{"beta1", "real", "interpolation of the update's momentum"},
     {"beta2", "real", "decay of exp_avg"},
     {"weight_decay", "real", "decoupled weight decay"}},
    {{0, "exp_avg"}},
    &check,
    &run,
    /*schedulable=*/true,
    /*lean=*/true,
});

}  // namespace
}  // namespace detail
}  // namespace fusetrain
