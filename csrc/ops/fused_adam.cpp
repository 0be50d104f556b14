// The "adam" kind (Adam and AdamW): its table entry and update, with the
// gradient unscale, clip, non-finite skip and EMA folded into the same pass.
#include "optim_kind.h"

namespace fusetrain {
namespace detail {
namespace {

void check(const std::string& op, const KindRecord& r) {
  check_in(op, r, "beta1", 0.0, 1.0);
  check_in(op, r, "beta2", 0.0, 1.0);
  check_in(op, r, "weight_decay", 0.0);
  check_in(op, r, "eps", 0.0);
}

void run(const KindCall& c) {
  OptimHyper h;
  h.kind = OptimKind::Adam;
  AdamHyper& a = h.adam;
  a.decoupled = c.flag("decoupled_weight_decay");
  a.amsgrad = c.flag("amsgrad");
  a.bias_correction = c.flag("bias_correction");
  bind_values(c, h, {{"beta1", a.beta1}, {"beta2", a.beta2}, {"eps", a.eps}, {"weight_decay", a.weight_decay}});
  run_kind_update(c, h, c.state[0], c.state[1], c.state[2]);
}

const KindSpec& kind = register_kind({
    "adam",
    "Adam and AdamW (torch.optim.Adam, AdamW); the BertAdam form without bias_correction",
    {{"beta1", "real", "first-moment decay"},
     {"beta2", "real", "second-moment decay"},
     {"weight_decay", "real", "L2 (or decoupled) weight decay"},
     {"eps", "real", "added to the denominator"},
     {"amsgrad", "flag", "keep the running maximum of exp_avg_sq"},
     {"decoupled_weight_decay", "flag", "AdamW's decay: p *= 1 - lr * weight_decay"},
     {"bias_correction", "flag", "divide the moments by 1 - beta^t"}},
    {{0, "exp_avg"}, {1, "exp_avg_sq"}, {2, "max_exp_avg_sq", "amsgrad"}},
    &check,
    &run,
    /*schedulable=*/true,
    /*lean=*/true,
});

}  // namespace
}  // namespace detail
}  // namespace fusetrain
