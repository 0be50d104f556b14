// The kernels of the ops other than the fused update (grad_stats, the EMA,
// gated copies, the loss-scale update, the EMA decay) and the op
// implementations the kernel files register with them (NOTE [kernel
// registration] in dispatch.h); the helpers every op shares. Internal
// interface between csrc/ops and csrc/cpu, csrc/cuda; not part of the public
// API.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>
#include <vector>

#include "dispatch.h"
#include "step_math.h"

namespace fusetrain {
namespace detail {

// ---- kernels (csrc/cpu/*_kernel.cpp, csrc/cuda/*_kernel.cu) ----------------------
using GradStatsKernel = void (*)(const std::vector<at::Tensor>& grads, const at::Tensor& inv_scale,
                                 const at::Tensor& norm_out, const at::Tensor& found_inf_out);
// `rem`: per ema entry, its int16 remainder (NOTE [ema remainder]) or undefined.
using EmaUpdateKernel = void (*)(const std::vector<at::Tensor>& ema, const std::vector<at::Tensor>& src,
                                 const std::vector<at::Tensor>& rem, const at::Tensor& decay,
                                 const at::Tensor& found_inf);
// dst, src: dense pairs of one dtype and layout, none empty (the op checks).
using GatedCopyKernel = void (*)(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src,
                                 const at::Tensor& found_inf);
using UpdateScaleKernel = void (*)(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                   const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                                   int64_t growth_interval);
// decay_out, step: 0-d float32 on one device; total: the same, or undefined (the exp schedule needs it).
using EmaDecayKernel = void (*)(const at::Tensor& decay_out, const at::Tensor& step, const at::Tensor& total,
                                const EmaSchedule& schedule);

void grad_stats_cpu(const std::vector<at::Tensor>& grads, const at::Tensor& inv_scale,
                    const at::Tensor& norm_out, const at::Tensor& found_inf_out);
void ema_update_cpu(const std::vector<at::Tensor>& ema, const std::vector<at::Tensor>& src,
                    const std::vector<at::Tensor>& rem, const at::Tensor& decay, const at::Tensor& found_inf);
void gated_copy_cpu(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src,
                    const at::Tensor& found_inf);
void update_scale_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                      double growth_factor, double backoff_factor, int64_t growth_interval);
void ema_decay_cpu(const at::Tensor& decay_out, const at::Tensor& step, const at::Tensor& total,
                   const EmaSchedule& schedule);
void grad_stats_cuda(const std::vector<at::Tensor>& grads, const at::Tensor& inv_scale,
                     const at::Tensor& norm_out, const at::Tensor& found_inf_out);
void ema_update_cuda(const std::vector<at::Tensor>& ema, const std::vector<at::Tensor>& src,
                     const std::vector<at::Tensor>& rem, const at::Tensor& decay, const at::Tensor& found_inf);
void gated_copy_cuda(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src,
                     const at::Tensor& found_inf);
void update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval);
void ema_decay_cuda(const at::Tensor& decay_out, const at::Tensor& step, const at::Tensor& total,
                    const EmaSchedule& schedule);

// ---- op implementations (csrc/ops/<op>.cpp), registered by the kernel files ------
// NOTE [kernel registration] in dispatch.h. Each is the op's schema in C++ types
// with the device kernel first.
using OptT = std::optional<at::Tensor>;

std::tuple<at::Tensor, at::Tensor> grad_stats_impl(GradStatsKernel kernel, at::TensorList grads,
                                                   const OptT& inv_scale);
void ema_update_impl(EmaUpdateKernel kernel, at::TensorList ema, at::TensorList src, const at::Tensor& decay,
                     const OptT& found_inf, const std::optional<at::TensorList>& remainders);
void gated_copy_impl(GatedCopyKernel kernel, at::TensorList dst, at::TensorList src, const at::Tensor& found_inf);
// Whether gated_copy_ takes the pair (its checks, as one answer): one device, dtype, shape and dense layout,
// no partial overlap.
bool gated_copy_takes(const at::Tensor& dst, const at::Tensor& src);
void update_scale_impl(UpdateScaleKernel kernel, const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                       int64_t growth_interval, const OptT& last_skipped, const OptT& skipped_steps);
void ema_decay_impl(EmaDecayKernel kernel, const at::Tensor& decay_out, const at::Tensor& step,
                    const OptT& total_steps, c10::string_view decay_type, double decay, double beta, bool warmup,
                    double warmup_gamma, double warmup_power);

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

}  // namespace detail
}  // namespace fusetrain
