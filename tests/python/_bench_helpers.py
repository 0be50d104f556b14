"""Shared by the benchmark smoke tests: where the scripts are, the devices to
run them on, loading a script as a module, and a ``--quick`` run of a script
that writes its JSON report to a temporary path (never over the committed
results)."""

import importlib.util
import json
import os
import subprocess
import sys

from _test_helpers import DEVICES, REPO  # noqa: F401  (DEVICES: re-exported to the smoke tests)


def script_path(name: str) -> str:
    return os.path.join(REPO, "benchmarks", f"{name}.py")


def load_script(name: str):
    """benchmarks/<name>.py as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", script_path(name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def quick_run(name: str, tmp_path, device: str, *extra_args: str):
    """Run ``python benchmarks/<name>.py --quick --device <device> <extra_args>
    --out <tmp>`` from the repository root; check that it exits 0 and prints
    its target verdicts; return the process and the JSON report."""
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, script_path(name), "--quick", "--device", device, *extra_args,
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TARGET" in proc.stdout
    return proc, json.loads(out.read_text())
