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
//
// NOTE [paired draws]: a rounding to bfloat16 or to an 8-bit code uses 16
// random bits, a draw gives 32, and the draw is the cost (the hash, not the
// memory, bounds a lean step). State slots 1 and 2 of an element round with
// the two halves of one draw of stream 1 (slot 1 the low half, slot 2 the
// high); slot 3 takes the low half of stream 3's draw, the param that of
// stream 0's. bfloat16 and 8-bit moments draw alike.
#pragma once

#include <cstdint>
#include <cstring>

#include "device_math.h"  // FT_HD

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

// rounding_bits from the key xor the index's low word and the term of its
// high word (a loop over indices that share the high word forms both once).
FT_HD uint32_t rounding_bits_of(uint32_t keyed_low, uint32_t high_term) { return mix32(keyed_low + high_term); }
FT_HD uint32_t rounding_high_term(int64_t i) {
  return static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32) * 0x27D4EB2Fu;
}

// 32 random bits of element `i` of the stream `key`: one mix of the index
// under the key (the key itself is mixed twice, once per tensor and step).
FT_HD uint32_t rounding_bits(uint32_t key, int64_t i) {
  return rounding_bits_of(key ^ static_cast<uint32_t>(i), rounding_high_term(i));
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

// NOTE [ema remainder]: an EMA of bfloat16 weights kept in bfloat16 hardly
// moves: its update, (1 - decay) times its distance to the weights, rounds
// away below half an ulp (2^-9 of the EMA's magnitude), so with decay 0.999
// an element moves only while the weights are about twice its magnitude
// away from it. With an int16
// remainder beside each bfloat16 EMA tensor the pair is the exact float32
// EMA (split_remainder / join_remainder, as the master's remainder form):
// the EMA module stays a bfloat16 module that evaluates as the weights do, at
// 4 bytes per value, and its values are bit for bit a float32 EMA's of the
// same sources. The update pass and ema_update_ join, average and split in
// one read and write.

// NOTE [stalled updates]: a float16 or bfloat16 param kept without a master
// (master_weights False or "stochastic") loses an update that does not move
// its stored value: a learning rate too small for the weights' precision
// shows as many such elements. With a counter, the update pass adds the
// number of elements whose stored 16-bit value is unchanged although the
// value the update computed differs from it (a block reduction, one atomic
// add per warp or work item; no host sync). Params with a master are not
// counted: their master keeps every update.

// NOTE [8-bit state]: state_dtype "int8" keeps each state slot of a param as
// one byte per element (a code) and one float32 scale per block of B elements
// (B = 64, 128 or 256; the blocks start at element 0 of the param's state and
// never cross a param or an FSDP shard: each shard's state is its own tensor).
// A block's scale is the largest magnitude of its values; a code is that
// value times the scale's reciprocal in a small floating-point format whose
// rounding is stochastic (16 bits of lean_state's stream, NOTE [paired
// draws], so a moment decaying by 0.999 a step keeps decaying). The sign of
// the scale names the block's map:
//   * scale >= +0 (some value negative): sign bit, 4 exponent bits and 3
//     mantissa bits (E4M3), normal down to 2^-14 of the scale, then a linear
//     step of 2^-17;
//   * scale <= -0 (every value >= 0, e.g. a second moment): 5 exponent bits
//     and 3 mantissa bits (E5M3) with no sign, normal down to 2^-30 of the
//     scale, then a linear step of 2^-33 (the range a second moment needs).
// A block holding a non-finite value gets the scale NaN and codes 0 (its
// values read back as NaN, as an fp32 state would hold them); a block whose
// largest magnitude is below float32's smallest normal (2^-126, where the
// reciprocal would overflow) is stored as zeros. The codes are the fp32 bits
// of the normalised value shifted, so encoding and decoding are exact integer
// operations; python/fusetrain/optim/_int8_state.py mirrors them for
// state-dict conversion and the tests check the two bit for bit.
constexpr int kQ8Shift = 20;  // fp32 mantissa bits below a code's 3

// The normalised value (|x| / |scale|, before the scale) of code c.
FT_HD float q8_decode(uint8_t c, bool unsigned_map) {
  if (unsigned_map) {
    if ((c >> 3) == 0) return static_cast<float>(c) * 1.16415321826934814453125e-10f;  // 2^-33
    return bits_float((static_cast<uint32_t>(c) + 768u) << kQ8Shift);
  }
  const uint32_t m = c & 0x7Fu;
  const float v = (m >> 3) == 0 ? static_cast<float>(m) * 7.62939453125e-6f  // 2^-17
                                : bits_float((m + 896u) << kQ8Shift);
  return (c & 0x80u) ? -v : v;
}

// The constants of one map of NOTE [8-bit state].
struct Q8Map {
  uint32_t low;       // the fp32 bits where its normal codes start (2^-30 or 2^-14)
  int32_t bias;       // fp32 (exponent, 3 mantissa bits) minus code, for normal codes
  int32_t top;        // its largest code
  uint32_t sign;      // 0x80 where the map has a sign bit
};

FT_HD Q8Map q8_map(bool unsigned_map) {
  return unsigned_map ? Q8Map{97u << 23, 768, 255, 0u} : Q8Map{113u << 23, 896, 127, 0x80u};
}

// The code of x (a value times its block's norm: |x| <= 1, up to rounding),
// rounded stochastically with the 16 random bits in the low half of `rnd`:
// the exponent and 3 mantissa bits of |x|, the 20 bits below rounded by
// adding the random bits at their top (a carry is the next code). Below the
// normal codes, |x| + low (one binade up, where a linear step is 2^20 fp32
// steps) takes the same shift and rounding. Branch-free, so a loop over it
// vectorises.
FT_HD uint8_t q8_encode(float x, const Q8Map& map, uint32_t rnd) {
  const uint32_t b = float_bits(x);
  const uint32_t mag = b & 0x7FFFFFFFu;
  const bool linear = mag < map.low;
  const uint32_t z = linear ? float_bits(bits_float(mag) + bits_float(map.low)) : mag;
  int32_t code = static_cast<int32_t>((z + ((rnd & 0xFFFFu) << 4)) >> kQ8Shift) - (map.bias + (linear ? 8 : 0));
  code = code < map.top ? code : map.top;
  return static_cast<uint8_t>(code | static_cast<int32_t>((b >> 24) & map.sign));
}

// How one block is stored (NOTE [8-bit state]): its scale, the factor that
// normalises its values (0: its codes are all 0) and its map.
struct Q8Block {
  float scale;
  float norm;
  bool unsigned_map;
};

// The block whose finite values have the largest magnitude `absmax`, with
// `negative` whether one is below zero and `finite` whether all are finite.
FT_HD Q8Block q8_block(float absmax, bool negative, bool finite) {
  if (!finite) return Q8Block{bits_float(0x7FC00000u), 0.f, !negative};
  const float kept = absmax >= 1.17549435082228750797e-38f ? absmax : 0.f;  // 2^-126
  return Q8Block{negative ? kept : -kept, kept > 0.f ? 1.f / kept : 0.f, !negative};
}

// The code of value y of a block (branch-free: a zero norm encodes and
// drops the code).
FT_HD uint8_t q8_store(float y, const Q8Block& block, uint32_t rnd) {
  const uint8_t c = q8_encode(y * block.norm, q8_map(block.unsigned_map), rnd);
  return block.norm != 0.f ? c : uint8_t{0};
}

// The value of code c of a block with stored scale `scale`.
FT_HD float q8_load(uint8_t c, float scale) {
  const uint32_t b = float_bits(scale);
  return q8_decode(c, (b >> 31) != 0) * bits_float(b & 0x7FFFFFFFu);
}

}  // namespace detail
}  // namespace fusetrain
