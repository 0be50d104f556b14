"""The sanitizer build and its script, checked without building anything: CMake's
FUSETRAIN_SANITIZE refuses values no build can use (cmake/FusetrainSanitize.cmake, through
tests/cmake/sanitize.cmake), scripts/sanitize refuses bad arguments and documents its modes, CI
runs its ASan part, and every suppression names only torch, libgomp or Python and says why."""

import os
import re
import shutil
import subprocess

import pytest

from _test_helpers import REPO

SANITIZE = os.path.join(REPO, "scripts", "sanitize")
SUPPRESSIONS = os.path.join(REPO, "scripts", "sanitizers")
CMAKE = shutil.which("cmake")


def run(cmd, timeout=60):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def sanitizer_flags(value):
    return run([CMAKE, f"-DVALUE={value}", "-P", os.path.join(REPO, "tests", "cmake", "sanitize.cmake")])


@pytest.mark.skipif(CMAKE is None, reason="needs cmake")
@pytest.mark.parametrize("value, flags", [
    ("", ""),
    ("address,undefined", "-fsanitize=address,undefined|-fno-omit-frame-pointer|-fno-sanitize-recover=all"),
    (" thread ", "-fsanitize=thread|-fno-omit-frame-pointer|-fno-sanitize-recover=all"),
])
def test_cmake_turns_a_sanitizer_list_into_flags(value, flags):
    r = sanitizer_flags(value)
    assert r.returncode == 0, r.stderr
    assert f"RESULT={flags}\n" in r.stdout + r.stderr


@pytest.mark.skipif(CMAKE is None, reason="needs cmake")
@pytest.mark.parametrize("value, message", [
    ("address,thread", "'thread' cannot be combined with 'address' or 'leak'"),
    ("thread,leak", "'thread' cannot be combined with 'address' or 'leak'"),
    ("adress", "'adress' is not a sanitizer this build supports (allowed: address, undefined, thread, leak"),
    ("address,,undefined", "'' is not a sanitizer this build supports"),
    ("undefined,undefined", "names 'undefined' twice"),
])
def test_cmake_refuses_a_list_no_build_can_use(value, message):
    r = sanitizer_flags(value)
    assert r.returncode != 0
    text = " ".join((r.stdout + r.stderr).split())
    assert f"FUSETRAIN_SANITIZE='{value}'" in text and message in text


def test_cmake_applies_the_flags_to_fusetrains_targets_only():
    text = open(os.path.join(REPO, "CMakeLists.txt")).read()
    assert set(re.findall(r"^\s*fusetrain_sanitize\((\w+)\)", text, flags=re.M)) == {
        "fusetrain_core", "_C", "fusetrain_cpp_tests"}
    assert "NOTE [sanitizer build]" in text


def test_script_help_names_its_modes_and_bad_arguments_are_refused():
    r = run([SANITIZE, "--help"])
    assert r.returncode == 0, r.stderr
    for word in ("asan", "tsan", "all", "--ci", "--build-only", "not in CI", "SANITIZE_JOBS"):
        assert word in r.stdout
    r = run([SANITIZE, "msan"])
    assert r.returncode == 2 and "unknown argument 'msan'" in r.stderr
    r = run([SANITIZE])
    assert r.returncode == 2 and "name a mode" in r.stderr


def test_ci_runs_the_asan_part_after_the_other_tests():
    text = open(os.path.join(REPO, "scripts", "test")).read()
    assert "scripts/sanitize asan --ci" in text


def test_every_suppression_names_torch_libgomp_or_python_and_says_why():
    files = sorted(f for f in os.listdir(SUPPRESSIONS) if f.endswith(".supp"))
    assert {"asan.supp", "lsan.supp", "ubsan.supp", "tsan.supp"} <= set(files)
    for name in files:
        lines = open(os.path.join(SUPPRESSIONS, name)).read().splitlines()
        for i, line in enumerate(lines):
            if not line.strip() or line.startswith("#"):
                continue
            kind, _, pattern = line.partition(":")
            assert kind and pattern, f"{name}:{i + 1}: '{line}' is not TYPE:PATTERN"
            assert re.search(r"torch|c10|libgomp|python|Py", pattern), \
                f"{name}:{i + 1}: '{line}' suppresses something outside torch, libgomp or Python"
            assert "fusetrain" not in pattern, f"{name}:{i + 1}: fusetrain's own findings are fixed, not suppressed"
            assert i > 0 and lines[i - 1].startswith("#"), f"{name}:{i + 1}: '{line}' has no comment saying why"
