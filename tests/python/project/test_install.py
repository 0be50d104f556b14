"""A normal install: the licence and its metadata, requirements that are what
training needs at run time (extras for the rest, and an import of a missing
optional package that names its extra), the oldest torch declared once and
refused by the build before anything compiles, a local build that compiles
CUDA code only for the machine's GPUs, and scripts/setup, which installs torch
only where there is none and never replaces an installed one.

The end-to-end check (a fresh virtual environment with only torch: `pip
install --no-build-isolation .`, then the `recipes` extra and the default
recipe) downloads packages and builds for minutes; it is not a test of the
suite."""

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from fusetrain._optional import EXTRAS, MissingExtra, require

from _test_helpers import REPO

CMAKE = shutil.which("cmake")
SCRIPT = os.path.join(REPO, "tests", "cmake", "torch_version.cmake")


def pyproject():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def names(requirements):
    return {re.split(r"[<>=!~\[ ;]", r)[0].lower() for r in requirements}


# ---- licence ------------------------------------------------------------------------------------------------------

def test_the_licence_is_apache_2_and_the_metadata_says_so():
    text = open(os.path.join(REPO, "LICENSE")).read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    project = pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License 2.0" in open(os.path.join(REPO, "README.md")).read()


# ---- requirements and extras -------------------------------------------------------------------------------------

def test_requirements_are_what_training_needs_at_run_time():
    project = pyproject()["project"]
    assert names(project["dependencies"]) == {"torch", "numpy"}
    torch_req = next(r for r in project["dependencies"] if r.startswith("torch"))
    assert re.fullmatch(r"torch>=\d+\.\d+", torch_req), "the oldest torch, declared once (CMake and setup read it)"
    extras = project["optional-dependencies"]
    assert {"recipes", "detection", "export", "logging", "test", "dev"} <= set(extras)
    for tool in ("pytest", "timm", "onnx", "pycocotools", "hydra-core", "scikit-learn"):
        assert tool not in names(project["dependencies"])


def test_each_optional_module_names_an_extra_that_lists_its_package():
    extras = pyproject()["project"]["optional-dependencies"]
    for module, (package, extra) in EXTRAS.items():
        assert package in names(extras[extra]), (module, package, extra)


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "hydra", None)
    with pytest.raises(MissingExtra, match=r"the recipes needs hydra-core, which is not installed .*"
                                           r"pip install 'fusetrain\[recipes\]' \(or pip install hydra-core\)"):
        require("hydra", "the recipes")
    assert issubclass(MissingExtra, ImportError)


#: (modules made unimportable, code that uses the feature, the extra its error names)
FEATURES = [
    (["hydra", "omegaconf"], "from fusetrain.train_from_recipe import main; sys.exit(main(['--print-config']))",
     "recipes"),
    (["sklearn", "sklearn.datasets"],
     "from fusetrain.training.data.classification import digits_dataset; digits_dataset(True)", "recipes"),
    (["PIL", "PIL.Image"], "from fusetrain.training.data.images import read_image; read_image('x.png')", "recipes"),
    (["torchmetrics", "torchmetrics.detection", "pycocotools"],
     "from fusetrain.training.task.metrics import build_metric; build_metric('map')", "detection"),
    (["torchvision", "torchvision.ops"],
     "import torch; from fusetrain.models.detection import decode_dense_detections; "
     "decode_dense_detections(torch.zeros(1, 84, 15), 32, 32)", "detection"),
    (["yaml"], "from fusetrain.compat.super_gradients.recipe import split_overrides; split_overrides([])", "recipes"),
]


@pytest.mark.slow
@pytest.mark.parametrize("blocked, code, extra", FEATURES, ids=[f[2] + ":" + f[0][0] for f in FEATURES])
def test_a_feature_without_its_package_names_the_extra(tmp_path, blocked, code, extra):
    script = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked) + code + "\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert f"pip install 'fusetrain[{extra}]'" in out, out[-3000:]


