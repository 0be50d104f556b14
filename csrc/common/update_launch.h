// The arguments of one launch of the fused update kernel (the op layer,
// csrc/ops, to the kernels, csrc/cpu and csrc/cuda): the kind and its fields,
// the tensors and the device scalars; the kernel type, each device's kernel
// and the checks every launch passes. Not part of the public API.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include <vector>

#include "device_math.h"
#include "kind_table.h"

namespace fusetrain {
namespace detail {

// NOTE [device values]: the hyperparameters a schedule may change (the
// fields the optimizer table marks schedulable: betas, momentum, weight
// decay, eps, ...) are read by the kernels from the group's values tensor, a
// float64 vector in the params' device memory, instead of the launch's
// arguments, so a compiled or captured step reads each step's values. The
// op layer names, for each entry of that vector, the field of OptimHyper it
// replaces; the kernels write the entries over those fields before
// computing a tensor's coefficients. Without a values tensor the fields keep
// the record's values (the C++ front end, a values tensor on the CPU that
// the op read on the host: NOTE [compiled settings] in
// python/fusetrain/optim/_group_values.py).
struct DeviceValues {
  static constexpr int kMax = kMaxKindFields;
  int count = 0;
  int field[kMax];  // the entry's field in OptimHyper::fields
};

struct OptimHyper {
  OptimKind kind = OptimKind::Adam;
  // The kind's record fields (<Kind>Fields of kind_table.h, in the table's order).
  double fields[kMaxKindFields] = {};
  bool count_step = true;  // false: the pass leaves the step counters (and tensor scalars) alone
  bool maximize = false;
  double max_grad_norm = 0.0;  // <= 0: no clipping
  // bfloat16 params without a master are written back with stochastic
  // rounding (NOTE [lean state] in csrc/common/lean_state.h).
  bool stochastic_params = false;
  DeviceValues values{};

  // The kind and its fields.
  template <typename Fields>
  void set(OptimKind k, const Fields& f) {
    kind = k;
    f.store(fields);
  }
};

// Writes the values tensor's entries over the fields they replace (NOTE
// [device values]); `values` null: nothing to read.
FT_HD void read_device_values(OptimHyper& h, const double* values) {
  if (values == nullptr) return;
  for (int i = 0; i < h.values.count; ++i) h.fields[h.values.field[i]] = values[i];
}

// The tensors of one update launch. All share a device; params share a dtype,
// grads share a dtype, states share a dtype and masters share a dtype (the op
// layer buckets mixed lists). States are float32 (float64 for float64 params)
// or bfloat16 or int8 codes; masters float32 or, for bfloat16 params, int16
// remainders (NOTE [lean state] in csrc/common/lean_state.h). Lists that an
// optimizer does not use are empty; otherwise they have params.size() entries.
// Each kind's states are in its entry of the optimizer table (docs/ops.md
// lists them); a scalar state is `aux`, not a slot. The passes of the
// composite kinds (NOTE [apply pass] in csrc/ops/aten_stage.h):
//   Direction: params = scratch tensors that receive the direction; state1 =
//     exp_avg, state2 = exp_avg_sq, state3 = the weights (read) when the
//     direction has an L2 term
//   Apply: no state; grads = the update direction; aux = a per-tensor step or
//     decay factor (or empty; ApplyMath)
//
// NOTE [tensor scalars]: `aux` holds one 0-d float32 tensor per param (or is
// empty), a per-tensor scalar beside the step counter that the coefficients
// read: a scalar state of the optimizer table (NAdam's mu_product: advanced
// with the step, before the update reads it, and only when the step is not
// skipped; <Kind>Math::next_aux) or a read-only per-tensor factor computed on
// the device by an ATen stage (KindTraits<K>::kScalar).
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

// The fused update kernel of a device (csrc/cpu/fused_update_kernel.cpp,
// csrc/cuda/fused_update_kernel.cu): each kernel file registers its own at
// load time (as the ops' NOTE [kernel registration] in dispatch.h), and
// fusetrain::fused_step_ takes the one of a group's device.
using UpdateKernel = void (*)(const UpdateLists& lists, const OptimHyper& hyper, const UpdateScalars& scalars);
void fused_update_cpu(const UpdateLists& lists, const OptimHyper& hyper, const UpdateScalars& scalars);
void fused_update_cuda(const UpdateLists& lists, const OptimHyper& hyper, const UpdateScalars& scalars);
void register_update_kernel(c10::DeviceType type, UpdateKernel kernel);
UpdateKernel update_kernel(c10::DeviceType type);

// Argument checks and dtype bucketing shared by every launch of the update
// (csrc/ops/fused_update.cpp); each bucket goes to `kernel`.
void run_fused_update(const char* op_name, const UpdateLists& lists, const OptimHyper& hyper,
                      const UpdateScalars& scalars, UpdateKernel kernel);

}  // namespace detail
}  // namespace fusetrain
