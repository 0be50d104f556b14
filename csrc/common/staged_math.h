// Element math of the two fused passes around an ATen stage (NOTE [apply
// pass] in csrc/ops/aten_stage.h), shared by the CPU and CUDA kernels as
// optim_math.h (which includes this file and says what a <Kind>Math holds):
//   Direction: Adam's moments and the Adam direction of Lamb and AdamP, written
//     into a scratch tensor (the pass's "param"), the real weights read from s3
//     when the direction needs them (Lamb's L2 decay);
//   Apply: decay and step with a direction computed before (Muon's
//     orthogonalised momentum, Lamb's direction times its trust ratio, AdamP's
//     projected direction).
#pragma once

#include "device_math.h"
#include "kind_table.h"

namespace fusetrain {
namespace detail {

// u = (m or Nesterov's beta1*m + (1-beta1)*g) / bc1 / (sqrt(v) / sqrt(bc2) + eps) + l2 * w,
// the moments in timm's order (m = beta1*m + beta3*g, v = beta2*v + (1-beta2)*g*g).
// State: s1 exp_avg, s2 exp_avg_sq, s3 the weights (when l2_decay != 0).
struct DirectionMath {
  template <typename T>
  struct Coeffs {
    T beta1, one_minus_beta1, beta3, beta2, one_minus_beta2, eps, l2_decay;
    T bc1, sqrt_bc2;  // 1 - beta1^t and sqrt(1 - beta2^t), or 1 without bias correction
    bool nesterov;
  };

  template <typename T>
  static FT_HD Coeffs<T> coeffs(const DirectionFields& h, float /*lr*/, float step, float /*aux*/) {
    Coeffs<T> c;
    c.beta1 = static_cast<T>(h.beta1);
    c.one_minus_beta1 = static_cast<T>(1.0 - h.beta1);
    c.beta3 = static_cast<T>(h.beta3);
    c.beta2 = static_cast<T>(h.beta2);
    c.one_minus_beta2 = static_cast<T>(1.0 - h.beta2);
    c.eps = static_cast<T>(h.eps);
    c.l2_decay = static_cast<T>(h.l2_decay);
    const double t = static_cast<double>(step);
    const bool bias_correction = h.bias_correction != 0.0;
    c.bc1 = static_cast<T>(bias_correction ? 1.0 - ::pow(h.beta1, t) : 1.0);
    c.sqrt_bc2 = static_cast<T>(bias_correction ? ::sqrt(1.0 - ::pow(h.beta2, t)) : 1.0);
    c.nesterov = h.nesterov != 0.0;
    return c;
  }

  template <typename V, typename T>
  static FT_HD void update(V& u, V g, V* s1, V* s2, V* w, const Coeffs<T>& c) {
    V& m = *s1;
    V& v = *s2;
    m = m * V(c.beta1) + V(c.beta3) * g;
    v = v * V(c.beta2) + V(c.one_minus_beta2) * g * g;
    const V denom = vsqrt(v) / V(c.sqrt_bc2) + V(c.eps);
    const V num = c.nesterov ? V(c.beta1) * m + V(c.one_minus_beta1) * g : m;
    u = (num / V(c.bc1)) / denom;
    if (w != nullptr) u = u + V(c.l2_decay) * *w;
  }
};

// p = p * (1 - lr * decay) - lr * lr_ratio * direction. The per-tensor input
// `aux` (float32, 1 when absent) either scales the step (aux_scales_step:
// Lamb's trust ratio) or enters the decay as weight_decay * (aux_base +
// aux_mul * aux), in double (AdamP: an exact 0/1 selector with aux_base 1,
// aux_mul wd_ratio - 1); decay_max_lr > 0 scales the decay by lr /
// decay_max_lr (timm's corrected weight decay). No state.
struct ApplyMath {
  template <typename T>
  struct Coeffs {
    T decay_mul;  // 1 - lr * (the tensor's decay)
    T neg_lr;     // -lr * lr_ratio (times aux when it scales the step)
    bool has_decay;
  };

  template <typename T>
  static FT_HD Coeffs<T> coeffs(const ApplyFields& h, float lr, float /*step*/, float aux) {
    Coeffs<T> c;
    const double lr_d = static_cast<double>(lr), a = static_cast<double>(aux);
    const bool scales_step = h.aux_scales_step != 0.0;
    double decay = h.weight_decay;
    if (!scales_step) decay *= h.aux_base + h.aux_mul * a;
    if (h.decay_max_lr > 0.0) decay *= lr_d / h.decay_max_lr;
    c.decay_mul = static_cast<T>(1.0 - lr_d * decay);
    c.neg_lr = static_cast<T>(-(lr_d * h.lr_ratio * (scales_step ? a : 1.0)));
    c.has_decay = h.weight_decay != 0.0;
    return c;
  }

  template <typename V, typename T>
  static FT_HD void update(V& p, V g, V* /*s1*/, V* /*s2*/, V* /*s3*/, const Coeffs<T>& c) {
    if (c.has_decay) p = mul_rn(p, V(c.decay_mul));
    p = fmadd(V(c.neg_lr), g, p);  // torch's param.add_(update, alpha=-lr)
  }
};

}  // namespace detail
}  // namespace fusetrain
