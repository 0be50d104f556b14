"""The scripts that build a wheel and run the GPU checks from it, checked on
the CPU without building anything: scripts/build-wheel refuses bad arguments
before it installs or compiles, scripts/gpu-check --dry-run names what is
missing, its limits and stages are checked, a rehearsal cut off by its limits
still writes its report, and the report reads real pytest output."""

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest

from _test_helpers import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import gpu_check_report as report  # noqa: E402

BUILD_WHEEL = os.path.join(REPO, "scripts", "build-wheel")
GPU_CHECK = os.path.join(REPO, "scripts", "gpu-check")


def run(cmd, env=None, timeout=120):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


# ---- scripts/build-wheel: argument checking ---------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--out"], "--out needs a value"),
    (["--max-mib", "x"], "--max-mib 'x' is not a positive whole number"),
    (["--max-mib", "0"], "--max-mib '0' is not a positive whole number"),
    (["--python", "3.99"], "--python 3.99: no Python 3.99 under"),
    (["--python", "/nonexistent/python3"], "--python '/nonexistent/python3' is neither a Python version"),
])
def test_build_wheel_refuses_bad_arguments(args, message):
    r = run([BUILD_WHEEL] + args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr
    assert "[build-wheel] building" not in r.stdout


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
@pytest.mark.parametrize("archs, message", [
    ("90a-real;61-real", "entry '61-real': the kernels need compute capability >= 70"),
    ("sm_90", "entry 'sm_90' is not valid"),
])
def test_build_wheel_checks_the_archs_before_installing(archs, message):
    r = run([BUILD_WHEEL, "--python", sys.executable, "--archs", archs])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "FUSETRAIN_CUDA_ARCHS" in r.stderr and message in r.stderr
    assert f"--archs '{archs}' refused" in r.stderr
    assert "installing" not in r.stdout


def test_build_wheel_reads_the_torch_pin_scripts_setup_assigns():
    # build-wheel installs (or checks) the torch that scripts/setup pins: the value, not its comment.
    setup = [shlex.split(line, comments=True) for line in open(os.path.join(REPO, "scripts", "setup"))
             if line.startswith("TORCH_VERSION=")]
    assert len(setup) == 1 and len(setup[0]) == 1, setup
    pinned = setup[0][0].split("=", 1)[1]
    line = [ln for ln in open(BUILD_WHEEL) if ln.startswith("TORCH_VERSION=")]
    assert len(line) == 1, line
    r = run(["bash", "-c", line[0] + 'printf "%s" "$TORCH_VERSION"'])
    assert r.returncode == 0 and r.stdout == pinned, (r.stdout, r.stderr, pinned)


def test_build_wheel_help_lists_its_options():
    r = run([BUILD_WHEEL, "--help"])
    assert r.returncode == 0
    for option in ("--python", "--archs", "--with-tests", "--out", "--max-mib"):
        assert option in r.stdout


# ---- scripts/gpu-check: what it refuses without a GPU -------------------------------------------


def test_dry_run_without_a_wheel_says_how_to_build_one(tmp_path):
    deps = tmp_path / "deps"
    deps.mkdir()
    r = run([GPU_CHECK, "--dry-run"], env={"GPU_CHECK_WHEELS": str(tmp_path / "none"), "GPU_CHECK_DEPS": str(deps)})
    assert r.returncode == 1
    assert f"no folder {tmp_path / 'none'}" in r.stderr
    assert "scripts/build-wheel --with-tests" in r.stderr
    assert "no wheel of hydra-core==1.3.8" in r.stderr and "scripts/gpu-check --fetch-wheels" in r.stderr
    assert r.stderr.rstrip().endswith("gpu-check --dry-run: FAILED")


def test_dry_run_with_an_empty_wheel_folder_counts_the_wheels(tmp_path):
    (tmp_path / "fusetrain-0.1.0-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    r = run([GPU_CHECK, "--dry-run"], env={"GPU_CHECK_WHEELS": str(tmp_path), "GPU_CHECK_DEPS": str(tmp_path)})
    assert r.returncode == 1
    assert "holds 0 fusetrain wheels for cp312 (want 1)" in r.stderr
    assert f"no {tmp_path}/fusetrain_cpp_tests" in r.stderr


@pytest.mark.parametrize("args, env, message", [
    (["bench", "bogus"], {}, "'bogus' is neither a stage (seed tests sanitize bench profile scale) nor an item of --list"),
    (["--bogus"], {}, "unknown option '--bogus'"),
    (["--list"], {"GPU_CHECK_LIMITS": "optim_stepp=30"}, "GPU_CHECK_LIMITS entry 'optim_stepp=30' is not ITEM=SECONDS"),
    (["--list"], {"GPU_CHECK_LIMITS": "optim_step=3m"}, "GPU_CHECK_LIMITS entry 'optim_step=3m'"),
    (["--list"], {"GPU_CHECK_SECONDS": "9m"}, "GPU_CHECK_SECONDS='9m' is not a number of seconds"),
])
def test_gpu_check_refuses_bad_stages_and_limits(args, env, message):
    r = run([GPU_CHECK] + args, env=env)
    assert r.returncode == 2
    assert message in r.stderr


def test_list_names_every_stage_in_order_with_the_limits_given():
    r = run([GPU_CHECK, "--list"], env={"GPU_CHECK_LIMITS": "optim_step=33"})
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()]
    stages = [row[0] for row in rows]
    assert stages == sorted(stages, key=["seed", "tests", "sanitize", "bench", "profile", "scale"].index)
    assert {row[1] for row in rows} >= {"seed_mnist_amp", "seed_compile_table_ddrnet", "trainer_overhead", "pytest_cuda",
                                        "cpp_tests", "memcheck_ops", "memcheck_captured_steps", "optim_step",
                                        "step_host_time", "amp_ema_step", "optim_family", "ncu_update_int8",
                                        "ncu_update_bf16", "ncu_update_fp32", "optim_memory_host", "optim_memory_ema"}
    assert ["optim_step", "33s"] == [row for row in rows if row[1] == "optim_step"][0][1:3]


def test_list_takes_stages_and_items_and_names_an_unknown_one():
    r = run([GPU_CHECK, "--list", "seed_mnist_amp", "bench"])
    assert r.returncode == 0, r.stderr
    names = [line.split()[1] for line in r.stdout.splitlines()]
    assert names[0] == "seed_mnist_amp" and "optim_step" in names and "pytest_cuda" not in names
    r = run([GPU_CHECK, "--list", "seed_mnist"])
    assert r.returncode == 2 and "'seed_mnist' is neither a stage" in r.stderr


@pytest.mark.slow
def test_rehearsal_cut_off_by_its_limits_still_writes_the_report(tmp_path):
    # A limit of 1 s cuts the first items off, the deadline a later one; the report still comes out.
    env = {"GPU_CHECK_OUT": str(tmp_path), "GPU_CHECK_WHEELS": str(tmp_path / "none"), "GPU_CHECK_SECONDS": "30",
           "GPU_CHECK_LIMITS": "pytest_cuda_lean=1,pytest_cuda_q8_forms=1,pytest_cuda=1"}
    r = run([GPU_CHECK, "--cpu-rehearsal", "tests", "bench"], env=env, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    result = json.loads((tmp_path / "gpu_check_cpu.json").read_text())
    assert result["rehearsal"] and result["complete"] and result["device"] is None
    status = {item["name"]: item["status"] for item in result["stages"]}
    assert status["pytest_cuda_lean"] == status["pytest_cuda_q8_forms"] == status["pytest_cuda"] == "TIMEOUT after 1s"
    assert status["cpp_tests"] == "SKIPPED (no C++ test binary)"
    assert any(s == "SKIPPED (deadline)" for name, s in status.items() if name in ("optim_family", "amp_ema_step"))
    assert result["stages"][0]["tests"]["complete"] is False
    assert (tmp_path / "summary.txt").read_text().count("TIMEOUT") >= 1
    assert (tmp_path / "gpu-check.tar.gz").exists()


# ---- the report ---------------------------------------------------------------------------------

SAMPLE_TESTS = textwrap.dedent("""
    import pytest

    def test_ok():
        pass

    @pytest.mark.parametrize("x", [1, 2])
    def test_param(x):
        assert x == 1

    @pytest.mark.skip(reason="not here")
    def test_skipped():
        pass
""")


def test_pytest_counts_read_a_real_verbose_log(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    r = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "test_sample.py"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    counts = report.pytest_counts(r.stdout)
    assert (counts["passed"], counts["failed"], counts["skipped"], counts["complete"]) == (2, 1, 1, True)
    assert counts["failed_tests"] == ["test_sample.py::test_param[2]"]
    # Cut off before the summary: counted from the lines of the finished tests.
    cut = "\n".join(line for line in r.stdout.splitlines() if "test_skipped" not in line and not line.startswith("="))
    counts = report.pytest_counts(cut)
    assert (counts["passed"], counts["failed"], counts["skipped"], counts["complete"]) == (2, 1, 0, False)


def test_xdist_lines_and_gtest_and_sanitizer_logs():
    xdist = ("[gw0] [ 50%] PASSED tests/python/test_a.py::test_x[cuda]\n"
             "[gw1] [100%] FAILED tests/python/test_a.py::test_y[cuda]\n")
    counts = report.pytest_counts(xdist)
    assert (counts["passed"], counts["failed"], counts["complete"]) == (1, 1, False)
    gtest = ("[ RUN      ] GradStats.FlagsInfAndNaN\n[       OK ] GradStats.FlagsInfAndNaN (3 ms)\n"
             "[ RUN      ] Devices/FusedAdam.Fp32/cuda\n[  FAILED  ] Devices/FusedAdam.Fp32/cuda (1 ms)\n"
             "[  SKIPPED ] CaptureCuda.Replays (0 ms)\n[==========] 3 tests from 3 test suites ran. (5 ms total)\n"
             "[  FAILED  ] Devices/FusedAdam.Fp32/cuda\n")
    counts = report.gtest_counts(gtest)
    assert (counts["passed"], counts["failed"], counts["skipped"], counts["complete"]) == (1, 1, 1, True)
    assert counts["failed_tests"] == ["Devices/FusedAdam.Fp32/cuda"]
    memcheck = ("========= COMPUTE-SANITIZER\n========= Invalid __global__ write of size 4 bytes\n"
                "=========     at fused_update_kernel+0x1a0\n========= ERROR SUMMARY: 1 error\n")
    assert report.sanitizer_findings(memcheck) == {"findings": 1, "first": ["Invalid __global__ write of size 4 bytes"]}
    racecheck = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    assert report.sanitizer_findings(racecheck)["findings"] == 0
    assert report.sanitizer_findings("killed before the end\n")["findings"] is None


def test_profile_items_keep_the_kernels_headline_figures():
    ncu = ("==PROF== Connected to process 4242\n"
           "  void fused_update_q8_kernel<...>(Q8Meta, KernelArgs, int) (1280, 1, 1)x(512, 1, 1), Device 0, CC 9.0\n"
           "    Section: GPU Speed Of Light Throughput\n"
           "    ----------------------- ----------- ------------\n"
           "    DRAM Frequency                  Ghz         2.62\n"
           "    Duration                         ms         2.04\n"
           "    DRAM Throughput                   %        31.52\n"
           "    Registers Per Thread    register/thread             128\n"
           "    Achieved Occupancy                %        24.61\n"
           "    Duration                         us        12.00\n")
    assert report.ncu_metrics(ncu) == {"Duration": "2.04 ms", "DRAM Throughput": "31.52 %",
                                       "Registers Per Thread": "128 register/thread", "Achieved Occupancy": "24.61 %"}
    assert report.ncu_metrics("==ERROR== Failed to initialize the profiler\n") == {}


def test_source_profile_names_the_most_stalled_instructions(tmp_path):
    page = ('==PROF== Disconnected from process 4242\n'
            '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"\n'
            '"0x7f00","LDG.E.128 R4, desc[UR6][R2.64]","1,200","900"\n'
            '"0x7f10","IMAD R5, R4, 0x7feb352d, RZ","300","100"\n'
            '"0x7f20","MUFU.RSQ R7, R6","500","400"\n'
            '"0x7f30","NOP","",""\n')
    hot = report.ncu_source_hotspots(page, top=2)
    assert [(h["address"], h["instruction"], h["share_pct"]) for h in hot] == [
        ("0x7f00", "LDG.E.128 R4, desc[UR6][R2.64]", 60.0), ("0x7f20", "MUFU.RSQ R7, R6", 25.0)]
    assert report.ncu_source_hotspots("==ERROR== no report\n") == []
    # In a run's logs the item's CSV lands in its report, and its summary line names the top ones.
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "info.json").write_text(json.dumps({"device": "NVIDIA H200", "versions": {}}))
    (logs / "items.tsv").write_text("profile\tncu_update_int8_source\tprofile\tok\t0\t20\t60\t\n")
    (logs / "ncu_update_int8_source.log").write_text("    Duration                         us       217.60\n")
    (logs / "ncu_update_int8_source.csv").write_text(page)
    built = report.build_report(str(logs), final=True)
    assert built["stages"][0]["hotspots"][0]["share_pct"] == 60.0
    assert "most stalled: 0x7f00 LDG.E.128" in report.summary_lines(built)[1]


@pytest.mark.parametrize("name, slug", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"), (None, "cpu")])
def test_device_slug(name, slug):
    assert report.device_slug(name) == slug


# ---- the wheel's build record ------------------------------------------------------------------


def _wheel_like_the_tree(path, skip=None):
    """A zip holding this tree's Python package as a wheel does, the native members by name only, and a build
    record of this tree's native sources."""
    import zipfile

    import wheel_record

    with zipfile.ZipFile(path, "w") as z:
        for rel in wheel_record._files([wheel_record.PACKAGE]):
            name = "fusetrain/" + rel[len(wheel_record.PACKAGE) + 1:]
            if rel.endswith(".py") and name != skip:
                z.write(os.path.join(REPO, rel), name)
        for name in ("fusetrain/_C.cpython-312-x86_64-linux-gnu.so", "fusetrain/libfusetrain_core.so",
                     "fusetrain/_build_config.py", "fusetrain-0.1.0.dist-info/licenses/LICENSE"):
            z.writestr(name, b"")
    with open(wheel_record.record_path(str(path)), "w") as f:
        json.dump(wheel_record.snapshot(), f)


def test_a_wheel_of_this_tree_is_fresh_and_one_missing_a_file_is_stale(tmp_path):
    import wheel_record

    wheel = tmp_path / "fusetrain-0.1.0-cp312-cp312-linux_x86_64.whl"
    _wheel_like_the_tree(wheel)
    assert wheel_record.check_contents(str(wheel)) == []
    assert wheel_record.stale_files(str(wheel)) == []
    _wheel_like_the_tree(wheel, skip="fusetrain/amp.py")
    assert wheel_record.stale_files(str(wheel)) == ["python/fusetrain/amp.py"]
    record = json.loads(open(wheel_record.record_path(str(wheel))).read())
    record["native_sources"]["csrc/ops/gone.cpp"] = "0" * 16
    with open(wheel_record.record_path(str(wheel)), "w") as f:
        json.dump(record, f)
    r = run([sys.executable, "scripts/wheel_record.py", "check-fresh", str(wheel)])
    assert r.returncode == 1
    assert "rebuild it with scripts/build-wheel" in r.stderr
    assert "csrc/ops/gone.cpp" in r.stderr and "python/fusetrain/amp.py" in r.stderr


def test_a_wheel_without_the_native_core_is_refused(tmp_path):
    import zipfile

    wheel = tmp_path / "fusetrain-0.1.0-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fusetrain/__init__.py", b"")
        z.writestr("fusetrain/_build_config.py", b"")
    r = run([sys.executable, "scripts/wheel_record.py", "contents", str(wheel)])
    assert r.returncode == 1
    assert r"fusetrain/_C\.cpython" in r.stderr and r"libfusetrain_core\.so" in r.stderr
    assert "licenses/LICENSE" in r.stderr, "the licence travels with the wheel"
    assert "_build_config" not in r.stderr


def test_report_merges_the_calls_of_one_session(tmp_path):
    """Two calls' tarballs unpacked side by side: one report, the second call's rerun of an item under its
    own name, the first call's cut-off try as <name>_call1, each benchmark report read from its own call."""
    def call(n, lines, results):
        root = tmp_path / f"call{n}"
        logs = root / "build" / "gpu-check-logs"
        logs.mkdir(parents=True)
        (logs / "info.json").write_text(json.dumps({"device": "NVIDIA H200", "versions": {"torch": "2.11.0"},
                                                    "started_utc": f"2026-11-28T1{n}:00:00Z"}))
        (logs / "items.tsv").write_text("".join("\t".join(line) + "\n" for line in lines))
        (root / "benchmarks" / "results").mkdir(parents=True)
        for name, body in results.items():
            (root / "benchmarks" / "results" / name).write_text(json.dumps(body))
        return str(logs)

    result = "benchmarks/results/optim_memory_cuda.json"
    first = call(1, [["tests", "pytest_cuda_lean", "pytest", "ok", "0", "30", "60", ""],
                     ["sanitize", "memcheck_ops", "sanitize-pytest", "TIMEOUT after 40s", "124", "40", "40", ""],
                     ["bench", "optim_memory", "bench", "TIMEOUT after 40s", "124", "40", "40", result]], {})
    logs1 = tmp_path / "call1" / "build" / "gpu-check-logs"
    (logs1 / "pytest_cuda_lean.log").write_text("===== 65 passed in 30.00s =====\n")
    (logs1 / "memcheck_ops.log").write_text("killed before the end\n")
    second = call(2, [["sanitize", "memcheck_ops", "sanitize-pytest", "ok", "0", "50", "60", ""],
                      ["bench", "optim_memory", "bench", "ok", "0", "70", "90", result]],
                  {"optim_memory_cuda.json": {"all_targets_met": False}})
    (tmp_path / "call2" / "build" / "gpu-check-logs" / "memcheck_ops.log").write_text(
        "========= ERROR SUMMARY: 0 errors\n")
    out = tmp_path / "out"
    out.mkdir()
    assert report.main([first, second, str(out), "--final"]) == 0
    merged = json.loads((out / "gpu_check_h200.json").read_text())
    assert merged["calls"] == 2 and merged["started_utc"] == "2026-11-28T11:00:00Z"
    assert [(i["name"], i["call"], i["status"]) for i in merged["stages"]] == [
        ("pytest_cuda_lean", 1, "ok"), ("memcheck_ops_call1", 1, "TIMEOUT after 40s"),
        ("optim_memory_call1", 1, "TIMEOUT after 40s"), ("memcheck_ops", 2, "ok"), ("optim_memory", 2, "ok")]
    assert merged["tests"]["passed"] == 65
    assert merged["sanitizer_findings"] == 0  # the cut first try (no summary) is superseded
    assert merged["benchmarks_all_targets_met"] == {"optim_memory_call1": None, "optim_memory": False}
    # A folder that is not there is named, and nothing is written.
    assert report.main([first, str(tmp_path / "call3" / "logs"), str(tmp_path / "none")]) == 2
    assert not (tmp_path / "none").exists()


def test_report_reads_only_benchmark_reports_written_by_this_run(tmp_path):
    logs, results = tmp_path / "logs", tmp_path / "results"
    logs.mkdir()
    results.mkdir()
    old, new = results / "optim_step_cuda.json", results / "amp_ema_step_cuda.json"
    old.write_text(json.dumps({"all_targets_met": False}))
    os.utime(old, (1_000_000, 1_000_000))  # from an earlier run
    (logs / "info.json").write_text(json.dumps({"device": "NVIDIA H200", "versions": {"torch": "2.11.0+cu130"}}))
    new.write_text(json.dumps({"targets": [{"name": "step", "met": True}, {"name": "ema", "met": None}]}))
    (logs / "items.tsv").write_text(f"bench\toptim_step\tbench\tTIMEOUT after 20s\t124\t20\t20\t{old}\n"
                                    f"bench\tamp_ema_step\tbench\tok\t0\t12\t20\t{new}\n")
    assert report.main([str(logs), str(tmp_path), "--final"]) == 0
    result = json.loads((tmp_path / "gpu_check_h200.json").read_text())
    assert result["device"] == "NVIDIA H200" and result["complete"]
    assert result["benchmarks_all_targets_met"] == {"optim_step": None, "amp_ema_step": True}
    assert [item["limit_s"] for item in result["stages"]] == [20, 20]
