// Lean optimizer state: the 16-bit forms a fused update reads and writes in
// place of fp32 (NOTE [lean state]). Shared by the CPU and CUDA kernels.
//
// NOTE [lean state]: three ways to keep a bfloat16 param's full value and
// one to keep the moments in fewer bytes, chosen per group:
//   * master_weights=True: an fp32 master copy (4 bytes);
//   * "remainder": an int16 remainder r beside the bf16 param p; the fp32 value
//     has the bits (p << 16) + r (mod 2^32). p is the value rounded to nearest
//     with ties away from zero (|r| <= 0x8000 needs one tie direction: 65537
//     values do not fit 16 bits), so the pair is the exact fp32 master and p
//     differs from torch's round-to-nearest-even only in an exact tie;
//   * "stochastic": no master; the param is written back with stochastic
//     rounding (unbiased: rounded up with probability equal to the fraction
//     of an ulp above the lower neighbour);
//   * bfloat16 moments: the state slots in bf16, written back with stochastic
//     rounding too (a bf16 exp_avg_sq with round-to-nearest stops decaying:
//     v * 0.999 rounds back to v).
// The random bits come from a counter-based hash of the param's step count,
// its position in the launch, the stream (param or state slot) and the
// element's index: no generator state, the same bits on CPU and CUDA, eager,
// compiled or captured, and after a resume.
#pragma once

#include <cstdint>
#include <cstring>

#include "optim_math.h"  // FT_HD

namespace fusetrain {
namespace detail {

// Master-weight modes of a group record's `master_weights` field.
enum class MasterMode : int { None = 0, Full = 1, Remainder = 2, Stochastic = 3 };

FT_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
#endif
}

FT_HD float bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
#endif
}

// A 32-bit integer hash with good avalanche (bijective).
FT_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The key of one tensor's stream in one step: stream 0 is the param, 1..3 the
// state slots.
FT_HD uint32_t rounding_key(float step, int64_t tensor, int stream) {
  const uint32_t s = static_cast<uint32_t>(step);
  return mix32(mix32(s * 0x9E3779B9u + static_cast<uint32_t>(stream)) ^ static_cast<uint32_t>(tensor) * 0x85EBCA6Bu);
}

// 32 random bits of element `i` of the stream `key`.
FT_HD uint32_t rounding_bits(uint32_t key, int64_t i) {
  const uint32_t lo = static_cast<uint32_t>(i), hi = static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32);
  return mix32(mix32(key ^ lo) + hi * 0x27D4EB2Fu);
}

// The bfloat16 bits of x rounded stochastically with the random bits `rnd`
// (NaN and infinities rounded to nearest).
FT_HD uint16_t stochastic_bf16_bits(float x, uint32_t rnd) {
  uint32_t b = float_bits(x);
  if ((b & 0x7F800000u) == 0x7F800000u) {
    return static_cast<uint16_t>((b >> 16) | ((b & 0x007FFFFFu) != 0 ? 0x0040u : 0u));
  }
  b += rnd & 0xFFFFu;  // a carry into the exponent is the correct next value
  return static_cast<uint16_t>(b >> 16);
}

// NOTE [lean state]'s remainder form: the fp32 value of (param bits, remainder).
FT_HD float join_remainder(uint16_t param_bits, int16_t rem) {
  return bits_float((static_cast<uint32_t>(param_bits) << 16) + static_cast<uint32_t>(static_cast<int32_t>(rem)));
}

// Splits x into its bf16 param bits (rounded to nearest, ties away from zero)
// and the int16 remainder; a NaN becomes a quiet NaN with remainder 0.
FT_HD void split_remainder(float x, uint16_t& param_bits, int16_t& rem) {
  const uint32_t b = float_bits(x);
  if ((b & 0x7F800000u) == 0x7F800000u && (b & 0x007FFFFFu) != 0) {
    param_bits = static_cast<uint16_t>((b >> 16) | 0x0040u);
    rem = 0;
    return;
  }
  const uint32_t hi = (b + 0x8000u) >> 16;
  param_bits = static_cast<uint16_t>(hi);
  rem = static_cast<int16_t>(static_cast<int32_t>(b - (hi << 16)));
}

}  // namespace detail
}  // namespace fusetrain
