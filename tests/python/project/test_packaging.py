"""Packaging: the native core refuses to load next to another torch than the
one it was built against (python/fusetrain/_torch_check.py, with the version
the build records in fusetrain._build_config), the console script, and the
optional logging dependencies (matplotlib, tqdm, tensorboard)."""

import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import types
import warnings

import pytest

from fusetrain import _torch_check as tc
from fusetrain.training.logging.experiment_log import ExperimentLogger
from fusetrain.training.logging.progress_bar import Progress as _Progress

from _test_helpers import REPO

OPTIONAL = ("matplotlib", "tqdm", "tensorboard")


def pyproject():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def run_python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)


# ---- torch version check ------------------------------------------------------


@pytest.mark.parametrize("version, expected", [
    ("2.11.0", (2, 11, 0)), ("2.11.0+cu130", (2, 11, 0)), ("2.12.0a0+git1f2e3d4", (2, 12, 0)),
    ("10.0.1.post2", (10, 0, 1)), ("2.11", None), ("nightly", None), ("", None),
])
def test_release_reads_major_minor_patch(version, expected):
    assert tc.release(version) == expected


@pytest.mark.parametrize("built, running, match", [
    ("2.11.0", "2.11.0", True),
    ("2.11.0+cu130", "2.11.0+cpu", True),      # the local tag alone does not decide
    ("2.11.0+cu130", "2.11.0", True),
    ("2.11.0", "2.11.1", False),
    ("2.11.0", "2.10.0", False),
    ("2.11.0", "3.11.0", False),
    ("custom", "custom", True),                 # no major.minor.patch: compared whole
    ("custom", "2.11.0", False),
])
def test_versions_match(built, running, match):
    assert tc.versions_match(built, running) is match


def test_mismatch_message_names_both_versions_and_the_fixes():
    msg = tc.mismatch_message("2.10.0+cu126", "2.11.0+cu130")
    assert "built against torch 2.10.0+cu126" in msg
    assert "installed torch is 2.11.0+cu130" in msg
    assert "bash scripts/setup" in msg
    assert "pip install --no-build-isolation" in msg
    assert "pip install torch==2.10.0" in msg
    assert "Loading the extension failed" not in msg
    cause = OSError("undefined symbol: _ZN3c10")
    assert "Loading the extension failed with: OSError: undefined symbol: _ZN3c10" in \
        tc.mismatch_message("2.10.0", "2.11.0", cause=cause)


def test_check_torch_raises_on_another_release_only():
    with pytest.raises(ImportError, match=r"built against torch 2\.10\.0(.|\n)*installed torch is 2\.11\.0"):
        tc.check_torch(built="2.10.0", running="2.11.0")
    tc.check_torch(built="2.11.0+cu130", running="2.11.0+cpu")  # same release: loading decides


def test_check_is_skipped_for_a_build_without_a_record(monkeypatch):
    monkeypatch.setitem(sys.modules, "fusetrain._build_config", None)  # import fails: an old build
    assert tc.built_torch_version() is None
    tc.check_torch(running="0.0.1")


def test_built_version_is_read_from_the_generated_module(monkeypatch):
    config = types.ModuleType("fusetrain._build_config")
    config.TORCH_VERSION = "2.9.1+cpu"
    monkeypatch.setitem(sys.modules, "fusetrain._build_config", config)
    assert tc.built_torch_version() == "2.9.1+cpu"
    with pytest.raises(ImportError, match="built against torch 2.9.1"):
        tc.check_torch()


def test_this_build_matches_the_running_torch():
    import torch

    built = tc.built_torch_version()  # None for a build from before the record existed
    assert built is None or tc.versions_match(built, str(torch.__version__))
    assert tc.load_native() is sys.modules["fusetrain._C"]
    if built is not None:  # installed next to _C (site-packages/fusetrain, editable or not)
        config = importlib.util.find_spec("fusetrain._build_config").origin
        assert os.path.dirname(config) == os.path.dirname(sys.modules["fusetrain._C"].__file__)


def test_a_failing_load_names_both_versions_when_they_differ(monkeypatch):
    monkeypatch.setattr(tc, "built_torch_version", lambda: "2.11.0+cpu")
    monkeypatch.setattr(tc, "_running_torch_version", lambda: "2.11.0+cu130")
    monkeypatch.setitem(sys.modules, "fusetrain._C", None)  # importing it now raises ImportError
    with pytest.raises(ImportError) as info:
        tc.load_native()
    msg = str(info.value)
    assert "built against torch 2.11.0+cpu" in msg and "installed torch is 2.11.0+cu130" in msg
    assert "Loading the extension failed with: ModuleNotFoundError" in msg
    assert isinstance(info.value.__cause__, ImportError)


