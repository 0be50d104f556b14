// Internal interface between the op layer (csrc/ops) and the kernels
// (csrc/cpu, csrc/cuda). Not part of the public API.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>
#include <vector>

#include "dispatch.h"
#include "optim_math.h"

namespace fusetrain {
namespace detail {

enum class OptimKind : int {
  Adam = 0, SGD = 1, Lion = 2, RMSprop = 3, Adadelta = 4, RAdam = 5, NAdam = 6, Direction = 7, Apply = 8
};

// NOTE [device values]: the hyperparameters a schedule may change (the
// fields a kind's table entry marks schedulable: betas, momentum, weight
// decay, eps, ...) are read by the kernels from the group's values tensor, a
// float64 vector in the params' device memory, instead of the launch's
// arguments, so a compiled or captured step reads each step's values. The
// op layer binds each such double of OptimHyper (its byte offset) to its
// index in that vector; the kernels write the vector's entries over the
// bound members before computing a tensor's coefficients. Without a values
// tensor the members keep the record's values (the C++ front end).
struct DeviceValues {
  static constexpr int kMax = 8;
  int count = 0;
  int offset[kMax];  // byte offset of a double member of OptimHyper
  int index[kMax];   // its entry in the values tensor
};

struct OptimHyper {
  OptimKind kind = OptimKind::Adam;
  AdamHyper adam{};
  SGDHyper sgd{};
  LionHyper lion{};
  RMSpropHyper rmsprop{};
  AdadeltaHyper adadelta{};
  RAdamHyper radam{};
  NAdamHyper nadam{};
  DirectionHyper direction{};
  ApplyHyper apply{};
  bool count_step = true;  // false: the pass leaves the step counters (and tensor scalars) alone
  bool maximize = false;
  double max_grad_norm = 0.0;  // <= 0: no clipping
  // bfloat16 params without a master are written back with stochastic
  // rounding (NOTE [lean state] in csrc/common/lean_state.h).
  bool stochastic_params = false;
  DeviceValues values{};
};

// Writes the values tensor's entries over the members bound to them (NOTE
// [device values]); `values` null: nothing to read.
FT_HD void read_device_values(OptimHyper& h, const double* values) {
  if (values == nullptr) return;
  for (int i = 0; i < h.values.count; ++i) {
    *reinterpret_cast<double*>(reinterpret_cast<char*>(&h) + h.values.offset[i]) = values[h.values.index[i]];
  }
}

// The tensors of one update launch. All share a device; params share a dtype,
// grads share a dtype, states share a dtype and masters share a dtype (the op
// layer buckets mixed lists). States are float32 (float64 for float64 params)
// or bfloat16 or int8 codes; masters float32 or, for bfloat16 params, int16
// remainders (NOTE [lean state] in csrc/common/lean_state.h). Lists that an
// optimizer does not use are empty; otherwise they have params.size() entries.
//   Adam: state1 = exp_avg, state2 = exp_avg_sq, state3 = max_exp_avg_sq
//   SGD:  state1 = momentum_buffer
//   Lion: state1 = exp_avg
//   RMSprop: state1 = square_avg, state2 = momentum_buffer, state3 = grad_avg
//   Adadelta: state1 = square_avg, state2 = acc_delta
//   RAdam: state1 = exp_avg, state2 = exp_avg_sq
//   NAdam: state1 = exp_avg, state2 = exp_avg_sq; aux = mu_product
//   Direction (NOTE [apply pass] in csrc/ops/aten_stage.h): params = scratch
//     tensors that receive the direction; state1 = exp_avg, state2 = exp_avg_sq,
//     state3 = the weights (read) when the direction has an L2 term
//   Apply (NOTE [apply pass]): no state; grads = the update direction; aux =
//     a per-tensor step or decay factor (or empty; ApplyHyper)
//
// NOTE [tensor scalars]: `aux` holds one 0-d float32 tensor per param (or is
// empty), a per-tensor scalar beside the step counter that the coefficients
// read: NAdam's mu_product (state: advanced with the step, before the update
// reads it, and only when the step is not skipped) or a read-only per-tensor
// factor computed on the device by an ATen stage.
struct UpdateLists {
  std::vector<at::Tensor> params, grads, state1, state2, state3, master, ema, steps, aux;
  // NOTE [8-bit state] in csrc/common/lean_state.h: with int8 states, the
  // float32 block scales of state1..3 (one 1-D tensor per param, empty for an
  // absent slot) and the block size, one for the whole launch.
  std::vector<at::Tensor> scales[3];
  int64_t state_block = 0;
  // NOTE [ema remainder] in csrc/common/lean_state.h: the int16 remainders of
  // bfloat16 EMA tensors, one per ema entry, or empty.
  std::vector<at::Tensor> ema_rem;
  // Argument names of state1..3, for error messages.
  const char* state_names[3] = {"state1", "state2", "state3"};
  const char* aux_name = "aux";
};

// Device scalars (0-d float32 on the params' device); undefined when absent.
// `values`: the group's float64 values tensor (NOTE [device values]).
// `stalled`: a 0-d int64 counter the pass adds its stalled updates to (NOTE
// [stalled updates] in csrc/common/lean_state.h).
struct UpdateScalars {
  at::Tensor lr, inv_scale, found_inf, grad_norm, ema_decay, values, stalled;
};

// ---- kernels (csrc/cpu/*_kernel.cpp, csrc/cuda/*_kernel.cu) ----------------------
using UpdateKernel = void (*)(const UpdateLists& lists, const OptimHyper& hyper, const UpdateScalars& scalars);
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

void fused_update_cpu(const UpdateLists& lists, const OptimHyper& hyper, const UpdateScalars& scalars);
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
void fused_update_cuda(const UpdateLists& lists, const OptimHyper& hyper, const UpdateScalars& scalars);
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

// The fused update kernel of a device type: each kernel file registers its
// own at load time (as the ops' NOTE [kernel registration] in dispatch.h), and
// fusetrain::fused_step_ takes the one of a group's device.
void register_update_kernel(c10::DeviceType type, UpdateKernel kernel);
UpdateKernel update_kernel(c10::DeviceType type);

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

// Argument checks and dtype bucketing shared by every element-wise update
// (csrc/ops/fused_update.cpp); each bucket goes to `kernel`.
void run_fused_update(const char* op_name, const UpdateLists& lists, const OptimHyper& hyper,
                      const UpdateScalars& scalars, UpdateKernel kernel);

}  // namespace detail
}  // namespace fusetrain
