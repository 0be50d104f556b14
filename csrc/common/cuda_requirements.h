// What fusetrain's CUDA kernels need from the CUDA toolkit and driver.
//
// NOTE [kernel argument size]: the multi-tensor launches pass their metadata
// (tensor addresses and the block-to-chunk map, 8 to 17 KiB) as kernel
// arguments. Arguments above the classic 4 KiB need CUDA 12.1 or newer at
// build time (checked by CMake, cmake/FusetrainCuda.cmake, and by
// multi_tensor_apply.cuh), an sm_70 or newer GPU (every architecture the build
// accepts) and a driver of the CUDA 12.1 generation or newer (R530+), checked
// once per process at the first launch. Each launch site static_asserts its
// argument size against kMaxKernelParamBytes.
#pragma once

#include <cstddef>
#include <string>

namespace fusetrain {

// CUDA version encoding of CUDART_VERSION and cudaDriverGetVersion: 1000 * major + 10 * minor.
constexpr int kMinCudaVersion = 12010;
// Kernel argument limit of CUDA >= 12.1 on sm_70+ (bytes).
constexpr std::size_t kMaxKernelParamBytes = 32764;

// Empty when a driver reporting `driver_version` (cudaDriverGetVersion) runs
// the kernels; otherwise the error to show.
inline std::string driver_version_problem(int driver_version) {
  if (driver_version >= kMinCudaVersion) return {};
  const std::string found = driver_version <= 0 ? std::string("no CUDA driver")
                                                : "a driver for CUDA " + std::to_string(driver_version / 1000) + "." +
                                                      std::to_string((driver_version % 1000) / 10);
  return "fusetrain: the CUDA kernels need an NVIDIA driver for CUDA 12.1 or newer (R530+; they pass more than "
         "4 KiB of kernel arguments), but this process found " +
         found + ". Update the NVIDIA driver, or run on the CPU";
}

}  // namespace fusetrain
