// The element helpers every kernel's math uses, for the CPU and CUDA kernels:
// FT_HD (host and device), the square root, NaN-propagating maximum and sign
// of a value V (`float`/`double` here; the CPU kernels declare the
// at::vec::Vectorized overloads before including this), the fused
// multiply-add where torch fuses, a product rounded on its own, and torch's
// lerp.
#pragma once

#include <cmath>
#include <type_traits>

#if defined(__CUDACC__)
#define FT_HD __host__ __device__ __forceinline__
#else
#define FT_HD inline
#endif

namespace fusetrain {
namespace detail {

FT_HD float vsqrt(float x) { return ::sqrtf(x); }
FT_HD float vmax(float a, float b) { return (a > b || a != a) ? a : b; }  // NaN-propagating, as torch.maximum
FT_HD float vsign(float x) { return static_cast<float>((x > 0.f) - (x < 0.f)); }
FT_HD double vsqrt(double x) { return ::sqrt(x); }
FT_HD double vmax(double a, double b) { return (a > b || a != a) ? a : b; }
FT_HD double vsign(double x) { return static_cast<double>((x > 0.0) - (x < 0.0)); }
// a * b + c rounded once, where torch's kernels fuse it (its vectorized lerp,
// and `add` with an alpha): the CPU kernels fuse nothing else (NOTE [no
// contraction] in CMakeLists.txt).
// Vectorized arguments find at::vec::fmadd by argument-dependent lookup.
FT_HD float fmadd(float a, float b, float c) { return ::fmaf(a, b, c); }
FT_HD double fmadd(double a, double b, double c) { return ::fma(a, b, c); }

// NOTE [rounded decay]: the decoupled weight decay's product p * (1 - lr * wd)
// is rounded on its own, as torch's `param.mul_(1 - lr * wd)`. Left to nvcc,
// the product may fuse with the update's add into one FMA (or not, as the
// surrounding code changes); the difference of one rounding a step walks a few
// elements past float32 agreement with torch over hundreds of steps. The CPU
// kernels' products are rounded on their own (NOTE [no contraction] in
// CMakeLists.txt).
template <typename V>
FT_HD V mul_rn(V a, V b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<V, double>) {
    return __dmul_rn(a, b);
  } else {
    return __fmul_rn(a, b);
  }
#else
  return a * b;  // the CPU kernels' Vectorized products, rounded on their own
#endif
}

// torch.lerp's formula: exact at both ends, used for the first moment and
// EMA, with one rounding of the product and sum as torch's vectorized lerp.
template <typename V, typename T>
FT_HD V lerp_small_weight(V self, V end, T w) {
  // Every weight we pass is in [0, 0.5): 1 - beta1 and 1 - decay.
  return fmadd(V(w), end - self, self);
}
template <typename V, typename T>
FT_HD V lerp_weight(V self, V end, T w) {
  if (w < T(0.5)) return fmadd(V(w), end - self, self);
  return fmadd(V(w - T(1)), end - self, end);  // w - 1 is exact for w in [0.5, 1]
}

}  // namespace detail
}  // namespace fusetrain
