// The math of the element-wise optimizer kinds, shared by the CPU and CUDA
// kernels: one struct <Kind>Math per kind of the optimizer table (NOTE
// [optimizer table] in python/fusetrain/optim/_table.py), which kind_dispatch.h
// finds by name. Each has
//   Coeffs<T>: the per-tensor coefficients, computed once per tensor (per
//     chunk on CUDA) in the precision T of the update (float, or double for
//     float64 params);
//   coeffs<T>(fields, lr, step, aux): them, from the kind's record fields
//     (<Kind>Fields of kind_table.h, flags 0 or 1), the device scalars lr and
//     step (the already incremented step count of the tensor) and the
//     tensor's scalar `aux` (NOTE [tensor scalars] in update_launch.h; 1 when
//     the launch has none);
//   update(p, g, s1, s2, s3, c): the element update on a value V (`float` or
//     `double` in the CUDA kernels, at::vec::Vectorized<float|double> in the
//     CPU kernels) of the param p, the gradient g and the state registers
//     s1..s3 (state1..3; null for a slot the kind does not read or a group
//     lacks);
//   next_aux(fields, step, aux), for a kind whose scalar state advances with
//     the step (NAdam's mu_product).
// The operation order follows torch.optim's single-tensor implementations so
// that fp32 results agree to rounding; the one exception is Adam's bias
// correction of the second moment, applied as a multiplication by
// 1/sqrt(1 - beta2^t) instead of a division (one division less per element,
// a difference of at most an ulp in the denominator).
#pragma once

#include "device_math.h"
#include "kind_table.h"

namespace fusetrain {
namespace detail {

// NOTE [update order]: the grad arriving here is already unscaled, clipped and
// negated for maximize; weight decay and the moments follow torch's order.
// Adam-style weight decay: decoupled (p *= 1 - lr*wd) or L2 (g += wd*p).
template <typename V, typename Co>
FT_HD void adam_weight_decay(V& p, V& g, const Co& c) {
  if (c.weight_decay == decltype(c.weight_decay)(0)) return;
  if (c.decoupled) {
    p = mul_rn(p, V(c.decay_mul));
  } else {
    g = g + V(c.weight_decay) * p;
  }
}

// The moment coefficients Adam, RAdam and NAdam share (each kind's Coeffs
// derives from it), set from a record with beta1, beta2, eps, weight_decay
// and decoupled_weight_decay.
template <typename T>
struct AdamMomentCoeffs {
  T one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
  T decay_mul;  // 1 - lr * weight_decay (decoupled only)
  bool decoupled;

  template <typename Fields>
  FT_HD void set_moments(const Fields& h, double lr) {
    one_minus_beta1 = static_cast<T>(1.0 - h.beta1);
    beta2 = static_cast<T>(h.beta2);
    one_minus_beta2 = static_cast<T>(1.0 - h.beta2);
    eps = static_cast<T>(h.eps);
    weight_decay = static_cast<T>(h.weight_decay);
    decay_mul = static_cast<T>(1.0 - lr * h.weight_decay);
    decoupled = h.decoupled_weight_decay != 0.0;
  }
};

// Weight decay, then the first and second moments m and v, in torch's order.
template <typename V, typename T>
FT_HD void adam_moments(V& p, V& g, V& m, V& v, const AdamMomentCoeffs<T>& c) {
  adam_weight_decay(p, g, c);
  m = lerp_weight(m, g, c.one_minus_beta1);
  v = v * V(c.beta2) + V(c.one_minus_beta2) * g * g;
}

// Adam and AdamW (torch.optim.Adam, AdamW); without bias_correction the
// BertAdam form. State: s1 exp_avg, s2 exp_avg_sq, s3 max_exp_avg_sq (amsgrad).
struct AdamMath {
  template <typename T>
  struct Coeffs : AdamMomentCoeffs<T> {
    T neg_step_size;  // -lr / (1 - beta1^step)
    T inv_bc2_sqrt;   // 1 / sqrt(1 - beta2^step)
    bool amsgrad;
  };

  template <typename T>
  static FT_HD Coeffs<T> coeffs(const AdamFields& h, float lr, float step, float /*aux*/) {
    Coeffs<T> c;
    const double lr_d = static_cast<double>(lr);
    c.set_moments(h, lr_d);
    const double bc1 = 1.0 - ::pow(h.beta1, static_cast<double>(step));
    const double bc2 = 1.0 - ::pow(h.beta2, static_cast<double>(step));
    const bool bias_correction = h.bias_correction != 0.0;
    c.neg_step_size = static_cast<T>(bias_correction ? -(lr_d / bc1) : -lr_d);
    c.inv_bc2_sqrt = static_cast<T>(bias_correction ? 1.0 / ::sqrt(bc2) : 1.0);
    c.amsgrad = h.amsgrad != 0.0;
    return c;
  }

