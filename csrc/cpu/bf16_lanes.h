// bfloat16 values widened to float, and floats rounded back to bfloat16
// stochastically with the draws of NOTE [lean state], for the CPU update
// kernel. Internal header.
//
// NOTE [bf16 lanes]: a lean update on the CPU is bound by arithmetic, not
// memory: the draws and the roundings cost more than the bytes they save.
// The update's vector loop widens the bfloat16 state and grads as it loads
// them and writes its results to a block buffer in L1; a second pass over
// the block rounds them back with AVX2 forms of rounding_bits and
// stochastic_bf16_bits (the same bits lane for lane; the draws in a pass of
// their own, NOTE [draw pass]), which move 16-bit halves with byte shuffles
// rather than shifts and packs. Rounding inside the update's loop instead
// lengthens each iteration's dependency chain behind the square root and
// the division and leaves too few vector registers for the constants, which
// the compiler then rebuilds in every iteration (twice the instructions a
// vector): with the pass, an AdamW step with bfloat16 moments takes
// 0.67-0.80 of the time (AMD EPYC, 1 thread). A bfloat16 param joined with
// its remainder inside the loop instead of in a pass of its own measures no
// faster. The tail past the last whole vector takes the scalar functions.
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
  // High: whether the indices' high word is not zero (its term is added).
  template <bool High = true>
  __m256i next() {
    const __m256i keyed = _mm256_xor_si256(index_, key_);
    const __m256i r = mix32_lanes(High ? _mm256_add_epi32(keyed, high_) : keyed);
    index_ = _mm256_add_epi32(index_, _mm256_set1_epi32(kLanes));
    return r;
  }

 private:
  __m256i key_, high_, index_;
};

// Per 128-bit half of a vector of 32-bit lanes: the bytes of their four low
// halves, then those of their four high halves.
inline __m256i halves_apart() {
  return _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,  //
                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
}

// All ones in the lanes whose float bits `b` are a NaN.
inline __m256i nan_lanes(__m256i b) {
  return _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
}

// stochastic_bf16_bits lane by lane with the random bits `r16` (each below
// 2^16), in the high half of each lane.
inline __m256i stochastic_lanes(__m256 x, __m256i r16) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i nan = nan_lanes(b);
  // An infinity takes the rounded branch: its low 16 bits are zero, and an
  // addition below 2^16 leaves its upper half as it is.
  return _mm256_blendv_epi8(_mm256_add_epi32(b, r16), _mm256_or_si256(b, _mm256_set1_epi32(0x00400000)), nan);
}

// Stores the eight high halves of `v`'s lanes at hi and, with Lo, the eight
// low halves at lo (byte shuffles; no shifts or lane crossings but one
// extraction).
template <bool Lo>
inline void store_halves(__m256i v, uint16_t* lo, uint16_t* hi) {
  const __m256i s = _mm256_shuffle_epi8(v, halves_apart());
  const __m128i first = _mm256_castsi256_si128(s), second = _mm256_extracti128_si256(s, 1);
  if constexpr (Lo) _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm_unpacklo_epi64(first, second));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm_unpackhi_epi64(first, second));
}
#endif

// NOTE [draw pass]: the draws of a run of elements are hashed in a pass of
// their own into a buffer in L1, and the roundings read them from it. A hash
// is a chain of dependent operations (two 32-bit multiplies among them);
// inside the rounding loop its chain and the rounding's constants leave the
// out-of-order core too few registers and scheduler entries to overlap the
// iterations, while the hash alone keeps its constants and the lanes'
// indices in registers and its iterations overlap.
constexpr int64_t kDrawRun = 256;

// rounding_bits(key, first + j) into out[j] for j < n (n <= kDrawRun): AVX2
// lanes for the whole vectors of a run whose indices share a high word, the
// scalar function for the rest (the same bits).
inline void fill_draws(uint32_t key, int64_t first, int64_t n, uint32_t* out) {
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if (one_high_word(first, n)) {
    DrawLanes draws(key, first);
    if (rounding_high_term(first) == 0) {  // tensors below 2^32 elements
      for (; j + kLanes <= n; j += kLanes) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), draws.next<false>());
      }
    } else {
      for (; j + kLanes <= n; j += kLanes) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), draws.next());
    }
  }
#endif
  for (; j < n; ++j) out[j] = rounding_bits(key, first + j);
}

// The `n` values at a and b rounded stochastically into da and db from one
// draw of the stream `key` per element, from element `first` on (NOTE
// [paired draws]): `a` takes its low half, `b` its high half. A and B say
// which of them exist. Whole vectors take the AVX2 lanes, the tail the
// scalar function (the same bits).
template <bool A, bool B>
inline void store_bf16_pair_block(const float* a, at::BFloat16* da, const float* b, at::BFloat16* db, int64_t n,
                                  uint32_t key, int64_t first) {
  static_assert(A || B, "store_bf16_pair_block needs values to store");
  alignas(32) uint32_t rnd[kDrawRun];
  for (int64_t o = 0; o < n; o += kDrawRun) {
    const int64_t m = n - o < kDrawRun ? n - o : kDrawRun;
    fill_draws(key, first + o, m, rnd);
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
    for (; i + kLanes <= m; i += kLanes) {
      const __m256i r = _mm256_load_si256(reinterpret_cast<const __m256i*>(rnd + i));
      const int64_t e = o + i;
      // The rounded bits are each lane's high half; a pair puts slot a's in
      // the low halves and b's in the high halves of one vector.
      if constexpr (A && B) {
        const __m256i va = stochastic_lanes(_mm256_loadu_ps(a + e), _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF)));
        const __m256i vb = stochastic_lanes(_mm256_loadu_ps(b + e), _mm256_srli_epi32(r, 16));
        store_halves<true>(_mm256_blend_epi16(_mm256_srli_epi32(va, 16), vb, 0xAA), &da[e].x, &db[e].x);
      } else if constexpr (A) {
        const __m256i va = stochastic_lanes(_mm256_loadu_ps(a + e), _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF)));
        store_halves<false>(va, nullptr, &da[e].x);
      } else {
        store_halves<false>(stochastic_lanes(_mm256_loadu_ps(b + e), _mm256_srli_epi32(r, 16)), nullptr, &db[e].x);
      }
    }
#endif
    for (; i < m; ++i) {
      if constexpr (A) da[o + i].x = stochastic_bf16_bits(a[o + i], rnd[i]);
      if constexpr (B) db[o + i].x = stochastic_bf16_bits(b[o + i], rnd[i] >> 16);
    }
  }
}

}  // namespace detail
}  // namespace fusetrain
