# The sanitizer build (FUSETRAIN_SANITIZE, NOTE [sanitizer build] in CMakeLists.txt): the value is
# checked and turned into flags here, in functions without side effects, so that
# tests/cmake/sanitize.cmake can check them with `cmake -P` for any value.

# The compile and link flags for FUSETRAIN_SANITIZE=`value` (a comma-separated list of GCC/Clang
# sanitizer names, e.g. "address,undefined" or "thread") in `out_var`; empty for an empty value.
# A value no sanitizer build can use fails with a message naming it and what is allowed.
function(fusetrain_sanitizer_flags value out_var)
  set(_allowed address undefined thread leak)
  string(STRIP "${value}" value)
  if(value STREQUAL "")
    set(${out_var} "" PARENT_SCOPE)
    return()
  endif()
  string(REPLACE "," ";" _names "${value}")
  set(_seen "")
  foreach(_n IN LISTS _names)
    string(STRIP "${_n}" _n)
    if(NOT _n IN_LIST _allowed)
      string(REPLACE ";" ", " _a "${_allowed}")
      message(FATAL_ERROR "fusetrain: FUSETRAIN_SANITIZE='${value}': '${_n}' is not a sanitizer this build supports "
                          "(allowed: ${_a}, comma-separated, e.g. address,undefined or thread; empty: none)")
    endif()
    if(_n IN_LIST _seen)
      message(FATAL_ERROR "fusetrain: FUSETRAIN_SANITIZE='${value}' names '${_n}' twice")
    endif()
    list(APPEND _seen "${_n}")
  endforeach()
  # ThreadSanitizer keeps its own shadow memory and cannot share a process with AddressSanitizer's
  # or LeakSanitizer's (the compilers refuse the pair).
  if("thread" IN_LIST _seen AND ("address" IN_LIST _seen OR "leak" IN_LIST _seen))
    message(FATAL_ERROR "fusetrain: FUSETRAIN_SANITIZE='${value}': 'thread' cannot be combined with 'address' or "
                        "'leak' (one process has one of their runtimes); build them separately, e.g. "
                        "address,undefined and thread")
  endif()
  string(REPLACE ";" "," _list "${_seen}")
  set(${out_var} "-fsanitize=${_list};-fno-omit-frame-pointer;-fno-sanitize-recover=all" PARENT_SCOPE)
endfunction()
