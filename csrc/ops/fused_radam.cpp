// The "radam" kind (rectified Adam; L2 or decoupled weight decay): its table
// entry and update, with unscale, clip, non-finite skip and EMA folded in.
#include "optim_kind.h"

namespace fusetrain {
namespace detail {
namespace {

void check(const std::string& op, const KindRecord& r) {
  check_in(op, r, "beta1", 0.0, 1.0);
  check_in(op, r, "beta2", 0.0, 1.0);
  check_in(op, r, "eps", 0.0);
  check_in(op, r, "weight_decay", 0.0);
}

void run(const KindCall& c) {
  OptimHyper h;
  h.kind = OptimKind::RAdam;
  RAdamHyper& r = h.radam;
  r.decoupled = c.flag("decoupled_weight_decay");
  bind_values(c, h, {{"beta1", r.beta1}, {"beta2", r.beta2}, {"eps", r.eps}, {"weight_decay", r.weight_decay}});
  run_kind_update(c, h, c.state[0], c.state[1], {});
}

const KindSpec& kind = register_kind({
    "radam",
    "RAdam (torch.optim.RAdam)",
    {{"beta1", "real", "first-moment decay"},
     {"beta2", "real", "second-moment decay"},
     {"eps", "real", "added to the denominator"},
     {"weight_decay", "real", "L2 (or decoupled) weight decay"},
     {"decoupled_weight_decay", "flag", "p *= 1 - lr * weight_decay"}},
    {{0, "exp_avg"}, {1, "exp_avg_sq"}},
    &check,
    &run,
    /*schedulable=*/true,
    /*lean=*/true,
});

}  // namespace
}  // namespace detail
}  // namespace fusetrain
