# The torch fusetrain builds against: the installed one (--no-build-isolation), refused before
# anything compiles when it is older than the requirement pyproject.toml declares.
#
# Kept in a function (no side effects) so that tests/cmake/torch_version.cmake can check it with
# `cmake -P` for any version.

# Fails unless torch `found` (torch.__version__, e.g. "2.11.0+cu130") meets the "torch>=X.Y"
# requirement of the [project] dependencies in `pyproject`.
function(fusetrain_check_torch_version found pyproject)
  file(STRINGS "${pyproject}" _req REGEX "^  \"torch>=[0-9.]+\",?$")
  if(NOT _req)
    message(FATAL_ERROR "fusetrain: ${pyproject} has no \"torch>=X.Y\" line in its dependencies")
  endif()
  list(GET _req 0 _req)
  string(REGEX MATCH "[0-9][0-9.]*[0-9]" minimum "${_req}")
  string(REGEX MATCH "^[0-9]+\\.[0-9]+(\\.[0-9]+)?" release "${found}")
  if(release STREQUAL "")
    message(WARNING "fusetrain: cannot read the version of the installed torch ('${found}'); building anyway")
  elseif(release VERSION_LESS minimum)
    message(FATAL_ERROR
      "fusetrain: the installed torch is ${found}, and fusetrain needs torch >= ${minimum} (it compiles against "
      "the installed torch and never replaces it). Install a supported torch first, e.g. "
      "pip install torch==${minimum}.0 (or a newer release), then build fusetrain again.")
  endif()
endfunction()
