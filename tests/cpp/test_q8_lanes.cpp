// The block functions of csrc/cpu/q8_lanes.h (NOTE [q8 lanes]) against the
// scalar q8_load and q8_store of csrc/common/lean_state.h that the CUDA
// kernels use: the same floats for every code of both maps and every block
// length, the same codes for random values of every magnitude (values near a
// block's largest, in the linear range of each map, zeros of both signs) and
// for indices whose vector crosses a multiple of 2^32. Compiled with the CPU
// kernels' flags (CMakeLists.txt), so it checks the AVX2 forms where they are
// built.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "../../csrc/cpu/q8_lanes.h"

namespace {

using namespace fusetrain::detail;

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

TEST(Q8Lanes, DecodeIsTheScalarLoadForEveryCode) {
  std::vector<int8_t> codes(256 + 5);
  for (size_t c = 0; c < codes.size(); ++c) codes[c] = static_cast<int8_t>(static_cast<uint8_t>(c * 37 % 256));
  for (const float scale : {1.f, 0.375f, -1.f, -3.0e-20f, 7.5e12f, -0.f, 0.f}) {
    for (const int64_t n : {int64_t(1), int64_t(7), int64_t(8), int64_t(13), int64_t(64), int64_t(261)}) {
      std::vector<float> out(n);
      load_q8_block(codes.data(), scale, out.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const float want = q8_load(static_cast<uint8_t>(codes[i]), scale);
        ASSERT_TRUE(same_bits(out[i], want)) << scale << " " << n << " " << i << ": " << out[i] << " vs " << want;
      }
    }
  }
}

// Values of one block: random magnitudes over 40 binary orders below the
// largest, some in each map's linear range, zeros of both signs.
std::vector<float> block_values(int64_t n, bool signed_values, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> frac(0.5f, 1.f);
  std::uniform_int_distribution<int> exp(-40, 0);
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) {
    float x = std::ldexp(frac(gen), exp(gen));
    if (i % 11 == 3) x = std::ldexp(frac(gen), -20 - static_cast<int>(gen() % 20));
    if (i % 17 == 5) x = 0.f;
    if (signed_values && (gen() & 1u)) x = -x;
    v[i] = x;
  }
  if (n > 2) v[2] = signed_values ? -0.f : 0.f;
  v[0] = signed_values ? -1.25f : 1.25f;  // the block's largest magnitude
  return v;
}

TEST(Q8Lanes, EncodeIsTheScalarStore) {
  const int64_t firsts[] = {0, 5, 4096, (int64_t(1) << 32) - 8, (int64_t(1) << 32) - 3, (int64_t(3) << 32) + 1};
  const uint32_t key = rounding_key(9.f, 2, 1);
  for (const bool signed_values : {false, true}) {
    for (const int64_t n : {int64_t(1), int64_t(8), int64_t(13), int64_t(64), int64_t(256)}) {
      for (const int64_t first : firsts) {
        for (uint32_t seed = 0; seed < 8; ++seed) {
          const std::vector<float> v = block_values(n, signed_values, seed * 31 + static_cast<uint32_t>(n));
          float absmax = 0.f;
          for (float x : v) absmax = std::max(absmax, std::fabs(x));
          const Q8Block block = q8_block(absmax, signed_values, true);
          for (const int shift : {0, 16}) {  // NOTE [paired draws]: either half of a draw
            std::vector<int8_t> codes(n);
            store_q8_block<false>(v.data(), block, codes.data(), shift, nullptr, block, nullptr, n, key, first);
            for (int64_t i = 0; i < n; ++i) {
              const uint8_t want = q8_store(v[i], block, rounding_bits(key, first + i) >> shift);
              ASSERT_EQ(static_cast<uint8_t>(codes[i]), want)
                  << signed_values << " " << n << " " << first << " " << shift << " " << i << " " << v[i];
            }
          }
        }
      }
    }
  }
}

// Every 2^10th fp32 value (by its bits) from 2^-40 of the block's largest
// to the largest, and values of fp32's subnormal range: the ranges of both
// maps, their boundaries between the linear and the normal codes, and the
// roundings there (NOTE [q8 subnormals]).
std::vector<float> sweep_values(bool negative) {
  std::vector<float> v;
  const uint32_t lo = float_bits(std::ldexp(1.f, -40)), hi = float_bits(1.f);
  for (uint32_t b = lo; b <= hi; b += 1u << 10) {
    v.push_back(bits_float(b | (negative && (b >> 10) % 3 == 0 ? 0x80000000u : 0u)));
  }
  for (uint32_t b = 0; b < 4096; ++b) v.push_back(bits_float(b * 977u));  // fp32 subnormals and tiny normals
  v.push_back(1.f);
  return v;
}

TEST(Q8Lanes, EncodeIsTheScalarStoreOverBothMapsRanges) {
  for (const bool negative : {false, true}) {
    const std::vector<float> v = sweep_values(negative);
    const int64_t n = static_cast<int64_t>(v.size());
    for (const float absmax : {1.f, 0.75f, 3.0e-20f}) {
      std::vector<float> y(n);
      for (int64_t i = 0; i < n; ++i) y[i] = v[i] * absmax;
      const Q8Block block = q8_block(absmax, negative, true);
      for (const uint32_t key : {rounding_key(1.f, 0, 1), rounding_key(6.f, 3, 3)}) {
        std::vector<int8_t> codes(n);
        store_q8_block<false>(y.data(), block, codes.data(), 0, nullptr, block, nullptr, n, key, 0);
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(static_cast<uint8_t>(codes[i]), q8_store(y[i], block, rounding_bits(key, i)))
              << negative << " " << absmax << " " << i << " " << y[i];
        }
      }
    }
  }
}

