// Splitting tensor lists into (tensor, chunk) work items for parallel_for (parallel.h),
// shared by the CPU kernels. Internal header.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace fusetrain {
namespace detail {

struct WorkItem {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

// Items of at most `chunk` elements covering every tensor of the list.
inline std::vector<WorkItem> make_work_items(const std::vector<at::Tensor>& tensors, int64_t chunk) {
  std::vector<WorkItem> items;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t n = tensors[t].numel();
    for (int64_t b = 0; b < n; b += chunk) items.push_back({static_cast<int64_t>(t), b, std::min(n, b + chunk)});
  }
  return items;
}

}  // namespace detail
}  // namespace fusetrain