  template <typename V, typename T>
  static FT_HD void update(V& p, V g, V* s1, V* s2, V* s3, const Coeffs<T>& c) {
    V& v = *s2;
    adam_moments(p, g, *s1, v, c);
    V denom;
    if (c.amsgrad) {
      *s3 = vmax(*s3, v);
      denom = vsqrt(*s3) * V(c.inv_bc2_sqrt) + V(c.eps);
    } else {
      denom = vsqrt(v) * V(c.inv_bc2_sqrt) + V(c.eps);
    }
    p = p + V(c.neg_step_size) * *s1 / denom;
  }
};

// torch.optim.SGD's steps, each `add(x, alpha=a)` one fused multiply-add.
// State: s1 momentum_buffer (momentum > 0).
struct SGDMath {
  template <typename T>
  struct Coeffs {
    T momentum, one_minus_dampening, weight_decay, neg_lr;
    bool nesterov, first_step;
  };

  template <typename T>
  static FT_HD Coeffs<T> coeffs(const SGDFields& h, float lr, float step, float /*aux*/) {
    Coeffs<T> c;
    c.momentum = static_cast<T>(h.momentum);
    c.one_minus_dampening = static_cast<T>(1.0 - h.dampening);
    c.weight_decay = static_cast<T>(h.weight_decay);
    c.neg_lr = -static_cast<T>(lr);
    c.nesterov = h.nesterov != 0.0;
    c.first_step = step <= 1.f;
    return c;
  }

  template <typename V, typename T>
  static FT_HD void update(V& p, V g, V* buf, V* /*s2*/, V* /*s3*/, const Coeffs<T>& c) {
    if (c.weight_decay != T(0)) g = fmadd(V(c.weight_decay), p, g);
    if (buf != nullptr) {
      if (c.first_step) {
        *buf = g;
      } else {
        *buf = fmadd(V(c.one_minus_dampening), g, *buf * V(c.momentum));
      }
      g = c.nesterov ? fmadd(V(c.momentum), *buf, g) : *buf;
    }
    p = fmadd(V(c.neg_lr), g, p);
  }
};

// Lion: p -= lr * sign(beta1 * m + (1 - beta1) * g) with decoupled decay,
// then m = beta2 * m + (1 - beta2) * g. State: s1 exp_avg.
struct LionMath {
  template <typename T>
  struct Coeffs {
    T beta1, one_minus_beta1, beta2, one_minus_beta2, decay_mul, neg_lr;
    bool has_decay;
  };

  template <typename T>
  static FT_HD Coeffs<T> coeffs(const LionFields& h, float lr, float /*step*/, float /*aux*/) {
    Coeffs<T> c;
    c.beta1 = static_cast<T>(h.beta1);
    c.one_minus_beta1 = static_cast<T>(1.0 - h.beta1);
    c.beta2 = static_cast<T>(h.beta2);
    c.one_minus_beta2 = static_cast<T>(1.0 - h.beta2);
    c.decay_mul = static_cast<T>(1.0 - static_cast<double>(lr) * h.weight_decay);
    c.has_decay = h.weight_decay != 0.0;
    c.neg_lr = -static_cast<T>(lr);
    return c;
  }

  template <typename V, typename T>
  static FT_HD void update(V& p, V g, V* s1, V* /*s2*/, V* /*s3*/, const Coeffs<T>& c) {
    V& m = *s1;
    V u = m * V(c.beta1) + g * V(c.one_minus_beta1);
    if (c.has_decay) p = mul_rn(p, V(c.decay_mul));
    p = p + V(c.neg_lr) * vsign(u);
    m = m * V(c.beta2) + V(c.one_minus_beta2) * g;
  }
};

// RAdam (torch.optim.RAdam): rho_t > 5 takes the rectified adaptive step,
// otherwise the bias-corrected momentum step. State: s1 exp_avg, s2 exp_avg_sq.
struct RAdamMath {
  template <typename T>
  struct Coeffs : AdamMomentCoeffs<T> {
    T inv_bc1;    // 1 / (1 - beta1^step)
    T neg_lr;     // -lr
    T sqrt_bc2;   // sqrt(1 - beta2^step)
    T rect;       // the variance rectification term
    bool adaptive;
  };

