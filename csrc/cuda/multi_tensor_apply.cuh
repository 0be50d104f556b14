// Chunked multi-tensor launcher shared by the CUDA kernels.
//
// The tensors of a list are cut into chunks of kChunkSize elements; each CUDA
// block handles one chunk of one tensor. A launch carries the addresses of up
// to MaxTensors tensors and up to MaxBlocks chunks in its kernel arguments;
// longer lists are split over several launches, and a tensor whose chunks do
// not fit continues in the next launch. The metadata exceeds the classic 4 KiB
// kernel-argument limit: NOTE [kernel argument size] in
// csrc/common/cuda_requirements.h says what that needs.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../common/cuda_requirements.h"

#if !defined(CUDART_VERSION) || CUDART_VERSION < 12010
#error "fusetrain's CUDA kernels need CUDA >= 12.1 (kernel arguments above 4 KiB); see cuda_requirements.h"
#endif

namespace fusetrain {
namespace cuda {

// Whether arguments of these types fit in one launch (NOTE [kernel argument size]).
template <class... Args>
constexpr bool fits_kernel_params() {
  return (sizeof(Args) + ... + std::size_t{0}) <= kMaxKernelParamBytes;
}

// Raises once per call while the driver is too old for large kernel arguments;
// the driver is asked once per process.
inline void check_driver_supports_large_params() {
  static const std::string problem = [] {
    int version = 0;
    if (cudaDriverGetVersion(&version) != cudaSuccess) version = 0;
    return driver_version_problem(version);
  }();
  TORCH_CHECK(problem.empty(), problem);
}

constexpr int64_t kChunkSize = 65536;
constexpr int kBlockThreads = 512;
constexpr int kILP = 4;

template <int Depth, int MaxTensors, int MaxBlocks>
struct TensorListMeta {
  static constexpr int kDepth = Depth;
  static constexpr int kMaxTensors = MaxTensors;
  static constexpr int kMaxBlocks = MaxBlocks;
  void* addrs[Depth][MaxTensors];
  int64_t numel[MaxTensors];
  float* step[MaxTensors];
  float* aux[MaxTensors];  // NOTE [tensor scalars] in csrc/common/update_launch.h
  int32_t index[MaxTensors];  // the tensor's position in its list
  uint16_t block_to_tensor[MaxBlocks];
  int32_t block_to_chunk[MaxBlocks];
  int64_t block_offset;  // index of this launch's first block among all launches
};

// lists: Depth lists; an empty list means "absent" (its addresses are null).
// steps, aux: one float32 scalar per tensor, or empty. launch(meta, num_blocks).
// include: which tensors the launches take (empty: all); a tensor keeps its
// position in the lists as its index either way.
template <class Meta, class Launch>
int64_t multi_tensor_apply(const std::vector<const std::vector<at::Tensor>*>& lists,
                           const std::vector<at::Tensor>& steps, const std::vector<at::Tensor>& aux,
                           Launch&& launch, const std::vector<bool>& include = {}) {
  static_assert(fits_kernel_params<Meta>(), "multi-tensor metadata above the kernel-argument limit");
  TORCH_INTERNAL_ASSERT(static_cast<int>(lists.size()) == Meta::kDepth);
  check_driver_supports_large_params();
  const std::vector<at::Tensor>& first = *lists[0];
  std::vector<size_t> nonempty;
  for (size_t i = 0; i < first.size(); ++i) {
    if (first[i].numel() > 0 && (include.empty() || include[i])) nonempty.push_back(i);
  }
  Meta meta;
  meta.block_offset = 0;
  int tensors = 0;
  int blocks = 0;
  int64_t total_blocks = 0;
  for (size_t k = 0; k < nonempty.size(); ++k) {
    const size_t i = nonempty[k];
    for (int d = 0; d < Meta::kDepth; ++d) {
      meta.addrs[d][tensors] = lists[d]->empty() ? nullptr : (*lists[d])[i].data_ptr();
    }
    meta.numel[tensors] = first[i].numel();
    meta.step[tensors] = steps.empty() ? nullptr : steps[i].data_ptr<float>();
    meta.aux[tensors] = aux.empty() ? nullptr : aux[i].data_ptr<float>();
    meta.index[tensors] = static_cast<int32_t>(i);
    ++tensors;
    const int64_t chunks = (first[i].numel() + kChunkSize - 1) / kChunkSize;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[blocks] = static_cast<uint16_t>(tensors - 1);
      meta.block_to_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      const bool tensors_full = tensors == Meta::kMaxTensors && last_chunk;
      const bool blocks_full = blocks == Meta::kMaxBlocks;
      const bool last = last_chunk && k + 1 == nonempty.size();
      if (tensors_full || blocks_full || last) {
        launch(meta, blocks);
        total_blocks += blocks;
        meta.block_offset = total_blocks;
        blocks = 0;
        if (last_chunk) {
          tensors = 0;
        } else {
          // The current tensor continues in the next launch, in slot 0.
          for (int d = 0; d < Meta::kDepth; ++d) meta.addrs[d][0] = meta.addrs[d][tensors - 1];
          meta.numel[0] = meta.numel[tensors - 1];
          meta.step[0] = meta.step[tensors - 1];
          meta.aux[0] = meta.aux[tensors - 1];
          meta.index[0] = meta.index[tensors - 1];
          tensors = 1;
        }
      }
    }
  }
  return total_blocks;
}

// Number of chunks (= blocks over all launches) of a list.
inline int64_t count_chunks(const std::vector<at::Tensor>& list) {
  int64_t n = 0;
  for (const auto& t : list) n += (t.numel() + kChunkSize - 1) / kChunkSize;
  return n;
}

template <typename T>
struct alignas(sizeof(T) * kILP) AlignedVec {
  T v[kILP];
};

template <typename T>
__device__ __forceinline__ bool is_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(AlignedVec<T>) == 0;
}

// kILP elements of T loaded into (stored from) registers of the compute type C.
template <typename C, typename T>
__device__ __forceinline__ void load_vec(C* dst, const T* src) {
  AlignedVec<T> v = *reinterpret_cast<const AlignedVec<T>*>(src);
#pragma unroll
  for (int k = 0; k < kILP; ++k) dst[k] = static_cast<C>(v.v[k]);
}

template <typename T, typename C>
__device__ __forceinline__ void store_vec(T* dst, const C* src) {
  AlignedVec<T> v;
#pragma unroll
  for (int k = 0; k < kILP; ++k) v.v[k] = static_cast<T>(src[k]);
  *reinterpret_cast<AlignedVec<T>*>(dst) = v;
}

}  // namespace cuda
}  // namespace fusetrain
