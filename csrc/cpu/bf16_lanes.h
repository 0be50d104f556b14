// One vector of bfloat16 values widened to float, and rounded back to
// bfloat16 stochastically with the draws of NOTE [lean state], for the CPU
// update kernel's vector loop. Internal header.
//
// NOTE [bf16 lanes]: a lean update on the CPU is bound by arithmetic, not
// memory: the draws and the roundings cost more than the bytes they save.
// Widening the state in the vector loop and rounding it back there, with
// AVX2 forms of rounding_bits and stochastic_bf16_bits (the same bits lane
// for lane), keeps each value in registers between its load and its store.
// A vector that is not full, or whose indices cross a multiple of 2^32 (the
// index's high word would differ between lanes), takes the scalar functions.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/macros/Macros.h>
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
// Whether lanes first .. first + kLanes - 1 share the high word of their index.
inline bool one_high_word(int64_t first) {
  return static_cast<uint32_t>(first) <= 0xFFFFFFFFu - (kLanes - 1);
}

// mix32 lane by lane.
inline __m256i mix32_lanes(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// rounding_bits(key, first + j) in lane j (one_high_word(first) holds).
inline __m256i rounding_bits_lanes(uint32_t key, int64_t first) {
  const uint32_t lo = static_cast<uint32_t>(first);
  const uint32_t hi = static_cast<uint32_t>(static_cast<uint64_t>(first) >> 32);
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(lo)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i x = _mm256_xor_si256(idx, _mm256_set1_epi32(static_cast<int32_t>(key)));
  return mix32_lanes(_mm256_add_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(hi * 0x27D4EB2Fu))));
}

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

// store_bf16_pair of a vector that is not full or whose indices cross a
// multiple of 2^32: the scalar functions, lane by lane (out of line: the
// vector loop's calls stay small enough to inline).
template <bool A, bool B>
C10_NOINLINE void store_bf16_pair_scalar(VecF a, at::BFloat16* da, VecF b, at::BFloat16* db, int c, uint32_t key,
                                         int64_t first) {
  alignas(64) float ta[kLanes];
  alignas(64) float tb[kLanes];
  if constexpr (A) a.store(ta, c);
  if constexpr (B) b.store(tb, c);
  for (int j = 0; j < c; ++j) {
    const uint32_t r = rounding_bits(key, first + j);
    if constexpr (A) da[j].x = stochastic_bf16_bits(ta[j], r);
    if constexpr (B) db[j].x = stochastic_bf16_bits(tb[j], r >> 16);
  }
}

// The first `c` lanes of `a` and `b` rounded stochastically into `da` and
// `db` from one draw of the stream `key` per lane (NOTE [paired draws]): `a`
// takes its low half, `b` its high half. A and B say which of them exist.
template <bool A, bool B>
C10_ALWAYS_INLINE void store_bf16_pair(VecF a, at::BFloat16* da, VecF b, at::BFloat16* db, int c, uint32_t key,
                                       int64_t first) {
  static_assert(A || B, "store_bf16_pair needs a value to store");
#if defined(CPU_CAPABILITY_AVX2)
  if (C10_LIKELY(c == kLanes && one_high_word(first))) {
    const __m256i r = rounding_bits_lanes(key, first);
    if constexpr (A) store_stochastic_lanes(a, r, da);
    if constexpr (B) store_stochastic_lanes(b, _mm256_srli_epi32(r, 16), db);
    return;
  }
#endif
  store_bf16_pair_scalar<A, B>(a, da, b, db, c, key, first);
}

// The first `c` lanes of `a` rounded stochastically with the low half of the
// stream `key`'s draws.
C10_ALWAYS_INLINE void store_bf16(VecF a, at::BFloat16* da, int c, uint32_t key, int64_t first) {
  store_bf16_pair<true, false>(a, da, a, nullptr, c, key, first);
}

}  // namespace detail
}  // namespace fusetrain
