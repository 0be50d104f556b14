// Blocks of elements between a tensor's storage and the buffers the CPU
// kernels compute in, shared by them. Internal header.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

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
// remainders when `rem` is given (NOTE [lean state]), else converted.
template <typename P>
inline void load_block(const P* src, const int16_t* rem, float* dst, int64_t n) {
  if constexpr (std::is_same_v<P, at::BFloat16>) {
    if (rem != nullptr) {
      for (int64_t i = 0; i < n; ++i) dst[i] = join_remainder(src[i].x, rem[i]);
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
      for (int64_t i = 0; i < n; ++i) split_remainder(src[i], dst[i].x, rem[i]);
      return;
    }
  }
  convert_block(src, dst, n);
}

}  // namespace detail
}  // namespace fusetrain
