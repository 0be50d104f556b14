// The "nadam" kind (Adam with Nesterov momentum and the momentum-decay
// schedule; L2 or decoupled weight decay): its table entry and update, with
// unscale, clip, non-finite skip and EMA folded in. Each param keeps its
// running product of momentum coefficients, mu_product, as a 0-d float32
// tensor beside its step (NOTE [tensor scalars] in update_args.h).
#include "optim_kind.h"

namespace fusetrain {
namespace detail {
namespace {

void check(const std::string& op, const KindRecord& r) {
  check_in(op, r, "beta1", 0.0, 1.0);
  check_in(op, r, "beta2", 0.0, 1.0);
  check_in(op, r, "eps", 0.0);
  check_in(op, r, "weight_decay", 0.0);
  check_in(op, r, "momentum_decay", 0.0);
}

void run(const KindCall& c) {
  OptimHyper h;
  h.kind = OptimKind::NAdam;
  NAdamHyper& n = h.nadam;
  n.decoupled = c.flag("decoupled_weight_decay");
  bind_values(c, h, {{"beta1", n.beta1}, {"beta2", n.beta2}, {"eps", n.eps}, {"weight_decay", n.weight_decay},
                     {"momentum_decay", n.momentum_decay}});
  run_kind_update(c, h, c.state[0], c.state[1], {}, /*aux=*/c.state[2]);
}

const KindSpec& kind = register_kind({
    "nadam",
    "NAdam (torch.optim.NAdam)",
    {{"beta1", "real", "first-moment decay"},
     {"beta2", "real", "second-moment decay"},
     {"eps", "real", "added to the denominator"},
     {"weight_decay", "real", "L2 (or decoupled) weight decay"},
     {"momentum_decay", "real", "the momentum schedule's decay"},
     {"decoupled_weight_decay", "flag", "p *= 1 - lr * weight_decay"}},
    {{0, "exp_avg"}, {1, "exp_avg_sq"}, {2, "mu_product", nullptr, true, /*scalar=*/true, /*initial=*/1.0}},
    &check,
    &run,
    /*schedulable=*/true,
    /*lean=*/true,
});

}  // namespace
}  // namespace detail
}  // namespace fusetrain
