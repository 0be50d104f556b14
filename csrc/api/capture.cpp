// CUDA-graph capture helpers (see capture.h).
#include "capture.h"

#ifdef FUSETRAIN_WITH_CUDA
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <functional>

namespace fusetrain {
namespace detail {

bool stream_is_capturing(const c10::Device& device) {
#ifdef FUSETRAIN_WITH_CUDA
  if (!device.is_cuda()) return false;
  const auto index = device.has_index() ? device.index() : c10::cuda::current_device();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(index).stream(), &status));
  return status != cudaStreamCaptureStatusNone;
#else
  (void)device;
  return false;
#endif
}

void abandon_capture(c10::DeviceIndex device, c10::MempoolId_t pool) {
#ifdef FUSETRAIN_WITH_CUDA
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
#else
  (void)device;
  (void)pool;
#endif
}

}  // namespace detail
}  // namespace fusetrain
