# Runs fusetrain_sanitizer_flags (cmake/FusetrainSanitize.cmake) for tests/python/project/test_sanitize.py:
#   cmake -DVALUE=address,undefined -P sanitize.cmake
# and prints "RESULT=<flags>" (joined with '|'), or fails with the function's message.
cmake_minimum_required(VERSION 3.24)
include("${CMAKE_CURRENT_LIST_DIR}/../../cmake/FusetrainSanitize.cmake")
fusetrain_sanitizer_flags("${VALUE}" out)
string(REPLACE ";" "|" out "${out}")
message(STATUS "RESULT=${out}")
