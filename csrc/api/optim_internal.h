// Helpers of the C++ optimizer front end (csrc/api/optim.cpp and
// optimizers.cpp). Not part of the public API.
#pragma once

#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <fusetrain/optim.h>

#include <tuple>

namespace fusetrain {
namespace api_detail {

inline void check_range(const char* opt, const char* name, double v, double lo, double hi, bool hi_open) {
  TORCH_CHECK(v >= lo && (hi_open ? v < hi : v <= hi), opt, ": invalid ", name, " value: ", v, " (must be in [", lo,
              ", ", hi, hi_open ? "))" : "])");
}
inline void check_nonneg(const char* opt, const char* name, double v) {
  TORCH_CHECK(v >= 0.0, opt, ": invalid ", name, " value: ", v, " (must be >= 0)");
}
inline void check_betas(const char* opt, const std::tuple<double, double>& b) {
  TORCH_CHECK(std::get<0>(b) >= 0.0 && std::get<0>(b) < 1.0, opt, ": invalid beta parameter at index 0: ",
              std::get<0>(b), " (must be in [0, 1))");
  TORCH_CHECK(std::get<1>(b) >= 0.0 && std::get<1>(b) < 1.0, opt, ": invalid beta parameter at index 1: ",
              std::get<1>(b), " (must be in [0, 1))");
}

// Params below this size keep float32 state in an int8 group (NOTE [8-bit
// state]; python/fusetrain/optim/_int8_state.py's MIN_NUMEL).
constexpr int64_t kInt8MinNumel = 4096;

// NOTE [float64 params] in csrc/ops/fused_update.cpp: float64 state for float64
// params, float32 for the others unless the group keeps bfloat16 or int8
// state (NOTE [lean state], NOTE [8-bit state] in csrc/common/lean_state.h).
inline at::ScalarType state_dtype_of(const at::Tensor& p, at::ScalarType group_dtype) {
  if (p.scalar_type() == at::kDouble) return at::kDouble;
  if (group_dtype == at::kChar) return p.numel() >= kInt8MinNumel ? at::kChar : at::kFloat;
  return group_dtype;
}
inline at::Tensor state_zeros_like(const at::Tensor& p, at::ScalarType dtype = at::kFloat) {
  return at::zeros_like(p, p.options().dtype(dtype), at::MemoryFormat::Preserve);
}
inline bool needs_master(const at::Tensor& p) { return p.scalar_type() == at::kHalf || p.scalar_type() == at::kBFloat16; }
// Whether a param of a group with these options keeps a `master` tensor.
inline bool keeps_master(const FusedCommonOptions& o, const at::Tensor& p) {
  return o.master_weights_ && needs_master(p) && o.master_form_ != MasterForm::Stochastic;
}


}  // namespace api_detail
}  // namespace fusetrain
