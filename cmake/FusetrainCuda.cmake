# CUDA toolkit requirement and architecture selection for fusetrain's kernels.
#
# Kept in functions (no side effects) so that tests/cmake/cuda_archs.cmake can
# check them with `cmake -P` for any toolkit version, without a GPU or nvcc.
#
# NOTE [kernel argument size]: the multi-tensor launch metadata (up to ~17 KiB)
# is passed as kernel arguments. Arguments above 4 KiB need CUDA >= 12.1, an
# sm_70+ GPU and a driver of the 12.1 generation or newer (checked once at run
# time, csrc/common/cuda_requirements.h).

set(FUSETRAIN_MIN_CUDA_VERSION 12.1)
set(FUSETRAIN_MIN_CUDA_ARCH 70)

# Fails unless the toolkit can build the kernels.
function(fusetrain_check_cuda_toolkit version)
  if(version VERSION_LESS FUSETRAIN_MIN_CUDA_VERSION)
    message(FATAL_ERROR
      "fusetrain: the CUDA kernels need CUDA >= ${FUSETRAIN_MIN_CUDA_VERSION} (their launch metadata uses kernel "
      "arguments above 4 KiB), but the CUDA compiler is version ${version}. Point CMAKE_CUDA_COMPILER at a newer "
      "toolkit, or build without the CUDA kernels with FUSETRAIN_CUDA=OFF.")
  endif()
endfunction()

# The default architecture list for a toolkit version, in CMake's
# CUDA_ARCHITECTURES syntax: machine code (SASS) for the GPU generations torch
# supports (Turing, Ampere, Hopper and, from CUDA 12.8, Blackwell data-center
# and consumer parts) plus PTX of the newest one, which the driver compiles for
# any later GPU. Ada (sm_89) and sm_86 run the sm_80 code.
function(fusetrain_default_cuda_archs version out_var)
  set(archs 75-real 80-real 90-real)
  set(newest 90)
  if(version VERSION_GREATER_EQUAL 12.8)
    list(APPEND archs 100-real 120-real)
    set(newest 120)
  endif()
  list(APPEND archs ${newest}-virtual)
  set(${out_var} "${archs}" PARENT_SCOPE)
endfunction()

