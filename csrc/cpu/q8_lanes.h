// Eight codes of an 8-bit state (NOTE [8-bit state]) decoded to floats, and
// eight floats encoded to codes with the draws of NOTE [lean state], for the
// CPU update kernel. Internal header.
//
// NOTE [q8 lanes]: the 8-bit moments are decoded before the vector loop and
// encoded after it, block by block (a block's scale needs its largest
// magnitude first). Both directions are integer operations on the fp32 bits
// (q8_decode, q8_encode), which AVX2 does eight lanes at a time: the decode
// computes both of a map's forms and picks one per lane, instead of a table
// lookup per element; the encode normalises, takes the draws (NOTE [draw
// pass]; one draw for the first two slots), encodes and packs the eight
// codes into bytes in registers (the two slots' codes together). Lanes give the same bits as the scalar functions, which the
// tails and the CUDA kernels use. Decoding inside the update's loop, and
// gathering each block's largest magnitude there, is slower (AdamW, 1
// thread of an AMD EPYC: about 1.15x the step): that loop is bound by the
// square root and the division, and the decoding's constants leave it too
// few vector registers.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "../common/lean_state.h"
#include "bf16_lanes.h"

namespace fusetrain {
namespace detail {

#if defined(CPU_CAPABILITY_AVX2)
// q8_decode of the 8 codes at src lane by lane, times `mag`.
inline __m256 q8_decode_lanes(const int8_t* src, bool unsigned_map, __m256 mag) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  const Q8Map map = q8_map(unsigned_map);
  const __m256i m = unsigned_map ? c : _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256 normal =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(m, _mm256_set1_epi32(map.bias)), kQ8Shift));
  // The linear step is a power of two: 1 / map.linear is exact.
  const __m256 linear = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(1.f / map.linear));
  const __m256i is_linear = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), m);
  __m256 v = _mm256_blendv_ps(normal, linear, _mm256_castsi256_ps(is_linear));
  if (!unsigned_map) {
    v = _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24)));
  }
  return _mm256_mul_ps(v, mag);
}

// q8_encode of 8 normalised values lane by lane, the 16 random bits of each
// in bits 4..19 of `r4` (the top of the 20 bits below a code's): the codes
// as int32. Signed: whether the map has a sign bit.
template <bool Signed>
inline __m256i q8_encode_lanes(__m256 x, __m256i r4, const Q8Map& map) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i mag = Signed ? _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF)) : b;
  const __m256i low = _mm256_set1_epi32(static_cast<int32_t>(map.low));
  const __m256i linear = _mm256_cmpgt_epi32(low, mag);
  const __m256i up = _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(mag), _mm256_castsi256_ps(low)));
  const __m256i z = _mm256_blendv_epi8(mag, up, linear);
  const __m256i off = _mm256_add_epi32(_mm256_set1_epi32(map.bias), _mm256_and_si256(linear, _mm256_set1_epi32(8)));
  const __m256i shifted = _mm256_srli_epi32(_mm256_add_epi32(z, r4), kQ8Shift);
  const __m256i code = _mm256_min_epi32(_mm256_sub_epi32(shifted, off), _mm256_set1_epi32(map.top));
  if constexpr (!Signed) return code;
  return _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(b, 24), _mm256_set1_epi32(0x80)));
}

// Stores the low bytes of 8 int32 codes (each in 0..255) at dst.
inline void store_code_bytes(__m256i codes, int8_t* dst) {
  const __m256i words = _mm256_packs_epi32(codes, codes);     // per 128-bit half: c0..c3 twice
  const __m256i bytes = _mm256_packus_epi16(words, words);    // per half: c0..c3 four times
  const __m256i both = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(both));
}

// Stores the low bytes of two vectors of 8 int32 codes at da and db.
inline void store_code_byte_pair(__m256i a, __m256i b, int8_t* da, int8_t* db) {
  const __m256i words = _mm256_packs_epi32(a, b);            // per 128-bit half: a0..a3 b0..b3
  const __m256i bytes = _mm256_packus_epi16(words, words);   // per half: a0..a3 b0..b3 twice
  const __m128i both = _mm256_castsi256_si128(
      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5)));  // a0..a7 b0..b7
  _mm_storel_epi64(reinterpret_cast<__m128i*>(da), both);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(db), _mm_unpackhi_epi64(both, both));
}
#endif

