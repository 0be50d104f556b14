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
      for (; i + 8 <= n; i += 8) {
        const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
        const __m256i lo = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rem + i)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_add_epi32(_mm256_slli_epi32(hi, 16), lo));
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
      // split_remainder lane by lane; packing with saturation leaves the
      // halves as they are (bits in 0..0xFFFF, remainders in int16's range).
      for (; i + 8 <= n; i += 8) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
        const __m256i nan =
            _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
        const __m256i hi = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x8000)), 16);
        const __m256i r = _mm256_sub_epi32(b, _mm256_slli_epi32(hi, 16));
        const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
        const __m256i bits = _mm256_blendv_epi8(hi, quiet, nan);
        const __m256i rs = _mm256_andnot_si256(nan, r);
        const __m256i pb = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
        const __m256i pr = _mm256_permute4x64_epi64(_mm256_packs_epi32(rs, rs), 0x08);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(pb));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(rem + i), _mm256_castsi256_si128(pr));
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