def test_fusetrain_imports_with_only_torch_and_numpy():
    blocked = sorted(set(EXTRAS) | {"hydra", "omegaconf", "torchvision", "torchmetrics"})
    code = ("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked) +
            "import torch, fusetrain\n"
            "p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.ones(4)\n"
            "fusetrain.optim.AdamW([p], lr=0.1).step()\n"
            "assert p.detach().lt(1).all()\n"
            "import fusetrain.training, fusetrain.training.params, fusetrain.compat.super_gradients\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


# ---- the build: torch version, local architectures -----------------------------------------------------------------

def cmake(tmp_path, action, **defs):
    args = [CMAKE, f"-DACTION={action}"] + [f"-D{k}={v}" for k, v in defs.items()] + ["-P", SCRIPT]
    r = subprocess.run(args, capture_output=True, text=True)
    m = re.search(r"RESULT=(.*)", r.stdout)
    return r.returncode, (m.group(1).split("|") if m and m.group(1) else []), " ".join(r.stderr.split())


@pytest.mark.skipif(CMAKE is None, reason="needs cmake")
@pytest.mark.parametrize("found, ok", [("2.11.0", True), ("2.11.0+cu130", True), ("2.12.1+cpu", True),
                                       ("3.0.0", True), ("2.10.0+cu128", False), ("2.4.1", False)])
def test_the_build_refuses_a_torch_older_than_pyproject_requires(tmp_path, found, ok):
    rc, out, err = cmake(tmp_path, "torch", FOUND=found, PYPROJECT=os.path.join(REPO, "pyproject.toml"))
    if ok:
        assert rc == 0 and out == ["ok"], err
    else:
        assert rc != 0
        assert f"the installed torch is {found}, and fusetrain needs torch >= 2.11" in err
        assert "never replaces it" in err and "pip install torch==2.11.0" in err


@pytest.mark.skipif(CMAKE is None, reason="needs cmake")
def test_the_minimum_is_read_from_pyproject(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\ndependencies = [\n  "torch>=2.12",\n  "numpy",\n]\n')
    rc, _, err = cmake(tmp_path, "torch", FOUND="2.11.0", PYPROJECT=str(tmp_path / "pyproject.toml"))
    assert rc != 0 and "fusetrain needs torch >= 2.12" in err


def fake_python(tmp_path, caps):
    """An interpreter stand-in whose torch sees GPUs of these compute capabilities."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\necho '{';'.join(caps)}'\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.skipif(CMAKE is None, reason="needs cmake")
@pytest.mark.parametrize("caps, archs", [([], []), (["90"], ["90-real"]), (["80", "90"], ["80-real", "90-real"]),
                                         (["61", "86"], ["86-real"])])
def test_a_local_build_compiles_for_the_machine_s_gpus_only(tmp_path, caps, archs):
    rc, out, err = cmake(tmp_path, "local", PYTHON=fake_python(tmp_path, caps))
    assert rc == 0 and out == archs, err
    if "61" in caps:
        assert "compute capability 61 is left out" in err


@pytest.mark.skipif(CMAKE is None, reason="needs cmake")
def test_this_machine_s_gpus_as_torch_sees_them(tmp_path):
    import torch

    rc, out, _ = cmake(tmp_path, "local", PYTHON=sys.executable)
    caps = sorted({f"{a}{b}-real" for a, b in (torch.cuda.get_device_capability(i)
                                               for i in range(torch.cuda.device_count()))})
    assert rc == 0 and out == caps


def test_wheels_and_ci_keep_their_architecture_lists():
    wheel = open(os.path.join(REPO, "scripts", "build-wheel")).read()
    assert 'FUSETRAIN_CUDA_ARCHS="${ARCHS:-all}"' in wheel
    assert "FUSETRAIN_CUDA_ARCHS=${FUSETRAIN_CUDA_ARCHS:-75-real}" in open(os.path.join(REPO, ".ci", "run")).read()
    cmakelists = open(os.path.join(REPO, "CMakeLists.txt")).read()
    assert 'FUSETRAIN_CUDA_ARCHS_RESOLVED STREQUAL "all"' in cmakelists


# ---- scripts/setup ------------------------------------------------------------------------------------------------

def setup_env(tmp_path, torch_version):
    """A PYTHON for scripts/setup: the real interpreter with a stand-in torch of ``torch_version`` (None: no
    torch), whose pip only logs what it is asked to install."""
    fake = tmp_path / "site"
    (fake / "torch").mkdir(parents=True)
    body = (f"__version__ = {torch_version!r}\n" if torch_version
            else "raise ImportError('no torch here')\n")
    (fake / "torch" / "__init__.py").write_text(body)
    log = tmp_path / "pip.log"
    py = tmp_path / "python3"
    py.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
          shift 2
          echo "pip $*" >> {log}
          for a in "$@"; do case $a in -c) c=1;; *) [ -n "$c" ] && cat "$a" >> {log}; c=;; esac; done
          exit 1
        fi
        PYTHONPATH={fake} exec {sys.executable} "$@"
        """))
    py.chmod(0o755)
    env = dict(os.environ, PYTHON=str(py), FUSETRAIN_CUDA="OFF")
    return env, log


