// CUDA-graph capture helpers shared by the ops (fused_step_ refuses host
// values while capturing), the C++ fusetrain::TrainStep, the optimizers'
// capture checks and (through fusetrain._C) the Python TrainStep. Declared
// without CUDA types, so callers need no CUDA headers; the CUDA build
// registers the implementations (csrc/cuda/capture_hooks.cu, as NOTE [kernel
// registration] in csrc/common/dispatch.h), without which they report "not
// capturing" and do nothing.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

namespace fusetrain {
namespace detail {

// Whether the current stream of `device` is capturing a CUDA graph. False for
// devices other than CUDA; never initialises a CUDA context.
bool stream_is_capturing(const c10::Device& device);

// NOTE [failed capture]: CUDAGraph::capture_end stops at the first CUDA error,
// before it ends the caching allocators' (device and pinned host) routing of
// the capture's allocations into the graph's memory pool. Left so, the
// allocator believes a capture is still under way: empty_cache() and its
// out-of-memory retry free nothing for the rest of the process, and the pool
// leaks. This ends the routing and releases the pool's use by that capture.
// Call it after a capture that failed, before the CUDAGraph is destroyed (the
// allocator's routing filter refers to it), and only if the graph's pool()
// raises (a capture that did end releases its pool itself). Errors of the
// individual steps are ignored: each may already have happened.
void abandon_capture(c10::DeviceIndex device, c10::MempoolId_t pool);

// The CUDA implementations of the two (csrc/cuda/capture_hooks.cu registers them at load time).
struct CaptureHooks {
  bool (*stream_is_capturing)(const c10::Device& device) = nullptr;
  void (*abandon_capture)(c10::DeviceIndex device, c10::MempoolId_t pool) = nullptr;
};
bool register_capture_hooks(CaptureHooks hooks);

}  // namespace detail
}  // namespace fusetrain
