// How an op's implementation meets its device kernels.
//
// NOTE [kernel registration]: an op's implementation (csrc/ops/<op>.cpp) holds
// the argument checks and takes its device kernel as its first argument. Each
// kernel file registers that implementation, bound to its own kernel, for its
// own dispatch key, beside the kernel:
//
//   TORCH_LIBRARY_IMPL(fusetrain, CUDA, m) {
//     m.impl("ema_update_", bind_kernel<&ema_update_impl, &ema_update_cuda>());
//   }
//
// so csrc/ops needs no knowledge of which backends were built, and a build
// without CUDA simply has no CUDA registration. The op's signature is spelled
// once, by the implementation; OpSignature<&impl> is that signature without the
// kernel argument (what the dispatcher sees), for typed op handles.
#pragma once

#include <utility>

namespace fusetrain {
namespace detail {

template <auto Impl, auto Kernel>
struct BoundKernel;

template <typename R, typename K, typename... Args, R (*Impl)(K, Args...), K Kernel>
struct BoundKernel<Impl, Kernel> {
  static R call(Args... args) { return Impl(Kernel, std::forward<Args>(args)...); }
};

template <auto Impl, auto Kernel>
constexpr auto bind_kernel() {
  return &BoundKernel<Impl, Kernel>::call;
}

template <typename F>
struct DropKernelArg;
template <typename R, typename K, typename... Args>
struct DropKernelArg<R (*)(K, Args...)> {
  using type = R(Args...);
};

template <auto Impl>
using OpSignature = typename DropKernelArg<decltype(Impl)>::type;

}  // namespace detail
}  // namespace fusetrain
