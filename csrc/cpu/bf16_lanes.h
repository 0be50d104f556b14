// bfloat16 values widened to float, and floats rounded back to bfloat16
// stochastically with the draws of NOTE [lean state], for the CPU update
// kernel. Internal header.
//
// NOTE [bf16 lanes]: a lean update on the CPU is bound by arithmetic, not
// memory: the draws and the roundings cost more than the bytes they save.
// The update's vector loop widens the bfloat16 state as it loads it and
// writes its results to a block buffer in L1; a second pass over the block
// rounds them back with AVX2 forms of rounding_bits and stochastic_bf16_bits
// (the same bits lane for lane), with the stream's key, the lanes' indices
// and the constants held in registers across the pass (DrawLanes). Rounding
// inside the update's loop instead lengthens each iteration's dependency
// chain behind the square root and the division and leaves too few vector
// registers for the constants, which the compiler then rebuilds in every
// iteration (twice the instructions a vector): with the pass, an AdamW step
// with bfloat16 moments takes 0.67-0.80 of the time (AMD EPYC, 1 thread).
// The other way, a bfloat16 param joined with its remainder (and bfloat16
// grads widened) inside the loop instead of in passes of their own, measures
// no faster in interleaved runs.
// A block whose indices cross a multiple of 2^32 (the high word of the
// index would differ between lanes) and the tail past the last whole vector
// take the scalar functions.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <cstdint>

#include "../common/lean_state.h"

namespace fusetrain {
namespace detail {

using VecF = at::vec::Vectorized<float>;
constexpr int kLanes = VecF::size();

// The first `c` values of src as floats.
inline VecF load_bf16_lanes(const at::BFloat16* src, int c) {
#if defined(CPU_CAPABILITY_AVX2)
  if (c == kLanes) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    return VecF(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
#endif
  alignas(64) float tmp[kLanes];
  for (int j = 0; j < c; ++j) tmp[j] = static_cast<float>(src[j]);
  return VecF::loadu(tmp, c);
}

#if defined(CPU_CAPABILITY_AVX2)
// Whether elements first .. first + n - 1 share the high word of their index.
inline bool one_high_word(int64_t first, int64_t n) {
  return n <= 0 || static_cast<uint32_t>(first) <= 0xFFFFFFFFu - static_cast<uint32_t>(n - 1);
}

// mix32 lane by lane.
inline __m256i mix32_lanes(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// The draws of consecutive vectors of a stream from element `first` on, for
// a run of elements that share the high word of their index (one_high_word):
// next() gives rounding_bits(key, i) in the lanes of the next eight indices.
class DrawLanes {
 public:
  DrawLanes(uint32_t key, int64_t first)
      : key_(_mm256_set1_epi32(static_cast<int32_t>(key))),
        high_(_mm256_set1_epi32(static_cast<int32_t>(rounding_high_term(first)))),
        index_(_mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(first)),
                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))) {}
  __m256i next() {
    const __m256i r = mix32_lanes(_mm256_add_epi32(_mm256_xor_si256(index_, key_), high_));
    index_ = _mm256_add_epi32(index_, _mm256_set1_epi32(kLanes));
    return r;
  }

 private:
  __m256i key_, high_, index_;
};

// stochastic_bf16_bits lane by lane (the low 16 bits of `rnd`), then stored.
inline void store_stochastic_lanes(__m256 x, __m256i rnd, at::BFloat16* dst) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7F800000));
  const __m256i rounded = _mm256_add_epi32(b, _mm256_and_si256(rnd, _mm256_set1_epi32(0xFFFF)));
  const __m256i quiet = _mm256_or_si256(b, _mm256_set1_epi32(0x00400000));
  // An infinity takes the rounded branch: its low 16 bits are zero, and an
  // addition below 2^16 leaves its upper half as it is.
  const __m256i bits = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}
#endif

// The `n` values at a and b rounded stochastically into da and db from one
// draw of the stream `key` per element, from element `first` on (NOTE
// [paired draws]): `a` takes its low half, `b` its high half. A and B say
// which of them exist. Whole vectors whose indices share a high word take
// the AVX2 lanes, the rest the scalar functions (the same bits).
template <bool A, bool B>
inline void store_bf16_pair_block(const float* a, at::BFloat16* da, const float* b, at::BFloat16* db, int64_t n,
                                  uint32_t key, int64_t first) {
  static_assert(A || B, "store_bf16_pair_block needs values to store");
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if (one_high_word(first, n)) {
    DrawLanes draws(key, first);
    for (; i + kLanes <= n; i += kLanes) {
      const __m256i r = draws.next();
      if constexpr (A) store_stochastic_lanes(_mm256_loadu_ps(a + i), r, da + i);
      if constexpr (B) store_stochastic_lanes(_mm256_loadu_ps(b + i), _mm256_srli_epi32(r, 16), db + i);
    }
  }
#endif
  for (; i < n; ++i) {
    const uint32_t r = rounding_bits(key, first + i);
    if constexpr (A) da[i].x = stochastic_bf16_bits(a[i], r);
    if constexpr (B) db[i].x = stochastic_bf16_bits(b[i], r >> 16);
  }
}

}  // namespace detail
}  // namespace fusetrain
