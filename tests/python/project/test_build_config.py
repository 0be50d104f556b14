"""The CUDA build configuration (cmake/FusetrainCuda.cmake), checked without a
GPU: the toolkit requirement, the default architecture list per toolkit, the
nvcc flags for a user's list, the removal of torch's own -gencode flags, and
the flags the build of this checkout really used for each .cu file."""

import os
import re
import shutil
import subprocess

import pytest

import fusetrain

from _test_helpers import REPO as ROOT

SCRIPT = os.path.join(ROOT, "tests", "cmake", "cuda_archs.cmake")
CMAKE = shutil.which("cmake")

pytestmark = pytest.mark.skipif(CMAKE is None, reason="needs cmake")


def cmake(action, **defs):
    args = [CMAKE, f"-DACTION={action}"] + [f"-D{k}={v}" for k, v in defs.items()] + ["-P", SCRIPT]
    r = subprocess.run(args, capture_output=True, text=True)
    m = re.search(r"RESULT=(.*)", r.stdout)
    return r.returncode, (m.group(1).split("|") if m and m.group(1) else []), r.stderr


def gen(arch, code):
    return f"--generate-code=arch=compute_{arch},code={code}"


def test_toolkit_older_than_12_1_fails_with_a_clear_message():
    rc, _, err = cmake("check", VERSION="11.8.89")
    assert rc != 0
    assert "CUDA >= 12.1" in err and "11.8.89" in err and "FUSETRAIN_CUDA=OFF" in err
    for ok in ("12.1.0", "12.4.131", "13.0.48"):
        assert cmake("check", VERSION=ok)[:2] == (0, ["ok"])


@pytest.mark.parametrize("version, expected", [
    ("12.1.0", ["75-real", "80-real", "90-real", "90-virtual"]),
    ("12.6.85", ["75-real", "80-real", "90-real", "90-virtual"]),
    ("12.8.61", ["75-real", "80-real", "90-real", "100-real", "120-real", "120-virtual"]),
    ("13.0.48", ["75-real", "80-real", "90-real", "100-real", "120-real", "120-virtual"]),
])
def test_default_archs_embed_ptx_of_the_newest(version, expected):
    rc, out, _ = cmake("defaults", VERSION=version)
    assert rc == 0 and out == expected
    assert out[-1].endswith("-virtual"), "PTX for GPUs newer than the list"


def test_user_archs_become_generate_code_flags():
    rc, out, _ = cmake("flags", ARCHS="80,90a-real,100-virtual", SUPPORTED="sm_80,sm_90a,sm_100")
    assert rc == 0
    assert out == [gen(80, "sm_80"), gen(80, "compute_80"), gen("90a", "sm_90a"), gen(100, "compute_100")]


@pytest.mark.parametrize("archs, supported, message", [
    ("sm_90", "", r"entry 'sm_90' is not valid; allowed: NN .*NN-real .*NN-virtual"),
    ("90-ptx", "", r"entry '90-ptx' is not valid"),
    ("61-real", "", r"entry '61-real': the kernels need compute capability >= 70"),
    ("100-real", "sm_80,sm_90", r"entry '100-real': this CUDA compiler cannot build sm_100; it knows: sm_80 sm_90"),
])
def test_bad_archs_fail_naming_the_option(archs, supported, message):
    rc, _, err = cmake("flags", ARCHS=archs, SUPPORTED=supported)
    assert rc != 0
    assert "FUSETRAIN_CUDA_ARCHS" in err
    assert re.search(message, " ".join(err.split())), err


# What `nvcc --list-gpu-code` prints for CUDA 13.0: base architectures only, no sm_90a.
LISTED_13_0 = "sm_75,sm_80,sm_86,sm_87,sm_88,sm_89,sm_90,sm_100,sm_110,sm_103,sm_120,sm_121"


def fake_nvcc(tmp_path, buildable):
    """A stand-in for nvcc that accepts a --generate-code flag only for the sm_NN in `buildable` (as nvcc's
    --dryrun does for the architectures it knows) and logs each call."""
    path = tmp_path / "nvcc"
    path.write_text("#!/bin/sh\n"
                    f"echo \"$*\" >> {tmp_path / 'calls.txt'}\n"
                    "for a in \"$@\"; do case $a in\n"
                    + "".join(f"  *code=sm_{b}) exit 0;;\n" for b in buildable) +
                    "  --generate-code=*) exit 1;;\nesac; done\nexit 2\n")
    path.chmod(0o755)
    return str(path)


def test_arch_specific_entries_are_accepted_when_nvcc_builds_them(tmp_path):
    nvcc = fake_nvcc(tmp_path, ["90a", "100f"])
    rc, out, err = cmake("codes", NVCC=nvcc, ARCHS="90a-real,90-virtual,100f-real", SUPPORTED=LISTED_13_0)
    assert rc == 0, err
    assert out == [gen("90a", "sm_90a"), gen(90, "compute_90"), gen("100f", "sm_100f")]
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert len(calls) == 2 and "--dryrun" in calls[0], "only the suffixed entries are probed, without compiling"


