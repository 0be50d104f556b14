// What this build of fusetrain contains (fusetrain/build_info.h).
#include "fusetrain/build_info.h"

namespace fusetrain {

bool built_with_cuda() {
#ifdef FUSETRAIN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace fusetrain
