// Element-wise math of the squared-average optimizer kinds (RMSprop,
// Adadelta), shared by the CPU and CUDA kernels as optim_math.h (which
// includes this file and says what a <Kind>Math holds). The operation order
// follows torch.optim's single-tensor implementations.
#pragma once

#include "device_math.h"
#include "kind_table.h"

namespace fusetrain {
namespace detail {

// RMSprop (torch.optim.RMSprop): sq = alpha*sq + (1-alpha)*g^2; centered:
// ga = lerp(ga, g, 1-alpha) and the denominator is sqrt(sq - ga^2) + eps;
// with momentum the step goes through buf = momentum*buf + g/denom.
// State: s1 square_avg, s2 momentum_buffer (momentum > 0), s3 grad_avg
// (centered).
// NOTE [rmsprop tf]: timm's RMSpropTF (TensorFlow's form, tf_style): eps
// inside the square root, the averages updated as a + (x - a) * (1 - alpha),
// optional decoupled decay p *= 1 - lr * wd, and with lr_in_momentum the lr
// goes into the momentum buffer (buf = m * buf + lr * g / avg; p -= buf). Its
// square_avg starts at 1 (the table's initial value when tf_style).
struct RMSpropMath {
  template <typename T>
  struct Coeffs {
    T alpha, one_minus_alpha, eps, weight_decay, momentum, neg_lr, decay_mul;
    bool centered, has_momentum, tf_style, lr_in_momentum, decoupled;
  };

  template <typename T>
  static FT_HD Coeffs<T> coeffs(const RMSpropFields& h, float lr, float /*step*/, float /*aux*/) {
    Coeffs<T> c;
    c.alpha = static_cast<T>(h.alpha);
    c.one_minus_alpha = static_cast<T>(1.0 - h.alpha);
    c.eps = static_cast<T>(h.eps);
    c.weight_decay = static_cast<T>(h.weight_decay);
    c.momentum = static_cast<T>(h.momentum);
    c.neg_lr = -static_cast<T>(lr);
    c.decay_mul = static_cast<T>(1.0 - static_cast<double>(lr) * h.weight_decay);
    c.centered = h.centered != 0.0;
    c.has_momentum = h.momentum > 0.0;
    c.tf_style = h.tf_style != 0.0;
    c.lr_in_momentum = h.lr_in_momentum != 0.0;
    c.decoupled = h.decoupled_weight_decay != 0.0;
    return c;
  }

  // NOTE [rmsprop tf]: the TensorFlow form, in timm's RMSpropTF's order.
  template <typename V, typename T>
  static FT_HD void tf_update(V& p, V g, V& sq, V* buf, V* grad_avg, const Coeffs<T>& c) {
    if (c.weight_decay != T(0)) {
      if (c.decoupled) {
        p = mul_rn(p, V(c.decay_mul));
      } else {
        g = g + V(c.weight_decay) * p;
      }
    }
    sq = sq + (g * g - sq) * V(c.one_minus_alpha);
    V avg;
    if (c.centered) {
      *grad_avg = *grad_avg + (g - *grad_avg) * V(c.one_minus_alpha);
      avg = vsqrt(sq - *grad_avg * *grad_avg + V(c.eps));
    } else {
      avg = vsqrt(sq + V(c.eps));
    }
    if (c.has_momentum && c.lr_in_momentum) {
      *buf = *buf * V(c.momentum) + V(-c.neg_lr) * (g / avg);
      p = p - *buf;
    } else if (c.has_momentum) {
      *buf = *buf * V(c.momentum) + g / avg;
      p = p + V(c.neg_lr) * *buf;
    } else {
      p = p + V(c.neg_lr) * (g / avg);
    }
  }

  template <typename V, typename T>
  static FT_HD void update(V& p, V g, V* s1, V* buf, V* grad_avg, const Coeffs<T>& c) {
    V& sq = *s1;
    if (c.tf_style) return tf_update(p, g, sq, buf, grad_avg, c);
    if (c.weight_decay != T(0)) g = g + V(c.weight_decay) * p;
    sq = sq * V(c.alpha) + V(c.one_minus_alpha) * g * g;
    V avg;
    if (c.centered) {
      *grad_avg = lerp_weight(*grad_avg, g, c.one_minus_alpha);
      avg = vsqrt(sq - *grad_avg * *grad_avg) + V(c.eps);
    } else {
      avg = vsqrt(sq) + V(c.eps);
    }
    if (c.has_momentum) {
      *buf = *buf * V(c.momentum) + g / avg;
      p = p + V(c.neg_lr) * *buf;
    } else {
      p = p + V(c.neg_lr) * (g / avg);
    }
  }
};

// Adadelta (torch.optim.Adadelta): sq = rho*sq + (1-rho)*g^2;
// delta = sqrt(acc + eps) / sqrt(sq + eps) * g; acc = rho*acc + (1-rho)*delta^2;
// p -= lr*delta. State: s1 square_avg, s2 acc_delta.
struct AdadeltaMath {
  template <typename T>
  struct Coeffs {
    T rho, one_minus_rho, eps, weight_decay, neg_lr;
  };

  template <typename T>
  static FT_HD Coeffs<T> coeffs(const AdadeltaFields& h, float lr, float /*step*/, float /*aux*/) {
    Coeffs<T> c;
    c.rho = static_cast<T>(h.rho);
    c.one_minus_rho = static_cast<T>(1.0 - h.rho);
    c.eps = static_cast<T>(h.eps);
    c.weight_decay = static_cast<T>(h.weight_decay);
    c.neg_lr = -static_cast<T>(lr);
    return c;
  }

  template <typename V, typename T>
  static FT_HD void update(V& p, V g, V* s1, V* s2, V* /*s3*/, const Coeffs<T>& c) {
    V& sq = *s1;
    V& acc = *s2;
    if (c.weight_decay != T(0)) g = g + V(c.weight_decay) * p;
    sq = sq * V(c.rho) + V(c.one_minus_rho) * g * g;
    const V delta = vsqrt(acc + V(c.eps)) / vsqrt(sq + V(c.eps)) * g;
    acc = acc * V(c.rho) + V(c.one_minus_rho) * delta * delta;
    p = p + V(c.neg_lr) * delta;
  }
};

}  // namespace detail
}  // namespace fusetrain
