// The vector forms of csrc/cpu/bf16_lanes.h (NOTE [bf16 lanes]) and of the
// remainder blocks of csrc/cpu/blocks.h against the
// scalar functions of csrc/common/lean_state.h that the CUDA kernels and the
// tails use: the same bits for every lane, every block length, the values
// whose rounding is special (NaN payloads, infinities, the largest finite
// value) and indices whose block crosses a multiple of 2^32. Compiled with
// the CPU kernels' flags (CMakeLists.txt), so it checks the AVX2 forms where
// they are built.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "../../csrc/cpu/bf16_lanes.h"
#include "../../csrc/cpu/blocks.h"

namespace {

using namespace fusetrain::detail;

float from_bits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

// Random floats of every magnitude, with the special values between them.
std::vector<float> values(int n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<float> v(n);
  for (float& x : v) x = from_bits(gen());
  const float special[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                           from_bits(0x7F800001u), from_bits(0xFFC00000u), from_bits(0x7FFFFFFFu),
                           from_bits(0x7F80FFFFu), std::numeric_limits<float>::max(),
                           -std::numeric_limits<float>::max(), 0.f, -0.f, from_bits(0x0000FFFFu), 1.f};
  for (size_t i = 0; i < sizeof(special) / sizeof(float) && 5 * i < v.size(); ++i) v[5 * i] = special[i];
  return v;
}

TEST(Bf16Lanes, LoadWidensEveryLength) {
  std::vector<at::BFloat16> src(kLanes);
  const std::vector<float> v = values(kLanes, 1);
  for (int j = 0; j < kLanes; ++j) src[j].x = static_cast<uint16_t>(std::hash<float>{}(v[j]));
  for (int c = 1; c <= kLanes; ++c) {
    alignas(64) float out[kLanes];
    load_bf16_lanes(src.data(), c).store(out, c);
    for (int j = 0; j < c; ++j) {
      const float want = static_cast<float>(src[j]);
      EXPECT_EQ(std::memcmp(&out[j], &want, sizeof(float)), 0) << c << " " << j;
    }
  }
}

TEST(Bf16Lanes, PairedBlockStoresAreTheScalarRoundings) {
  // Every length up to three vectors and a tail, from indices whose run
  // stays below, ends at or crosses a multiple of 2^32.
  const int64_t firsts[] = {0, 7, 12345, (int64_t(1) << 32) - 3 * kLanes - 3, (int64_t(1) << 32) - kLanes,
                            (int64_t(1) << 32) - 3, (int64_t(1) << 32) + 1, (int64_t(5) << 33) - 1};
  const uint32_t key = rounding_key(17.f, 3, 1);
  constexpr int kMax = 3 * kLanes + 3;
  for (int64_t first : firsts) {
    for (int n = 1; n <= kMax; ++n) {
      for (uint32_t seed = 0; seed < 16; ++seed) {
        const std::vector<float> a = values(kMax, 2 * seed + 11), b = values(kMax, 2 * seed + 12);
        at::BFloat16 da[kMax], db[kMax], only_a[kMax], only_b[kMax];
        store_bf16_pair_block<true, true>(a.data(), da, b.data(), db, n, key, first);
        store_bf16_pair_block<true, false>(a.data(), only_a, nullptr, nullptr, n, key, first);
        store_bf16_pair_block<false, true>(nullptr, nullptr, b.data(), only_b, n, key, first);
        for (int j = 0; j < n; ++j) {
          const uint32_t r = rounding_bits(key, first + j);
          const uint16_t want_a = stochastic_bf16_bits(a[j], r), want_b = stochastic_bf16_bits(b[j], r >> 16);
          ASSERT_EQ(da[j].x, want_a) << first << " " << n << " " << j << " " << a[j];
          ASSERT_EQ(db[j].x, want_b) << first << " " << n << " " << j << " " << b[j];
          ASSERT_EQ(only_a[j].x, want_a);
          ASSERT_EQ(only_b[j].x, want_b);
        }
      }
    }
  }
}

TEST(Bf16Lanes, PairedStoresLongerThanADrawRunAreTheScalarRoundings) {
  // NOTE [draw pass]: a block longer than kDrawRun hashes its draws run by run.
  const uint32_t key = rounding_key(5.f, 1, 1);
  for (const int64_t n : {kDrawRun + 1, 2 * kDrawRun, 2 * kDrawRun + 13}) {
    for (const int64_t first : {int64_t(0), int64_t(100), (int64_t(1) << 32) - kDrawRun - 5}) {
      const std::vector<float> a = values(static_cast<int>(n), 41), b = values(static_cast<int>(n), 42);
      std::vector<at::BFloat16> da(n), db(n);
      store_bf16_pair_block<true, true>(a.data(), da.data(), b.data(), db.data(), n, key, first);
      for (int64_t j = 0; j < n; ++j) {
        const uint32_t r = rounding_bits(key, first + j);
        ASSERT_EQ(da[j].x, stochastic_bf16_bits(a[j], r)) << n << " " << first << " " << j;
        ASSERT_EQ(db[j].x, stochastic_bf16_bits(b[j], r >> 16)) << n << " " << first << " " << j;
      }
    }
  }
}

TEST(Bf16Lanes, SpecialValuesRoundAsTheScalarForm) {
  // With every draw: a NaN stays a quiet NaN of the same sign, an infinity
  // stays infinite, the largest finite value rounds up to infinity or down.
  const float inf = std::numeric_limits<float>::infinity();
  const float x[kLanes] = {inf, -inf, from_bits(0x7F800001u), from_bits(0xFF800001u),
                           std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(), 0.f, -0.f};
  for (int64_t first = 0; first < 4096; first += kLanes) {
    at::BFloat16 d[kLanes];
    store_bf16_pair_block<true, false>(x, d, nullptr, nullptr, kLanes, 99u, first);
    for (int j = 0; j < kLanes; ++j) ASSERT_EQ(d[j].x, stochastic_bf16_bits(x[j], rounding_bits(99u, first + j)));
    EXPECT_TRUE(std::isinf(static_cast<float>(d[0])) && std::isinf(static_cast<float>(d[1])));
    EXPECT_TRUE(std::isnan(static_cast<float>(d[2])) && std::isnan(static_cast<float>(d[3])));
    EXPECT_EQ(d[3].x & 0x8000u, 0x8000u);
  }
}

TEST(Bf16Lanes, RemainderBlocksAreTheScalarSplitAndJoin) {
  // Every length up to three vectors and a tail, random bits of every kind
  // (NaN payloads of both signs among them) and the special values.
  std::mt19937 gen(7);
  for (int n = 0; n <= 3 * kLanes + 3; ++n) {
    std::vector<float> v = values(n, 10 + n);
    for (int j = 0; j < n; j += 3) v[j] = from_bits(gen() | 0x7F800001u);  // NaN, either sign
    std::vector<at::BFloat16> p(n);
    std::vector<int16_t> rem(n);
    store_block(v.data(), p.data(), rem.data(), n);
    std::vector<float> back(n);
    load_block(p.data(), rem.data(), back.data(), n);
    for (int j = 0; j < n; ++j) {
      uint16_t want_p;
      int16_t want_r;
      split_remainder(v[j], want_p, want_r);
      ASSERT_EQ(p[j].x, want_p) << n << " " << j;
      ASSERT_EQ(rem[j], want_r) << n << " " << j;
      const float want = join_remainder(want_p, want_r);
      ASSERT_EQ(std::memcmp(&back[j], &want, sizeof(float)), 0) << n << " " << j;
    }
  }
}

}  // namespace
