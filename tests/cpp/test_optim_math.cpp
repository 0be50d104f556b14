// The scalar helpers of csrc/common/device_math.h: the CUDA kernels use them
// (the CPU kernels use the Vectorized overloads), so they are checked here,
// on any machine, against std:: references.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "../../csrc/common/device_math.h"

namespace {

using fusetrain::detail::vmax;
using fusetrain::detail::vsign;

template <typename T>
void check_vmax() {
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const T vals[] = {T(-2.5), T(0), T(1e-30), T(3), std::numeric_limits<T>::infinity()};
  for (T a : vals) {
    for (T b : vals) {
      EXPECT_EQ(vmax(a, b), std::fmax(a, b)) << a << " " << b;
    }
    // NaN wins from either side, as torch.maximum (amsgrad's max of the second moments).
    EXPECT_TRUE(std::isnan(vmax(a, nan))) << a;
    EXPECT_TRUE(std::isnan(vmax(nan, a))) << a;
  }
}

TEST(OptimMath, VmaxIsTheLargerAndPropagatesNaN) {
  check_vmax<float>();
  check_vmax<double>();
}

TEST(OptimMath, VsignIsTheSign) {
  EXPECT_EQ(vsign(-3.f), -1.f);
  EXPECT_EQ(vsign(0.f), 0.f);
  EXPECT_EQ(vsign(2.0), 1.0);
}

}  // namespace
