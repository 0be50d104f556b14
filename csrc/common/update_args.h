// Internal interface between the op layer (csrc/ops) and the kernels
// (csrc/cpu, csrc/cuda). Not part of the public API.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <vector>

#include "optim_math.h"

namespace fusetrain {
namespace detail {

enum class OptimKind : int { Adam = 0, SGD = 1, Lion = 2 };

struct OptimHyper {
  OptimKind kind = OptimKind::Adam;
  AdamHyper adam{};
  SGDHyper sgd{};
  LionHyper lion{};
  bool maximize = false;
  double max_grad_norm = 0.0;  // <= 0: no clipping
};

// The tensors of one update launch. All share a device; params share a dtype
// and grads share a dtype (the op layer buckets mixed lists). Lists that an
// optimizer does not use are empty; otherwise they have params.size() entries.
//   Adam: state1 = exp_avg, state2 = exp_avg_sq, state3 = max_exp_avg_sq
//   SGD:  state1 = momentum_buffer
//   Lion: state1 = exp_avg
struct UpdateLists {
  std::vector<at::Tensor> params, grads, state1, state2, state3, master, ema, steps;
  // Argument names of state1..3, for error messages.
  const char* state_names[3] = {"state1", "state2", "state3"};
};

// Device scalars (0-d float32 on the params' device); undefined when absent.
struct UpdateScalars {
  at::Tensor lr, inv_scale, found_inf, grad_norm, ema_decay;
};

void fused_update_cpu(const UpdateLists& lists, const OptimHyper& hyper, const UpdateScalars& scalars);
void grad_stats_cpu(const std::vector<at::Tensor>& grads, const at::Tensor& inv_scale,
                    const at::Tensor& norm_out, const at::Tensor& found_inf_out);

void ema_update_cpu(const std::vector<at::Tensor>& ema, const std::vector<at::Tensor>& src, const at::Tensor& decay,
                    const at::Tensor& found_inf);
void update_scale_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                      double growth_factor, double backoff_factor, int64_t growth_interval);

#ifdef FUSETRAIN_WITH_CUDA
void ema_update_cuda(const std::vector<at::Tensor>& ema, const std::vector<at::Tensor>& src, const at::Tensor& decay,
                     const at::Tensor& found_inf);
void update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval);
void fused_update_cuda(const UpdateLists& lists, const OptimHyper& hyper, const UpdateScalars& scalars);
void grad_stats_cuda(const std::vector<at::Tensor>& grads, const at::Tensor& inv_scale,
                     const at::Tensor& norm_out, const at::Tensor& found_inf_out);
#endif

// The CPU kernels are compiled for AVX2+FMA (FUSETRAIN_CPU_AVX2); refuse to run
// them on a processor without those instructions instead of crashing.
inline void check_cpu_features(const char* op) {
#if defined(FUSETRAIN_CPU_AVX2) && (defined(__GNUC__) || defined(__clang__))
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), op,
              ": this build's CPU kernels need AVX2 and FMA, which this processor lacks; "
              "rebuild with -DFUSETRAIN_CPU_AVX2=OFF");
#else
  (void)op;
#endif
}

inline at::Tensor opt_or_undef(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

// Argument checks, dtype bucketing and device dispatch shared by every
// update op (csrc/ops/fused_update.cpp).
void run_fused_update(const char* op_name, const UpdateLists& lists, const OptimHyper& hyper,
                      const UpdateScalars& scalars);

}  // namespace detail
}  // namespace fusetrain
