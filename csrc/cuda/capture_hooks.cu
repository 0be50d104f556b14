// The CUDA implementations of the capture helpers of csrc/ops/capture.h,
// registered at load time.
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <functional>

#include "../ops/capture.h"

namespace fusetrain {
namespace detail {
namespace {

bool cuda_stream_is_capturing(const c10::Device& device) {
  const auto index = device.has_index() ? device.index() : c10::cuda::current_device();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(index).stream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

// NOTE [failed capture] in csrc/ops/capture.h.
void cuda_abandon_capture(c10::DeviceIndex device, c10::MempoolId_t pool) {
  auto quietly = [](const std::function<void()>& f) {
    try {
      f();
    } catch (...) {
    }
  };
  quietly([&] { c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool); });
  quietly([&] { at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool); });
  quietly([&] { c10::cuda::CUDACachingAllocator::releasePool(device, pool); });
  quietly([&] { at::getHostAllocator(at::kCUDA)->release_pool(pool); });
  (void)cudaGetLastError();  // the error that broke the capture is reported by the caller
}

const bool registered = register_capture_hooks({&cuda_stream_is_capturing, &cuda_abandon_capture});

}  // namespace
}  // namespace detail
}  // namespace fusetrain
