// What this build of fusetrain contains.
#pragma once

namespace fusetrain {

// Whether the CUDA kernels were compiled in.
bool built_with_cuda();

}  // namespace fusetrain
