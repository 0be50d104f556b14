// CUDA-graph capture helpers (see capture.h): the registered CUDA
// implementations, or none.
#include "capture.h"

namespace fusetrain {
namespace detail {
namespace {

CaptureHooks& hooks() {
  static CaptureHooks h;
  return h;
}

}  // namespace

bool register_capture_hooks(CaptureHooks h) {
  hooks() = h;
  return true;
}

bool stream_is_capturing(const c10::Device& device) {
  return device.is_cuda() && hooks().stream_is_capturing != nullptr && hooks().stream_is_capturing(device);
}

void abandon_capture(c10::DeviceIndex device, c10::MempoolId_t pool) {
  if (hooks().abandon_capture != nullptr) hooks().abandon_capture(device, pool);
}

}  // namespace detail
}  // namespace fusetrain
