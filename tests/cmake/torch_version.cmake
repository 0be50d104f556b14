# Runs fusetrain_check_torch_version (cmake/FusetrainTorch.cmake) or fusetrain_local_cuda_archs
# (cmake/FusetrainCuda.cmake) for tests/python/project/test_install.py:
#   cmake -DACTION=torch -DFOUND=2.11.0+cu130 -DPYPROJECT=path -P torch_version.cmake
#   cmake -DACTION=local -DPYTHON=path -P torch_version.cmake
# and prints "RESULT=<value>" (lists joined with '|').
cmake_minimum_required(VERSION 3.24)
include("${CMAKE_CURRENT_LIST_DIR}/../../cmake/FusetrainTorch.cmake")
include("${CMAKE_CURRENT_LIST_DIR}/../../cmake/FusetrainCuda.cmake")
if(ACTION STREQUAL "torch")
  fusetrain_check_torch_version("${FOUND}" "${PYPROJECT}")
  set(out "ok")
elseif(ACTION STREQUAL "local")
  fusetrain_local_cuda_archs("${PYTHON}" out)
else()
  message(FATAL_ERROR "unknown ACTION '${ACTION}'")
endif()
string(REPLACE ";" "|" out "${out}")
message(STATUS "RESULT=${out}")
