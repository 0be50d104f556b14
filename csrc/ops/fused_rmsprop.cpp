// The "rmsprop" kind (centered, momentum, weight decay; the TensorFlow form
// of timm's RMSpropTF with tf_style, NOTE [rmsprop tf] in
// csrc/common/rms_math.h): its table entry and update, with unscale, clip,
// non-finite skip and EMA folded in.
#include "optim_kind.h"

namespace fusetrain {
namespace detail {
namespace {

void check(const std::string& op, const KindRecord& r) {
  TORCH_CHECK_VALUE(r.flag("tf_style") || (!r.flag("lr_in_momentum") && !r.flag("decoupled_weight_decay")), op,
                    ": lr_in_momentum and decoupled_weight_decay belong to the TensorFlow form: they need "
                    "tf_style=True");
  check_in(op, r, "alpha", 0.0);
  check_in(op, r, "eps", 0.0);
  check_in(op, r, "weight_decay", 0.0);
  check_in(op, r, "momentum", 0.0);
}

void run(const KindCall& c) {
  OptimHyper h;
  h.kind = OptimKind::RMSprop;
  RMSpropHyper& r = h.rmsprop;
  r.centered = c.flag("centered");
  r.tf_style = c.flag("tf_style");
  r.lr_in_momentum = c.flag("lr_in_momentum");
  r.decoupled = c.flag("decoupled_weight_decay");
  bind_values(c, h, {{"alpha", r.alpha}, {"eps", r.eps}, {"weight_decay", r.weight_decay}, {"momentum", r.momentum}});
  run_kind_update(c, h, c.state[0], c.state[1], c.state[2]);
}

const KindSpec& kind = register_kind({
    "rmsprop",
    "RMSprop (torch.optim.RMSprop) and timm's RMSpropTF (tf_style)",
    {{"alpha", "real", "smoothing constant of square_avg"},
     {"eps", "real", "added to the denominator (inside the square root with tf_style)"},
     {"weight_decay", "real", "L2 (or decoupled) weight decay"},
     {"momentum", "real", "momentum factor (0: no momentum buffer)"},
     {"centered", "flag", "normalise by the centered second moment (keeps grad_avg)"},
     {"tf_style", "flag", "the TensorFlow form; square_avg starts at 1"},
     {"lr_in_momentum", "flag", "the lr multiplies the momentum buffer's input (tf_style)"},
     {"decoupled_weight_decay", "flag", "p *= 1 - lr * weight_decay (tf_style)"}},
    {{0, "square_avg", nullptr, true, false, /*initial=*/1.0, /*initial_when=*/"tf_style"},
     {1, "momentum_buffer", "momentum"},
     {2, "grad_avg", "centered"}},
    &check,
    &run,
    /*schedulable=*/true,
    /*lean=*/true,
});

}  // namespace
}  // namespace detail
}  // namespace fusetrain
