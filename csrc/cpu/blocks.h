// Blocks of elements between a tensor's storage and the buffers the CPU
// kernels compute in, shared by them. Internal header.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../common/lean_state.h"
#include "bf16_lanes.h"

namespace fusetrain {
namespace detail {

// n values converted from S to D (copied when they are the same type).
template <typename S, typename D>
inline void convert_block(const S* src, D* dst, int64_t n) {
  if constexpr (std::is_same_v<S, D>) {
    std::memcpy(dst, src, n * sizeof(S));
  } else {
    at::vec::convert(src, dst, n);
  }
}

// n values of a tensor as float: a bfloat16 one joined with its int16
// remainders when `rem` is given (NOTE [lean state]), else converted. The
// remainder forms take AVX2 lanes where the kernels are built for them (the
// same bits as the scalar functions, which take the tail).
template <typename P>
inline void load_block(const P* src, const int16_t* rem, float* dst, int64_t n) {
  if constexpr (std::is_same_v<P, at::BFloat16>) {
    if (rem != nullptr) {
      int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
      // join_remainder lane by lane: interleaving the param's bits with
      // r ^ 0x8000 (= r + 0x8000 in the low half) gives (p << 16) + r + 0x8000.
      const __m128i flip = _mm_set1_epi16(static_cast<int16_t>(0x8000));
      for (; i + 8 <= n; i += 8) {
        const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
        const __m128i lo = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rem + i)), flip);
        const __m256i w = _mm256_set_m128i(_mm_unpackhi_epi16(lo, hi), _mm_unpacklo_epi16(lo, hi));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_sub_epi32(w, _mm256_set1_epi32(0x8000)));
      }
#endif
      for (; i < n; ++i) dst[i] = join_remainder(src[i].x, rem[i]);
      return;
    }
  }
  convert_block(src, dst, n);
}

// The reverse of load_block: split into the bfloat16 value and its remainder,
// or converted (rounded to nearest even).
template <typename P>
inline void store_block(const float* src, P* dst, int16_t* rem, int64_t n) {
  if constexpr (std::is_same_v<P, at::BFloat16>) {
    if (rem != nullptr) {
      int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
      // split_remainder lane by lane: with r in [-0x8000, 0x7FFF], the low
      // half of b + 0x8000 is r + 0x8000, so t = (b + 0x8000) ^ 0x8000 holds
      // the param's bits in its high half and the remainder in its low half
      // (a NaN: its quiet bits and 0).
      const __m256i bias = _mm256_set1_epi32(0x8000);
      for (; i + 8 <= n; i += 8) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
        const __m256i nan = nan_lanes(b);
        const __m256i t = _mm256_xor_si256(_mm256_add_epi32(b, bias), bias);
        const __m256i quiet = _mm256_and_si256(_mm256_or_si256(b, _mm256_set1_epi32(0x00400000)),
                                               _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
        store_halves<true>(_mm256_blendv_epi8(t, quiet, nan), reinterpret_cast<uint16_t*>(rem + i), &dst[i].x);
      }
#endif
      for (; i < n; ++i) split_remainder(src[i], dst[i].x, rem[i]);
      return;
    }
  }
  convert_block(src, dst, n);
}

}  // namespace detail
}  // namespace fusetrain
