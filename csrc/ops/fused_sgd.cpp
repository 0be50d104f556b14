// The "sgd" kind (torch.optim.SGD: momentum, dampening, nesterov, weight
// decay): its table entry and update, with unscale, clip, non-finite skip and
// EMA folded in.
#include "optim_kind.h"

namespace fusetrain {
namespace detail {
namespace {

void check(const std::string& op, const KindRecord& r) {
  check_in(op, r, "momentum", 0.0);
  check_in(op, r, "weight_decay", 0.0);
  TORCH_CHECK_VALUE(!r.flag("nesterov") || (r["momentum"] > 0.0 && r["dampening"] == 0.0), op,
                    ": nesterov=True needs momentum > 0 and dampening == 0, got momentum=", r["momentum"],
                    ", dampening=", r["dampening"]);
}

void run(const KindCall& c) {
  OptimHyper h;
  h.kind = OptimKind::SGD;
  SGDHyper& s = h.sgd;
  s.nesterov = c.flag("nesterov");
  bind_values(c, h, {{"momentum", s.momentum}, {"dampening", s.dampening}, {"weight_decay", s.weight_decay}});
  run_kind_update(c, h, c.state[0], {}, {});
}

const KindSpec& kind = register_kind({
    "sgd",
    "SGD (torch.optim.SGD)",
    {{"momentum", "real", "momentum factor (0: no momentum buffer)"},
     {"dampening", "real", "dampening of the momentum"},
     {"weight_decay", "real", "L2 weight decay"},
     {"nesterov", "flag", "Nesterov momentum"}},
    {{0, "momentum_buffer", "momentum"}},
    &check,
    &run,
    /*schedulable=*/true,
    /*lean=*/true,
});

}  // namespace
}  // namespace detail
}  // namespace fusetrain