def run_setup(env, *args):
    return subprocess.run(["bash", os.path.join(REPO, "scripts", "setup"), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_setup_refuses_an_older_torch_without_replacing_it(tmp_path):
    env, log = setup_env(tmp_path, "2.10.0+cu128")
    proc = run_setup(env)
    assert proc.returncode == 2
    assert "torch 2.10.0+cu128" in proc.stderr and "does not replace" in proc.stderr
    assert "pip install torch==2.11.0" in proc.stderr
    assert not log.exists(), "pip was called"


def test_setup_installs_torch_only_where_there_is_none(tmp_path):
    env, log = setup_env(tmp_path, None)
    run_setup(env)  # the stand-in pip fails, which stops the script after its first call
    assert log.read_text().splitlines()[0] == "pip install -q torch==2.11.0"


def test_setup_keeps_an_installed_torch(tmp_path):
    env, log = setup_env(tmp_path, "2.11.0+cu130")
    proc = run_setup(env)
    assert "using the installed torch 2.11.0+cu130" in proc.stdout
    calls = log.read_text().splitlines()
    assert calls, "the build's pip call is missing"
    for line in calls:
        if line.startswith("pip install"):
            assert not re.search(r"\storch(==|\s|$)", line), line  # torch is never a requirement of a call
    if any("-c" in line.split() for line in calls):
        assert "torch==2.11.0" in calls, "the packages are resolved against the installed torch"
    assert any("--no-build-isolation --no-deps -e ." in line for line in calls)


def test_setup_installs_the_test_tools_only_with_dev():
    text = open(os.path.join(REPO, "scripts", "setup")).read()
    run = re.search(r"RUN_DEPS=\((.*?)\)", text, re.S).group(1)
    dev = re.search(r"DEV_DEPS=\((.*?)\)", text, re.S).group(1)
    extras = pyproject()["project"]["optional-dependencies"]
    pinned = lambda block: {re.sub(r"==.*", "", s).lower() for s in re.findall(r'"([^"]+)"', block)}
    assert names(extras["recipes"]) | names(extras["logging"]) == pinned(run)
    test_tools = {n for n in names(extras["test"]) if n != "fusetrain"} | names(extras["detection"]) | \
        names(extras["export"])
    assert test_tools == pinned(dev)
    assert "pytest" not in run and "libgtest-dev" in text
    assert re.search(r"bash scripts/setup --dev", open(os.path.join(REPO, "scripts", "test")).read())


def test_setup_refuses_an_unknown_argument():
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "setup"), "--tests"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown argument '--tests'" in proc.stderr