def test_a_failing_load_with_the_same_torch_keeps_the_original_error(monkeypatch):
    monkeypatch.setattr(tc, "built_torch_version", lambda: "2.11.0+cu130")
    monkeypatch.setattr(tc, "_running_torch_version", lambda: "2.11.0+cu130")
    monkeypatch.setitem(sys.modules, "fusetrain._C", None)
    with pytest.raises(ImportError) as info:
        tc.load_native()
    assert "built against" not in str(info.value)
    assert "fusetrain._C" in str(info.value)


def test_import_fusetrain_fails_with_the_message_when_torch_differs():
    # A fresh interpreter whose recorded build version is not the running torch.
    code = ("import sys, types\n"
            "config = types.ModuleType('fusetrain._build_config')\n"
            "config.TORCH_VERSION = '1.0.0'\n"
            "sys.modules['fusetrain._build_config'] = config\n"
            "try:\n"
            "    import fusetrain\n"
            "except ImportError as e:\n"
            "    print(e)\n"
            "else:\n"
            "    sys.exit('fusetrain imported next to a torch it was not built for')\n")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "built against torch 1.0.0" in proc.stdout
    assert "bash scripts/setup" in proc.stdout


# ---- console script ---------------------------------------------------------------


def test_console_script_points_at_the_module_entry(monkeypatch, capsys):
    target = pyproject()["project"]["scripts"]["fusetrain-train"]
    module, _, attr = target.partition(":")
    entry = getattr(importlib.import_module(module), attr)
    monkeypatch.setattr(sys, "argv", ["fusetrain-train", "--list"])
    assert entry() == 0
    assert "default" in capsys.readouterr().out.split()


def test_installed_console_script_matches_pyproject():
    scripts = [ep for ep in importlib.metadata.entry_points(group="console_scripts") if ep.name == "fusetrain-train"]
    if not scripts:
        pytest.skip("the installed fusetrain predates the console script (reinstall: bash scripts/setup)")
    assert scripts[0].value == pyproject()["project"]["scripts"]["fusetrain-train"]


# ---- optional logging dependencies ------------------------------------------------------


def test_logging_packages_are_an_extra_not_requirements():
    project = pyproject()["project"]
    required = " ".join(project["dependencies"])
    extra = " ".join(project["optional-dependencies"]["logging"])
    for name in OPTIONAL:
        assert name not in required
        assert name in extra


def test_fusetrain_imports_without_the_optional_packages():
    code = ("import sys\n"
            f"for name in {OPTIONAL!r} + ('torch.utils.tensorboard',):\n"
            "    sys.modules[name] = None  # import raises ImportError\n"
            "import fusetrain, fusetrain.train_from_recipe, fusetrain.training.trainer\n"
            "print('ok')\n")
    proc = run_python(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_no_tqdm_warns_and_runs_without_a_bar(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.warns(UserWarning, match="tqdm is not installed"):
        progress = _Progress(True, 3, "epoch 1/1")
    assert progress.bar is None
    progress.first_step_done()
    progress.update(loss=0.5)
    progress.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _Progress(False, 3, "epoch 1/1").bar is None  # not asked for: no warning


def test_no_matplotlib_skips_the_plot_with_a_warning(tmp_path, monkeypatch):
    # The submodules too: another test in the same process may have imported them already.
    for name in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    logger = ExperimentLogger(str(tmp_path), tensorboard=False)
    logger.log_epoch({"epoch": 1, "train_loss": 0.5})
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        assert logger.plot() == ""
    assert sorted(os.listdir(tmp_path)) == ["metrics.csv", "metrics.jsonl"]


def test_no_tensorboard_warns_and_logs_the_rest(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    logger = ExperimentLogger(str(tmp_path), tensorboard=True)
    with pytest.warns(UserWarning, match="tensorboard is not installed"):
        logger.log_epoch({"epoch": 1, "train_loss": 0.5})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: no retry, no second warning
        logger.log_epoch({"epoch": 2, "train_loss": 0.25})
    logger.close()
    assert sorted(os.listdir(tmp_path)) == ["metrics.csv", "metrics.jsonl"]
    with open(tmp_path / "metrics.jsonl") as f:
        assert len(f.readlines()) == 2
