// The "adadelta" kind (torch.optim.Adadelta): its table entry and update,
// with unscale, clip, non-finite skip and EMA folded in.
#include "optim_kind.h"

namespace fusetrain {
namespace detail {
namespace {

void check(const std::string& op, const KindRecord& r) {
  check_in(op, r, "rho", 0.0, 1.0, /*high_closed=*/true);
  check_in(op, r, "eps", 0.0);
  check_in(op, r, "weight_decay", 0.0);
}

void run(const KindCall& c) {
  OptimHyper h;
  h.kind = OptimKind::Adadelta;
  AdadeltaHyper& a = h.adadelta;
  bind_values(c, h, {{"rho", a.rho}, {"eps", a.eps}, {"weight_decay", a.weight_decay}});
  run_kind_update(c, h, c.state[0], c.state[1], {});
}

const KindSpec& kind = register_kind({
    "adadelta",
    "Adadelta (torch.optim.Adadelta)",
    {{"rho", "real", "decay of square_avg and acc_delta"},
     {"eps", "real", "added inside the square roots"},
     {"weight_decay", "real", "L2 weight decay"}},
    {{0, "square_avg"}, {1, "acc_delta"}},
    &check,
    &run,
    /*schedulable=*/true,
    /*lean=*/true,
});

}  // namespace
}  // namespace detail
}  // namespace fusetrain