def test_arch_specific_entries_nvcc_refuses_fail_naming_the_option(tmp_path):
    nvcc = fake_nvcc(tmp_path, ["90a"])
    rc, _, err = cmake("codes", NVCC=nvcc, ARCHS="90a-real,80a-real", SUPPORTED=LISTED_13_0)
    assert rc != 0
    assert re.search(r"FUSETRAIN_CUDA_ARCHS entry '80a-real': this CUDA compiler cannot build sm_80a",
                     " ".join(err.split())), err


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_installed_nvcc_builds_90a_although_it_lists_only_sm_90():
    nvcc = shutil.which("nvcc")
    listed = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True).stdout.split()
    if "sm_90" not in listed:
        pytest.skip(f"this nvcc does not build sm_90: {listed}")
    rc, out, err = cmake("codes", NVCC=nvcc, ARCHS="90a-real,90-virtual", SUPPORTED=",".join(listed))
    assert rc == 0, err
    assert out == [gen("90a", "sm_90a"), gen(90, "compute_90")]
    rc, _, err = cmake("codes", NVCC=nvcc, ARCHS="75a-real", SUPPORTED=",".join(listed))
    assert rc != 0 and "cannot build sm_75a" in " ".join(err.split())


def test_torch_gencode_flags_are_removed():
    flags = "-DONNX_NAMESPACE=onnx_c2 -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -Xcudafe x"
    rc, out, _ = cmake("strip", FLAGS=flags)
    assert rc == 0 and out == ["-DONNX_NAMESPACE=onnx_c2 -Xcudafe x"]


def _build_ninja():
    path = os.path.join(ROOT, "build", "py", "build.ninja")
    return path if os.path.exists(path) else None


@pytest.mark.skipif(not fusetrain.build_info()["cuda"] or _build_ninja() is None,
                    reason="needs this checkout built with CUDA in build/py (scripts/setup)")
def test_the_build_used_exactly_the_configured_archs():
    archs = fusetrain.build_info()["cuda_archs"].split(",")
    rc, expected, err = cmake("flags", ARCHS=",".join(archs), SUPPORTED="")
    assert rc == 0, err
    text = open(_build_ninja()).read()
    blocks = re.findall(r"^build [^\n]*csrc/cuda/(\w+)\.cu\.o:.*?\n((?:  .*\n)+)", text, re.M)
    assert blocks, "no CUDA objects in build.ninja"
    for name, body in blocks:
        flags = re.search(r"^  FLAGS = (.*)$", body, re.M).group(1).split()
        assert "-gencode" not in flags, f"{name}.cu: torch's -gencode flags leaked in"
        assert [f for f in flags if f.startswith("--generate-code")] == expected, name


def _cxx_objects(text):
    """{object: {DEFINES, FLAGS}} of every C++ compile in build.ninja (the precompiled headers' .gch included)."""
    out = {}
    for obj, body in re.findall(r"^build (\S+\.(?:o|gch)): CXX_COMPILER[^\n]*\n((?:  .*\n)+)", text, re.M):
        out[obj] = {k: v.strip() for k, v in re.findall(r"^  (DEFINES|FLAGS) = (.*)$", body, re.M)}
    return out


@pytest.mark.skipif(_build_ninja() is None, reason="needs this checkout built in build/py (scripts/setup)")
def test_a_precompiled_header_is_used_only_with_the_flags_it_was_built_with():
    # NOTE [precompiled headers] in CMakeLists.txt: the AVX2 kernels (CPU_CAPABILITY selects ATen's vector
    # code) and the lanes tests compile with flags of their own and parse torch's headers themselves.
    objects = _cxx_objects(open(_build_ninja()).read())
    for target in ("fusetrain_core", "fusetrain_cpp_tests"):
        pch = objects.get(f"CMakeFiles/{target}.dir/cmake_pch.hxx.gch")
        assert pch is not None, f"{target}: no precompiled header in build.ninja"
        include = f"-Winvalid-pch -include {os.path.join(ROOT, 'build', 'py')}/CMakeFiles/{target}.dir/cmake_pch.hxx"
        built_with = (pch["DEFINES"], pch["FLAGS"].replace(" -x c++-header", "").replace(include, "").strip())
        files = {o: v for o, v in objects.items() if o.startswith(f"CMakeFiles/{target}.dir/") and o.endswith(".o")}
        users = [o for o, v in files.items() if include in v["FLAGS"]]
        assert len(users) >= 5, (target, sorted(files))
        for obj, v in files.items():
            same = (v["DEFINES"], v["FLAGS"].replace(include, "").strip()) == built_with
            assert (obj in users) == same, (obj, v, built_with)


def _loaded_fusetrain_libraries():
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line}
    return sorted(p for p in paths if os.path.basename(p).startswith("libfusetrain_core") or
                  (os.path.basename(p).startswith("_C.") and os.path.basename(os.path.dirname(p)) == "fusetrain"))


@pytest.mark.skipif(shutil.which("nm") is None or not os.path.exists("/proc/self/maps"),
                    reason="needs nm (binutils) and /proc (Linux)")
def test_libraries_use_the_shared_cxx_runtime():
    # NOTE [one C++ runtime] in CMakeLists.txt: a static libstdc++ inside fusetrain's libraries has its own
    # locale and exception state (formatting an error message crashed the interpreter).
    libs = _loaded_fusetrain_libraries()
    assert any("libfusetrain_core" in os.path.basename(p) for p in libs), libs
    for lib in libs:
        r = subprocess.run(["nm", "-C", "--defined-only", lib], capture_output=True, text=True)
        if r.returncode != 0:  # a stripped library: its dynamic symbols
            r = subprocess.run(["nm", "-C", "-D", "--defined-only", lib], capture_output=True, text=True, check=True)
        own = [ln for ln in r.stdout.splitlines() if re.search(r" [TtWw] (std::locale::locale\(|__cxa_throw$)", ln)]
        assert not own, (f"{lib} holds its own copy of the C++ runtime (e.g. {own[:2]}); link it against the "
                         "shared libstdc++ (NOTE [one C++ runtime] in CMakeLists.txt)")
