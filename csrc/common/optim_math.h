// Element-wise optimizer math shared by the CPU and CUDA kernels.
//
// Every function is written once, templated on the value type V: `float` or
// `double` in the CUDA kernels and `at::vec::Vectorized<float|double>` in the
// CPU kernels, and on the coefficient type T (float, or double for float64
// params). The helpers vsqrt/vmax/vsign have overloads for each V (the
// Vectorized ones live in the CPU kernel file). The operation order follows torch.optim's single-tensor
// implementations so that fp32 results agree to rounding; the one exception is
// Adam's bias correction of the second moment, applied as a multiplication by
// 1/sqrt(1 - beta2^t) instead of a division (one division less per element,
// a difference of at most an ulp in the denominator).
#pragma once

#include <cmath>
#include <type_traits>

#if defined(__CUDACC__)
#define FT_HD __host__ __device__ __forceinline__
#else
#define FT_HD inline
#endif

namespace fusetrain {
namespace detail {

FT_HD float vsqrt(float x) { return ::sqrtf(x); }
FT_HD float vmax(float a, float b) { return (a > b || a != a) ? a : b; }  // NaN-propagating, as torch.maximum
FT_HD float vsign(float x) { return static_cast<float>((x > 0.f) - (x < 0.f)); }
FT_HD double vsqrt(double x) { return ::sqrt(x); }
FT_HD double vmax(double a, double b) { return (a > b || a != a) ? a : b; }
FT_HD double vsign(double x) { return static_cast<double>((x > 0.0) - (x < 0.0)); }
// a * b + c rounded once, where torch's kernels fuse it (its vectorized lerp,
// and `add` with an alpha): the CPU kernels fuse nothing else (NOTE [no
// contraction] in CMakeLists.txt).
// Vectorized arguments find at::vec::fmadd by argument-dependent lookup.
FT_HD float fmadd(float a, float b, float c) { return ::fmaf(a, b, c); }
FT_HD double fmadd(double a, double b, double c) { return ::fma(a, b, c); }

// NOTE [rounded decay]: the decoupled weight decay's product p * (1 - lr * wd)
// is rounded on its own, as torch's `param.mul_(1 - lr * wd)`. Left to nvcc,
// the product may fuse with the update's add into one FMA (or not, as the
// surrounding code changes); the difference of one rounding a step walks a few
// elements past float32 agreement with torch over hundreds of steps. The CPU
// kernels' products are rounded on their own (NOTE [no contraction] in
// CMakeLists.txt).
template <typename V>
FT_HD V mul_rn(V a, V b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<V, double>) {
    return __dmul_rn(a, b);
  } else {
    return __fmul_rn(a, b);
  }
#else
  return a * b;  // the CPU kernels' Vectorized products, rounded on their own
#endif
}

// Per-tensor coefficients, computed once per tensor (per chunk on CUDA) from
// the device scalars (lr, step) and the host hyperparameters, in the
// precision T of the update (float, or double for float64 params).
template <typename T>
struct AdamCoeffs {
  T beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
  T decay_mul;      // 1 - lr * weight_decay (decoupled only)
  T neg_step_size;  // -lr / (1 - beta1^step)
  T inv_bc2_sqrt;   // 1 / sqrt(1 - beta2^step)
  bool decoupled, amsgrad;
};

// RAdam: rho_t > 5 takes the rectified adaptive step, otherwise the
// bias-corrected momentum step (torch.optim.RAdam).
template <typename T>
struct RAdamCoeffs {
  T one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
  T decay_mul;    // 1 - lr * weight_decay (decoupled only)
  T inv_bc1;      // 1 / (1 - beta1^step)
  T neg_lr;       // -lr
  T sqrt_bc2;     // sqrt(1 - beta2^step)
  T rect;         // the variance rectification term
  bool decoupled, adaptive;
};

template <typename T>
struct SGDCoeffs {
  T momentum, one_minus_dampening, weight_decay, neg_lr;
  bool nesterov, first_step;
};

template <typename T>
struct LionCoeffs {
  T beta1, one_minus_beta1, beta2, one_minus_beta2, decay_mul, neg_lr;
  bool has_decay;
};

// torch.lerp's formula: exact at both ends, used for the first moment and
// EMA, with one rounding of the product and sum as torch's vectorized lerp.
template <typename V, typename T>
FT_HD V lerp_small_weight(V self, V end, T w) {
  // Every weight we pass is in [0, 0.5): 1 - beta1 and 1 - decay.
  return fmadd(V(w), end - self, self);
}
template <typename V, typename T>
FT_HD V lerp_weight(V self, V end, T w) {
  if (w < T(0.5)) return fmadd(V(w), end - self, self);
  return fmadd(V(w - T(1)), end - self, end);  // w - 1 is exact for w in [0.5, 1]
}

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

template <typename V, typename T>
FT_HD void adam_update(V& p, V g, V& m, V& v, V* vmax_state, const AdamCoeffs<T>& c) {
  adam_weight_decay(p, g, c);
  m = lerp_weight(m, g, c.one_minus_beta1);
  v = v * V(c.beta2) + V(c.one_minus_beta2) * g * g;
  V denom;
  if (c.amsgrad) {
    *vmax_state = vmax(*vmax_state, v);
    denom = vsqrt(*vmax_state) * V(c.inv_bc2_sqrt) + V(c.eps);
  } else {
    denom = vsqrt(v) * V(c.inv_bc2_sqrt) + V(c.eps);
  }
  p = p + V(c.neg_step_size) * m / denom;
}

template <typename V, typename T>
FT_HD void radam_update(V& p, V g, V& m, V& v, const RAdamCoeffs<T>& c) {
  adam_weight_decay(p, g, c);
  m = lerp_weight(m, g, c.one_minus_beta1);
  v = v * V(c.beta2) + V(c.one_minus_beta2) * g * g;
  const V corrected = m * V(c.inv_bc1);
  if (c.adaptive) {
    p = p - corrected * V(-c.neg_lr) * (V(c.sqrt_bc2) / (vsqrt(v) + V(c.eps))) * V(c.rect);
  } else {
    p = p - corrected * V(-c.neg_lr);
  }
}

// torch.optim.SGD's steps, each `add(x, alpha=a)` one fused multiply-add.
template <typename V, typename T>
FT_HD void sgd_update(V& p, V g, V* buf, const SGDCoeffs<T>& c) {
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

// NAdam (torch.optim.NAdam): the momentum schedule mu_t and the running
// product of the mu's (kept per tensor, NOTE [tensor scalars] in update_args.h).
template <typename T>
struct NAdamCoeffs {
  T one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
  T decay_mul;   // 1 - lr * weight_decay (decoupled only)
  T bc2;         // 1 - beta2^step
  T grad_coef;   // -lr * (1 - mu_t) / (1 - mu_product_t)
  T avg_coef;    // -lr * mu_{t+1} / (1 - mu_product_t * mu_{t+1})
  bool decoupled;
};

template <typename V, typename T>
FT_HD void nadam_update(V& p, V g, V& m, V& v, const NAdamCoeffs<T>& c) {
  adam_weight_decay(p, g, c);
  m = lerp_weight(m, g, c.one_minus_beta1);
  v = v * V(c.beta2) + V(c.one_minus_beta2) * g * g;
  const V denom = vsqrt(v / V(c.bc2)) + V(c.eps);
  p = p + V(c.grad_coef) * g / denom;
  p = p + V(c.avg_coef) * m / denom;
}

template <typename V, typename T>
FT_HD void lion_update(V& p, V g, V& m, const LionCoeffs<T>& c) {
  V u = m * V(c.beta1) + g * V(c.one_minus_beta1);
  if (c.has_decay) p = mul_rn(p, V(c.decay_mul));
  p = p + V(c.neg_lr) * vsign(u);
  m = m * V(c.beta2) + V(c.one_minus_beta2) * g;
}

// Host/device helpers that turn the device scalars into coefficients.
// `step` is the already incremented step count of the tensor.
struct AdamHyper {
  double beta1, beta2, eps, weight_decay;
  bool decoupled, amsgrad;
  bool bias_correction = true;  // false: the BertAdam form (no 1 - beta^t corrections)
};
struct SGDHyper {
  double momentum, dampening, weight_decay;
  bool nesterov;
};
struct LionHyper {
  double beta1, beta2, weight_decay;
};
struct RAdamHyper {
  double beta1, beta2, eps, weight_decay;
  bool decoupled;
};
struct NAdamHyper {
  double beta1, beta2, eps, weight_decay, momentum_decay;
  bool decoupled;
};

template <typename T>
FT_HD AdamCoeffs<T> make_adam_coeffs(const AdamHyper& h, float lr, float step) {
  AdamCoeffs<T> c;
  c.beta1 = static_cast<T>(h.beta1);
  c.one_minus_beta1 = static_cast<T>(1.0 - h.beta1);
  c.beta2 = static_cast<T>(h.beta2);
  c.one_minus_beta2 = static_cast<T>(1.0 - h.beta2);
  c.eps = static_cast<T>(h.eps);
  c.weight_decay = static_cast<T>(h.weight_decay);
  const double lr_d = static_cast<double>(lr);
  c.decay_mul = static_cast<T>(1.0 - lr_d * h.weight_decay);
  const double bc1 = 1.0 - ::pow(h.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - ::pow(h.beta2, static_cast<double>(step));
  c.neg_step_size = static_cast<T>(h.bias_correction ? -(lr_d / bc1) : -lr_d);
  c.inv_bc2_sqrt = static_cast<T>(h.bias_correction ? 1.0 / ::sqrt(bc2) : 1.0);
  c.decoupled = h.decoupled;
  c.amsgrad = h.amsgrad;
  return c;
}

template <typename T>
FT_HD SGDCoeffs<T> make_sgd_coeffs(const SGDHyper& h, float lr, float step) {
  SGDCoeffs<T> c;
  c.momentum = static_cast<T>(h.momentum);
  c.one_minus_dampening = static_cast<T>(1.0 - h.dampening);
  c.weight_decay = static_cast<T>(h.weight_decay);
  c.neg_lr = -static_cast<T>(lr);
  c.nesterov = h.nesterov;
  c.first_step = step <= 1.f;
  return c;
}

template <typename T>
FT_HD LionCoeffs<T> make_lion_coeffs(const LionHyper& h, float lr, float /*step*/) {
  LionCoeffs<T> c;
  c.beta1 = static_cast<T>(h.beta1);
  c.one_minus_beta1 = static_cast<T>(1.0 - h.beta1);
  c.beta2 = static_cast<T>(h.beta2);
  c.one_minus_beta2 = static_cast<T>(1.0 - h.beta2);
  c.decay_mul = static_cast<T>(1.0 - static_cast<double>(lr) * h.weight_decay);
  c.has_decay = h.weight_decay != 0.0;
  c.neg_lr = -static_cast<T>(lr);
  return c;
}

template <typename T>
FT_HD RAdamCoeffs<T> make_radam_coeffs(const RAdamHyper& h, float lr, float step) {
  RAdamCoeffs<T> c;
  c.one_minus_beta1 = static_cast<T>(1.0 - h.beta1);
  c.beta2 = static_cast<T>(h.beta2);
  c.one_minus_beta2 = static_cast<T>(1.0 - h.beta2);
  c.eps = static_cast<T>(h.eps);
  c.weight_decay = static_cast<T>(h.weight_decay);
  const double lr_d = static_cast<double>(lr), t = static_cast<double>(step);
  c.decay_mul = static_cast<T>(1.0 - lr_d * h.weight_decay);
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
  c.decoupled = h.decoupled;
  return c;
}

// mu_t = beta1 * (1 - 0.5 * 0.96^(t * momentum_decay)), in double as torch's
// Python floats.
FT_HD double nadam_mu(const NAdamHyper& h, double t) {
  return h.beta1 * (1.0 - 0.5 * ::pow(0.96, t * h.momentum_decay));
}

// The new mu_product of a step (step already incremented): a float32 product,
// as torch's in-place multiply of its float32 state by a Python float.
FT_HD float nadam_next_mu_product(const NAdamHyper& h, float step, float mu_product) {
  return mu_product * static_cast<float>(nadam_mu(h, static_cast<double>(step)));
}

// `aux` is the tensor's mu_product after this step's update.
template <typename T>
FT_HD NAdamCoeffs<T> make_nadam_coeffs(const NAdamHyper& h, float lr, float step, float aux) {
  NAdamCoeffs<T> c;
  c.one_minus_beta1 = static_cast<T>(1.0 - h.beta1);
  c.beta2 = static_cast<T>(h.beta2);
  c.one_minus_beta2 = static_cast<T>(1.0 - h.beta2);
  c.eps = static_cast<T>(h.eps);
  c.weight_decay = static_cast<T>(h.weight_decay);
  const double lr_d = static_cast<double>(lr), t = static_cast<double>(step);
  c.decay_mul = static_cast<T>(1.0 - lr_d * h.weight_decay);
  c.bc2 = static_cast<T>(1.0 - ::pow(h.beta2, t));
  const double mu = nadam_mu(h, t), mu_next = nadam_mu(h, t + 1.0);
  const double mu_product = static_cast<double>(aux);
  c.grad_coef = static_cast<T>(-lr_d * (1.0 - mu) / (1.0 - mu_product));
  c.avg_coef = static_cast<T>((-lr_d * mu_next) / (1.0 - mu_product * mu_next));
  c.decoupled = h.decoupled;
  return c;
}

// Multiplier applied to every gradient element: inverse loss scale times the
// clip coefficient min(1, max_norm / (norm + 1e-6)).
FT_HD float grad_multiplier(const float* inv_scale, const float* grad_norm, float max_grad_norm) {
  float m = 1.f;
  if (inv_scale != nullptr) m = *inv_scale;
  if (grad_norm != nullptr && max_grad_norm > 0.f) {
    const float coef = max_grad_norm / (*grad_norm + 1e-6f);
    if (coef < 1.f) m = m * coef;
  }
  return m;
}

// The EMA decay schedules (ModelEMA's docs) for update number t = step + 1,
// in float32, one operation after another:
//   constant: decay;  threshold: min(decay, (1 + t) / (10 + t));
//   exp: decay * (1 - exp(-beta * t / total_steps));
//   warmup also caps it at 1 - (1 + t / warmup_gamma) ^ -warmup_power.
enum class EmaDecayType : int { Constant = 0, Threshold = 1, Exp = 2 };

struct EmaSchedule {
  EmaDecayType type = EmaDecayType::Constant;
  float decay = 0.f, beta = 1.f, warmup_gamma = 1.f, warmup_power = 1.f;
  bool warmup = false;
};

// `total` is read by the exp schedule only.
FT_HD float ema_decay_math(float step, float total, const EmaSchedule& s) {
  const float t = step + 1.f;
  float d = s.decay;
  if (s.type == EmaDecayType::Threshold) {
    const float ramp = (t + 1.f) / (t + 10.f);
    d = ramp < s.decay ? ramp : s.decay;
  } else if (s.type == EmaDecayType::Exp) {
    d = (1.f - ::expf(t * -s.beta / total)) * s.decay;
  }
  if (s.warmup) {
    const float cap = 1.f - ::powf(t / s.warmup_gamma + 1.f, -s.warmup_power);
    d = cap < d ? cap : d;
  }
  return d;
}

// The smallest normal float32 (2^-126): the lowest loss scale (NOTE [scale floor]).
constexpr float kMinLossScale = 1.17549435082228750797e-38f;

// Dynamic loss-scale update (GradScaler semantics): back off and reset the
// tracker on a non-finite step; otherwise count the clean step and grow the
// scale (if the grown value is finite) every growth_interval clean steps.
FT_HD void update_scale_math(float* scale, int* growth_tracker, float found_inf, double growth_factor,
                             double backoff_factor, int growth_interval) {
  // Products are taken in double and rounded once, as torch does.
  if (found_inf != 0.f) {
    // NOTE [scale floor]: a run whose every step overflows would drive the
    // scale to 0 (about 166 halvings from 2^16); 1/0 then writes inf * 0 = NaN
    // into the weights at the next finite step. The scale stops at the
    // smallest normal float instead; LossScaler reports a scale at the floor.
    const float backed = static_cast<float>(static_cast<double>(*scale) * backoff_factor);
    *scale = backed > kMinLossScale ? backed : kMinLossScale;
    *growth_tracker = 0;
    return;
  }
  const int successful = *growth_tracker + 1;
  if (successful == growth_interval) {
    const float grown = static_cast<float>(static_cast<double>(*scale) * growth_factor);
    if (grown - grown == 0.f) *scale = grown;  // finite
    *growth_tracker = 0;
  } else {
    *growth_tracker = successful;
  }
}

}  // namespace detail
}  // namespace fusetrain

#include "rms_math.h"     // RMSprop, Adadelta
#include "staged_math.h"  // the direction and apply passes of Lamb, AdamP, Muon
