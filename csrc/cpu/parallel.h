// fusetrain::detail::parallel_for: at::parallel_for for the CPU kernels, with
// a form ThreadSanitizer can check. Internal header.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__SANITIZE_THREAD__)
#include <c10/util/ParallelGuard.h>

#include <algorithm>
#include <exception>
#include <thread>
#include <vector>
#endif

namespace fusetrain {
namespace detail {

// NOTE [tsan and OpenMP]: torch's parallel backend is OpenMP, and libgomp is
// not built for ThreadSanitizer: the barriers that order a parallel region's
// chunks after the caller's writes, and the caller's reads after the chunks,
// are invisible to it, so through at::parallel_for every access to the
// kernels' own memory before or after a region reads as a race with the
// workers. Suppressing reports with a libgomp frame would hide every race,
// real ones between two chunks too (each worker's stack starts in libgomp).
// So a ThreadSanitizer build (scripts/sanitize tsan) runs the same chunks as
// at::parallel_for (the same count for the same at::get_num_threads() and
// grain) on threads of its own, whose start and join ThreadSanitizer sees:
// the chunks run concurrently with exactly the ordering OpenMP gives them,
// and a race between chunks is reported. Every other build calls
// at::parallel_for itself.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
#if defined(__SANITIZE_THREAD__)
  if (begin >= end) return;
  const int64_t n = end - begin;
  int64_t threads = at::get_num_threads();
  if (grain > 0) threads = std::min(threads, (n + grain - 1) / grain);
  if (n <= grain || n == 1 || threads <= 1 || at::in_parallel_region()) {
    c10::ParallelGuard guard(true);
    f(begin, end);
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
  std::vector<std::exception_ptr> errors(threads);
  auto run = [&](int64_t tid) {
    const int64_t b = begin + tid * chunk;
    if (b >= end) return;
    try {
      c10::ParallelGuard guard(true);
      f(b, std::min(end, b + chunk));
    } catch (...) {
      errors[tid] = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (int64_t tid = 1; tid < threads; ++tid) pool.emplace_back(run, tid);
  run(0);
  for (auto& t : pool) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
#else
  at::parallel_for(begin, end, grain, f);
#endif
}

}  // namespace detail
}  // namespace fusetrain
