// Helpers shared by the GoogleTest files.
#pragma once

#include <gtest/gtest.h>

#include <fusetrain/fusetrain.h>
#include <torch/torch.h>

#include <functional>
#include <string>

namespace fusetrain_test {

// f must throw a c10::Error whose message contains needle.
inline void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error, expected one containing: " << needle;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

inline bool have_cuda() { return torch::cuda::is_available() && fusetrain::built_with_cuda(); }

}  // namespace fusetrain_test

#define SKIP_WITHOUT_CUDA()             \
  if (!fusetrain_test::have_cuda())     \
  GTEST_SKIP() << "needs a CUDA device and fusetrain built with CUDA"