  template <typename T>
  static FT_HD Coeffs<T> coeffs(const RAdamFields& h, float lr, float step, float /*aux*/) {
    Coeffs<T> c;
    const double lr_d = static_cast<double>(lr), t = static_cast<double>(step);
    c.set_moments(h, lr_d);
    const double beta2_t = ::pow(h.beta2, t);
    const double bc1 = 1.0 - ::pow(h.beta1, t), bc2 = 1.0 - beta2_t;
    c.inv_bc1 = static_cast<T>(1.0 / bc1);
    c.neg_lr = static_cast<T>(-lr_d);
    c.sqrt_bc2 = static_cast<T>(::sqrt(bc2));
    const double rho_inf = 2.0 / (1.0 - h.beta2) - 1.0;
    const double rho_t = rho_inf - 2.0 * t * beta2_t / bc2;
    c.adaptive = rho_t > 5.0;
    c.rect = c.adaptive ? static_cast<T>(::sqrt((rho_t - 4.0) * (rho_t - 2.0) * rho_inf /
                                                ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t)))
                        : T(1);
    return c;
  }

  template <typename V, typename T>
  static FT_HD void update(V& p, V g, V* s1, V* s2, V* /*s3*/, const Coeffs<T>& c) {
    V& v = *s2;
    adam_moments(p, g, *s1, v, c);
    const V corrected = *s1 * V(c.inv_bc1);
    if (c.adaptive) {
      p = p - corrected * V(-c.neg_lr) * (V(c.sqrt_bc2) / (vsqrt(v) + V(c.eps))) * V(c.rect);
    } else {
      p = p - corrected * V(-c.neg_lr);
    }
  }
};

// NAdam (torch.optim.NAdam): the momentum schedule mu_t and the running
// product of the mu's, mu_product, a scalar state per tensor beside its step
// (NOTE [tensor scalars]) that `aux` holds. State: s1 exp_avg, s2 exp_avg_sq.
struct NAdamMath {
  template <typename T>
  struct Coeffs : AdamMomentCoeffs<T> {
    T bc2;        // 1 - beta2^step
    T grad_coef;  // -lr * (1 - mu_t) / (1 - mu_product_t)
    T avg_coef;   // -lr * mu_{t+1} / (1 - mu_product_t * mu_{t+1})
  };

  // mu_t = beta1 * (1 - 0.5 * 0.96^(t * momentum_decay)), in double as torch's
  // Python floats.
  static FT_HD double mu(const NAdamFields& h, double t) {
    return h.beta1 * (1.0 - 0.5 * ::pow(0.96, t * h.momentum_decay));
  }

  // The new mu_product of a step (step already incremented): a float32
  // product, as torch's in-place multiply of its float32 state by a Python float.
  static FT_HD float next_aux(const NAdamFields& h, float step, float mu_product) {
    return mu_product * static_cast<float>(mu(h, static_cast<double>(step)));
  }

  // `aux` is the tensor's mu_product after this step's update.
  template <typename T>
  static FT_HD Coeffs<T> coeffs(const NAdamFields& h, float lr, float step, float aux) {
    Coeffs<T> c;
    const double lr_d = static_cast<double>(lr), t = static_cast<double>(step);
    c.set_moments(h, lr_d);
    c.bc2 = static_cast<T>(1.0 - ::pow(h.beta2, t));
    const double mu_t = mu(h, t), mu_next = mu(h, t + 1.0);
    const double mu_product = static_cast<double>(aux);
    c.grad_coef = static_cast<T>(-lr_d * (1.0 - mu_t) / (1.0 - mu_product));
    c.avg_coef = static_cast<T>((-lr_d * mu_next) / (1.0 - mu_product * mu_next));
    return c;
  }

  template <typename V, typename T>
  static FT_HD void update(V& p, V g, V* s1, V* s2, V* /*s3*/, const Coeffs<T>& c) {
    V& v = *s2;
    adam_moments(p, g, *s1, v, c);
    const V denom = vsqrt(v / V(c.bc2)) + V(c.eps);
    p = p + V(c.grad_coef) * g / denom;
    p = p + V(c.avg_coef) * *s1 / denom;
  }
};

}  // namespace detail
}  // namespace fusetrain

#include "rms_math.h"     // RMSprop, Adadelta
#include "staged_math.h"  // the Direction and Apply passes of Lamb, AdamP, Muon