// The values of the `n` codes at src (one block, whose stored scale is
// `scale`: q8_load of each).
inline void load_q8_block(const int8_t* src, float scale, float* dst, int64_t n) {
  const uint32_t bits = float_bits(scale);
  const bool unsigned_map = (bits >> 31) != 0;
  const float mag = bits_float(bits & 0x7FFFFFFFu);
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
  const __m256 vmag = _mm256_set1_ps(mag);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, q8_decode_lanes(src + i, unsigned_map, vmag));
#endif
  for (; i < n; ++i) dst[i] = q8_decode(static_cast<uint8_t>(src[i]), unsigned_map) * mag;
}

// The codes of the `n` values at a (one block, stored as `qa`), rounded
// with the draws of element `first` on of the stream `key` shifted right by
// `shift` (q8_store of each); with Pair, also those of b (stored as `qb`)
// with the draws' high halves (NOTE [paired draws]: one draw for both). The
// draws come from a pass of their own (NOTE [draw pass]).
template <bool Pair>
inline void store_q8_block(const float* a, const Q8Block& qa, int8_t* da, int shift, const float* b,
                           const Q8Block& qb, int8_t* db, int64_t n, uint32_t key, int64_t first) {
  alignas(32) uint32_t rnd[kDrawRun];
  for (int64_t o = 0; o < n; o += kDrawRun) {
    const int64_t m = n - o < kDrawRun ? n - o : kDrawRun;
    fill_draws(key, first + o, m, rnd);
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
    // The vector loop for the blocks' maps (whether each has a sign bit): the
    // elements it stored.
    const auto lanes = [a, b, da, db, o, m, shift, &qa, &qb, &rnd](auto signed_a, auto signed_b) {
      constexpr bool SA = decltype(signed_a)::value, SB = decltype(signed_b)::value;
      const Q8Map ma = q8_map(!SA), mb = q8_map(!SB);
      const __m256 na = _mm256_set1_ps(qa.norm), nb = _mm256_set1_ps(qb.norm);
      const __m128i vshift = _mm_cvtsi32_si128(shift);
      const __m256i bits = _mm256_set1_epi32(0xFFFF0);
      int64_t i = 0;
      for (; i + 8 <= m; i += 8) {
        const int64_t e = o + i;
        const __m256i r = _mm256_load_si256(reinterpret_cast<const __m256i*>(rnd + i));
        const __m256i ra = _mm256_and_si256(_mm256_slli_epi32(_mm256_srl_epi32(r, vshift), 4), bits);
        const __m256i ca = q8_encode_lanes<SA>(_mm256_mul_ps(_mm256_loadu_ps(a + e), na), ra, ma);
        if constexpr (Pair) {
          const __m256i rb = _mm256_and_si256(_mm256_srli_epi32(r, 12), bits);
          const __m256i cb = q8_encode_lanes<SB>(_mm256_mul_ps(_mm256_loadu_ps(b + e), nb), rb, mb);
          store_code_byte_pair(ca, cb, da + e, db + e);
        } else {
          store_code_bytes(ca, da + e);
        }
      }
      return i;
    };
    using Yes = std::true_type;
    using No = std::false_type;
    const bool sb = Pair && !qb.unsigned_map;
    if (qa.unsigned_map) {
      i = sb ? lanes(No{}, Yes{}) : lanes(No{}, No{});
    } else {
      i = sb ? lanes(Yes{}, Yes{}) : lanes(Yes{}, No{});
    }
#endif
    for (; i < m; ++i) {
      da[o + i] = static_cast<int8_t>(q8_store(a[o + i], qa, rnd[i] >> shift));
      if constexpr (Pair) db[o + i] = static_cast<int8_t>(q8_store(b[o + i], qb, rnd[i] >> 16));
    }
  }
  // A block stored as zeros (norm 0) keeps no code (q8_store).
  if (qa.norm == 0.f) std::memset(da, 0, n);
  if (Pair && qb.norm == 0.f) std::memset(db, 0, n);
}

}  // namespace detail
}  // namespace fusetrain
