// CUDA kernel of fusetrain::gated_copy_: up to kMaxPairs dense pairs a launch,
// one row of blocks per pair (blockIdx.y), 16-byte copies where both ends are
// aligned; every block returns at once when the flag is non-zero.
#include <torch/library.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

#include "../common/op_kernels.h"

namespace fusetrain {
namespace detail {
namespace {

constexpr int kMaxPairs = 128;  // 3 KiB of arguments: under the classic 4 KiB limit
constexpr int kThreads = 256;
constexpr int64_t kBytesPerBlock = kThreads * 16 * 8;
constexpr int kMaxBlocksPerPair = 256;

struct CopyPairs {
  char* dst[kMaxPairs];
  const char* src[kMaxPairs];
  int64_t bytes[kMaxPairs];
};

__global__ void __launch_bounds__(kThreads) gated_copy_kernel(CopyPairs pairs, const float* found_inf) {
  if (*found_inf != 0.f) return;
  char* d = pairs.dst[blockIdx.y];
  const char* s = pairs.src[blockIdx.y];
  const int64_t n = pairs.bytes[blockIdx.y];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(d) % 16 == 0 && reinterpret_cast<uintptr_t>(s) % 16 == 0) {
    const int64_t vecs = n / 16;
    for (int64_t i = first; i < vecs; i += stride) {
      reinterpret_cast<uint4*>(d)[i] = reinterpret_cast<const uint4*>(s)[i];
    }
    done = vecs * 16;
  }
  for (int64_t i = done + first; i < n; i += stride) d[i] = s[i];
}

}  // namespace

void gated_copy_cuda(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src,
                     const at::Tensor& found_inf) {
  if (dst.empty()) return;
  c10::cuda::CUDAGuard guard(found_inf.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (size_t b = 0; b < dst.size(); b += kMaxPairs) {
    const int n = static_cast<int>(std::min<size_t>(kMaxPairs, dst.size() - b));
    CopyPairs pairs;
    int64_t most = 0;
    for (int i = 0; i < n; ++i) {
      pairs.dst[i] = static_cast<char*>(dst[b + i].data_ptr());
      pairs.src[i] = static_cast<const char*>(src[b + i].const_data_ptr());
      pairs.bytes[i] = dst[b + i].numel() * dst[b + i].element_size();
      most = std::max(most, pairs.bytes[i]);
    }
    const int blocks = static_cast<int>(std::min<int64_t>((most + kBytesPerBlock - 1) / kBytesPerBlock, kMaxBlocksPerPair));
    gated_copy_kernel<<<dim3(blocks, n), kThreads, 0, stream>>>(pairs, found_inf.const_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace detail
}  // namespace fusetrain

// NOTE [kernel registration] in csrc/common/dispatch.h.
TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) {
  using namespace fusetrain::detail;
  m.impl("gated_copy_", bind_kernel<&gated_copy_impl, &gated_copy_cuda>());
}