#if defined(CPU_CAPABILITY_AVX2)
TEST(Q8Lanes, FlushFlagsLeaveTheCodesAndAreRestored) {
  // torch.set_flush_denormal(True) sets both flags: the lanes keep the
  // subnormals they work on (NOTE [q8 subnormals]) and leave the flags set.
  const unsigned before = _mm_getcsr();
  _mm_setcsr(before | 0x8040u);
  std::vector<int8_t> codes(256);
  for (size_t c = 0; c < codes.size(); ++c) codes[c] = static_cast<int8_t>(static_cast<uint8_t>(c));
  std::vector<float> out(codes.size());
  const unsigned flushing = _mm_getcsr();
  for (const float scale : {1.f, -1.f, 0.5f}) {
    load_q8_block(codes.data(), scale, out.data(), static_cast<int64_t>(codes.size()));
    ASSERT_EQ(_mm_getcsr(), flushing);
    _mm_setcsr(before);
    for (size_t c = 0; c < codes.size(); ++c) {
      const float want = q8_load(static_cast<uint8_t>(c), scale);  // computed without flushing
      ASSERT_TRUE(same_bits(out[c], want)) << scale << " " << c << ": " << out[c] << " vs " << want;
    }
    _mm_setcsr(flushing);
  }
  // The scalar reference runs without flushing, the lanes with the flags set.
  const std::vector<float> v = sweep_values(true);
  const int64_t n = static_cast<int64_t>(v.size());
  const Q8Block block = q8_block(1.f, true, true);
  const uint32_t key = rounding_key(2.f, 1, 1);
  std::vector<int8_t> got(n);
  store_q8_block<false>(v.data(), block, got.data(), 0, nullptr, block, nullptr, n, key, 0);
  ASSERT_EQ(_mm_getcsr(), flushing);
  _mm_setcsr(before);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(static_cast<uint8_t>(got[i]), q8_store(v[i], block, rounding_bits(key, i))) << i << " " << v[i];
  }
}
#endif

TEST(Q8Lanes, PairEncodesBothSlotsFromOneDraw) {
  // NOTE [paired draws]: slot a takes each draw's low half, slot b its high half.
  const uint32_t key = rounding_key(4.f, 7, 1);
  for (const int64_t n : {int64_t(5), int64_t(64), int64_t(200)}) {
    for (const int64_t first : {int64_t(0), int64_t(24), (int64_t(1) << 32) - 16}) {
      const std::vector<float> a = block_values(n, true, 3u + static_cast<uint32_t>(n));
      const std::vector<float> b = block_values(n, false, 5u + static_cast<uint32_t>(n));
      const Q8Block qa = q8_block(1.25f, true, true), qb = q8_block(1.25f, false, true);
      std::vector<int8_t> ca(n), cb(n);
      store_q8_block<true>(a.data(), qa, ca.data(), 0, b.data(), qb, cb.data(), n, key, first);
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t r = rounding_bits(key, first + i);
        ASSERT_EQ(static_cast<uint8_t>(ca[i]), q8_store(a[i], qa, r)) << n << " " << first << " " << i;
        ASSERT_EQ(static_cast<uint8_t>(cb[i]), q8_store(b[i], qb, r >> 16)) << n << " " << first << " " << i;
      }
    }
  }
}

TEST(Q8Lanes, ABlockStoredAsZerosKeepsNoCode) {
  // A block without a norm (all zero, non-finite, or below the smallest normal) writes code 0 for
  // every value, negative zeros and NaNs included, beside a partner that rounds as usual.
  const int64_t n = 37;
  const std::vector<float> a = block_values(n, true, 11u);
  std::vector<float> b(n, -0.f);
  b[3] = NAN;
  b[9] = -1e-39f;
  const uint32_t key = rounding_key(2.f, 1, 1);
  const Q8Block qa = q8_block(1.25f, true, true);
  for (const Q8Block qb : {q8_block(0.f, false, true), q8_block(1e-39f, true, true), q8_block(1.f, true, false)}) {
    ASSERT_EQ(qb.norm, 0.f);
    std::vector<int8_t> ca(n), cb(n, 1);
    store_q8_block<true>(a.data(), qa, ca.data(), 0, b.data(), qb, cb.data(), n, key, 0);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(cb[i], 0) << i;
      ASSERT_EQ(static_cast<uint8_t>(ca[i]), q8_store(a[i], qa, rounding_bits(key, i))) << i;
    }
  }
}

TEST(Q8Lanes, EncodeThenDecodeIsUnbiased) {
  // The codes of one value over many draws average to the value (NOTE
  // [8-bit state]'s stochastic rounding), in the normal and the linear range.
  const int64_t n = 4096;
  for (const float x : {0.3f, 1e-7f, 3e-10f}) {
    std::vector<float> v(n, x);
    v[0] = 1.f;
    std::vector<int8_t> codes(n);
    const Q8Block block = q8_block(1.f, false, true);
    store_q8_block<false>(v.data(), block, codes.data(), 16, nullptr, block, nullptr, n, rounding_key(1.f, 0, 2), 0);
    std::vector<float> back(n);
    load_q8_block(codes.data(), -1.f, back.data(), n);
    double sum = 0;
    for (int64_t i = 1; i < n; ++i) sum += back[i];
    EXPECT_NEAR(sum / (n - 1) / x, 1.0, 0.02) << x;
  }
}

}  // namespace
