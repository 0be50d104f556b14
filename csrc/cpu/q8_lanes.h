// Eight codes of an 8-bit state (NOTE [8-bit state]) decoded to floats, and
// eight floats encoded to codes with the draws of NOTE [lean state], for the
// CPU update kernel. Internal header.
//
// NOTE [q8 lanes]: the 8-bit moments are decoded before the vector loop and
// encoded after it, block by block (a block's scale needs its largest
// magnitude first). Both directions are a few integer operations on the fp32
// bits (NOTE [q8 subnormals]), which AVX2 does eight lanes at a time,
// instead of a table lookup per element; the encode normalises, takes the
// draws (NOTE [draw pass]; one draw for the first two slots), encodes and
// packs the eight codes into bytes in registers (the two slots' codes
// together). Lanes give the same bits as the scalar functions, which the
// tails and the CUDA kernels use. Decoding inside the update's loop is no
// faster (AdamW, 1 thread of an AMD EPYC), and decoding there with
// gathering each block's largest magnitude was slower (about 1.15x the
// step): that loop is bound by issuing its instructions and by the square
// root and the division, and the constants leave it too few vector
// registers.
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
// NOTE [q8 subnormals]: a map's codes are the fp32 bits, shifted right by
// kQ8Shift, of its normalised values scaled down by 2^-(bias / 8), which
// takes the map's smallest normal value (2^-30 or 2^-14) to fp32's (2^-126):
// below it, fp32's subnormals have the map's linear step (2^-149 * 2^20 is
// 2^-129 = 2^-33 * 2^-96 = 2^-17 * 2^-112). The scaling multiply rounds a
// value in the linear range to nearest even on the subnormal grid, as
// q8_encode's |x| + low rounds it, so a code is one add of the random bits
// and one shift, and a decode one shift and a multiply by the inverse
// power of two, with no blend between the ranges: the same bits as
// q8_encode and q8_decode while subnormals are kept. The lanes keep them
// (KeepSubnormals) where torch.set_flush_denormal(True) has set the flush
// flags of the thread.
class KeepSubnormals {
 public:
  KeepSubnormals() : csr_(_mm_getcsr()) {
    if ((csr_ & kFlush) != 0) _mm_setcsr(csr_ & ~kFlush);
  }
  ~KeepSubnormals() {
    if ((csr_ & kFlush) != 0) _mm_setcsr(csr_);
  }
  KeepSubnormals(const KeepSubnormals&) = delete;
  KeepSubnormals& operator=(const KeepSubnormals&) = delete;

 private:
  static constexpr unsigned kFlush = 0x8040u;  // flush to zero (bit 15), denormals are zero (bit 6)
  unsigned csr_;
};

// The power of two that scales a map's normalised values to its codes'
// fp32 bits (NOTE [q8 subnormals]): 2^-96 or 2^-112.
inline float q8_code_scale(const Q8Map& map) { return bits_float(static_cast<uint32_t>(127 - map.bias / 8) << 23); }

// q8_decode of the 8 codes at src lane by lane, times `mag` (NOTE [q8
// subnormals]; a signed map's code, sign-extended and shifted, keeps its
// sign in bit 31 once the bits above the value's are cleared).
inline __m256 q8_decode_lanes(const int8_t* src, bool unsigned_map, __m256 mag) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  __m256i bits;
  if (unsigned_map) {
    bits = _mm256_slli_epi32(_mm256_cvtepu8_epi32(bytes), kQ8Shift);
  } else {
    bits = _mm256_and_si256(_mm256_slli_epi32(_mm256_cvtepi8_epi32(bytes), kQ8Shift),
                            _mm256_set1_epi32(static_cast<int32_t>(0x87F00000u)));
  }
  const float up = 1.f / q8_code_scale(q8_map(unsigned_map));  // a power of two: exact
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(up)), mag);
}

// q8_encode of 8 normalised values lane by lane, already scaled by
// q8_code_scale (NOTE [q8 subnormals]), the 16 random bits of each in bits
// 4..19 of `r4` (the top of the 20 bits below a code's): the codes as
// int32. Signed: whether the map has a sign bit.
template <bool Signed>
inline __m256i q8_encode_lanes(__m256 scaled, __m256i r4, const Q8Map& map) {
  const __m256i b = _mm256_castps_si256(scaled);
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));  // an unsigned map's -0 too
  const __m256i code = _mm256_min_epi32(_mm256_srli_epi32(_mm256_add_epi32(mag, r4), kQ8Shift),
                                        _mm256_set1_epi32(map.top));
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
  const KeepSubnormals keep;
  const __m256 vmag = _mm256_set1_ps(mag);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, q8_decode_lanes(src + i, unsigned_map, vmag));
#endif
  for (; i < n; ++i) dst[i] = q8_decode(static_cast<uint8_t>(src[i]), unsigned_map) * mag;
}

// The codes of the `n` values at a (one block, stored as `qa`), rounded
// with the draws of element `first` on of the stream `key` shifted right by
// `shift`, 0 or 16 (q8_store of each); with Pair, also those of b (stored
// as `qb`) with the draws' high halves (NOTE [paired draws]: one draw for
// both). The draws come from a pass of their own (NOTE [draw pass]).
template <bool Pair>
inline void store_q8_block(const float* a, const Q8Block& qa, int8_t* da, int shift, const float* b,
                           const Q8Block& qb, int8_t* db, int64_t n, uint32_t key, int64_t first) {
  alignas(32) uint32_t rnd[kDrawRun];
#if defined(CPU_CAPABILITY_AVX2)
  const KeepSubnormals keep;
#endif
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
      const __m256 ka = _mm256_set1_ps(q8_code_scale(ma)), kb = _mm256_set1_ps(q8_code_scale(mb));
      const bool high = shift != 0;  // the draws' high half (shift 16)
      const __m256i bits = _mm256_set1_epi32(0xFFFF0);
      int64_t i = 0;
      for (; i + 8 <= m; i += 8) {
        const int64_t e = o + i;
        const __m256i r = _mm256_load_si256(reinterpret_cast<const __m256i*>(rnd + i));
        const __m256i ra = _mm256_and_si256(high ? _mm256_srli_epi32(r, 12) : _mm256_slli_epi32(r, 4), bits);
        const __m256i ca = q8_encode_lanes<SA>(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(a + e), na), ka), ra, ma);
        if constexpr (Pair) {
          const __m256i rb = _mm256_and_si256(_mm256_srli_epi32(r, 12), bits);
          const __m256i cb = q8_encode_lanes<SB>(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(b + e), nb), kb), rb, mb);
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
  if (n <= 0) return;
  if (qa.norm == 0.f) std::memset(da, 0, static_cast<size_t>(n));
  if (Pair && qb.norm == 0.f) std::memset(db, 0, static_cast<size_t>(n));
}

}  // namespace detail
}  // namespace fusetrain