# nvcc flags for an architecture list. Entries: "NN" (machine code and PTX),
# "NN-real" (machine code), "NN-virtual" (PTX); NN may carry an "a" or "f"
# suffix (architecture-specific features, e.g. 90a). `supported` is the list of
# sm_NN the toolkit builds (fusetrain_cuda_buildable_codes); empty skips that check.
function(fusetrain_cuda_arch_flags archs supported out_var)
  set(flags "")
  if(archs STREQUAL "")
    message(FATAL_ERROR "fusetrain: FUSETRAIN_CUDA_ARCHS is empty; give a list such as \"80-real;90-real;90-virtual\"")
  endif()
  foreach(entry IN LISTS archs)
    if(NOT entry MATCHES "^([0-9]+)([af]?)(-real|-virtual)?$")
      message(FATAL_ERROR
        "fusetrain: FUSETRAIN_CUDA_ARCHS entry '${entry}' is not valid; allowed: NN (machine code and PTX), "
        "NN-real (machine code only) or NN-virtual (PTX only), with NN a compute capability such as 80 or 90a")
    endif()
    set(num "${CMAKE_MATCH_1}")
    set(name "${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
    set(kind "${CMAKE_MATCH_3}")
    if(num LESS FUSETRAIN_MIN_CUDA_ARCH)
      message(FATAL_ERROR
        "fusetrain: FUSETRAIN_CUDA_ARCHS entry '${entry}': the kernels need compute capability >= "
        "${FUSETRAIN_MIN_CUDA_ARCH} (kernel arguments above 4 KiB)")
    endif()
    if(supported AND NOT "sm_${name}" IN_LIST supported)
      string(REPLACE ";" " " _known "${supported}")
      message(FATAL_ERROR
        "fusetrain: FUSETRAIN_CUDA_ARCHS entry '${entry}': this CUDA compiler cannot build sm_${name}; it knows: "
        "${_known}")
    endif()
    if(NOT kind STREQUAL "-virtual")
      list(APPEND flags "--generate-code=arch=compute_${name},code=sm_${name}")
    endif()
    if(NOT kind STREQUAL "-real")
      list(APPEND flags "--generate-code=arch=compute_${name},code=compute_${name}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES flags)
  set(${out_var} "${flags}" PARENT_SCOPE)
endfunction()

# The sm_NN a CUDA compiler builds, for the entries of `archs`: `listed` (from
# `nvcc --list-gpu-code`) plus each architecture-specific entry ("90a", "100f")
# that nvcc accepts. NOTE [arch-specific codes]: nvcc lists only the base
# architectures (sm_90, not sm_90a) although it builds both; an entry with a
# suffix is checked by asking nvcc to plan a compile for it (--dryrun: nvcc
# rejects an unknown architecture before it runs anything, in milliseconds).
function(fusetrain_cuda_buildable_codes nvcc archs listed out_var)
  set(codes ${listed})
  foreach(entry IN LISTS archs)
    if(entry MATCHES "^([0-9]+[af])(-real|-virtual)?$" AND NOT "sm_${CMAKE_MATCH_1}" IN_LIST codes)
      set(name "${CMAKE_MATCH_1}")
      execute_process(COMMAND "${nvcc}" --dryrun "--generate-code=arch=compute_${name},code=sm_${name}"
                              -x cu -c /dev/null -o /dev/null
                      RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
      if(rc EQUAL 0)
        list(APPEND codes "sm_${name}")
      endif()
    endif()
  endforeach()
  set(${out_var} "${codes}" PARENT_SCOPE)
endfunction()

# torch's CMake (find_package(Torch)) adds -gencode flags of its own to
# CMAKE_CUDA_FLAGS from TORCH_CUDA_ARCH_LIST (probing the GPU when that is
# empty) and ignores CMAKE_CUDA_ARCHITECTURES. Give it a fixed list (no probe)
# before find_package(Torch), and remove its flags afterwards with
# fusetrain_strip_torch_gencode.
macro(fusetrain_pin_torch_arch_list)
  set(TORCH_CUDA_ARCH_LIST "8.0")
  set(ENV{TORCH_CUDA_ARCH_LIST} "8.0")
endmacro()

function(fusetrain_strip_torch_gencode flags_var)
  string(REGEX REPLACE "-gencode[ =]+arch=[^ ]+" "" _flags "${${flags_var}}")
  string(REGEX REPLACE "  +" " " _flags "${_flags}")
  set(${flags_var} "${_flags}" PARENT_SCOPE)
endfunction()

# NOTE [local architectures] in CMakeLists.txt: the compute capabilities of the GPUs torch sees on
# this machine, as machine-code entries ("80-real;90-real"); empty without a GPU. GPUs older than
# FUSETRAIN_MIN_CUDA_ARCH are left out with a warning.
function(fusetrain_local_cuda_archs python out_var)
  execute_process(
    COMMAND "${python}" -c "import torch
caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
print(';'.join(f'{a}{b}' for a, b in sorted(caps)))"
    OUTPUT_VARIABLE caps OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
  set(archs "")
  if(rc EQUAL 0)
    foreach(cap IN LISTS caps)
      if(cap LESS FUSETRAIN_MIN_CUDA_ARCH)
        message(WARNING "fusetrain: a GPU of compute capability ${cap} is left out: the kernels need "
                        ">= ${FUSETRAIN_MIN_CUDA_ARCH}")
      else()
        list(APPEND archs "${cap}-real")
      endif()
    endforeach()
  endif()
  set(${out_var} "${archs}" PARENT_SCOPE)
endfunction()
