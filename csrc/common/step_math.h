// The math of the step's tail, shared by the CPU and CUDA kernels: the
// multiplier of every gradient element (inverse loss scale times the clip
// coefficient), the EMA decay schedules and the loss-scale update.
#pragma once

#include "device_math.h"

namespace fusetrain {
namespace detail {

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
