"""Commands work as documented: every shell command shown in README.md and docs/
(fenced ```bash / ```sh blocks) falls in one class below. The commands one CPU
machine can run are run as written in a fresh directory, shortened to one
short epoch (a recipe run, the learning-rate plot, the export, the C++ prefix,
a CPU ddp run); the rest are parsed and validated: recipes that need GPUs,
several nodes or external data are composed and their training_params,
arch_params validated; pip commands name a path and extras that exist; scripts
exist, parse and take the options shown; pytest markers are registered. A
command no class knows fails the collection test, naming its file and line.
The README's and docs/optimizers.md's Python snippets run as written (the
guides' are run by test_docs_guides.py). Launch templates (a block starting
with #!) are run by tests/python/training/test_launch_templates.py."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from _test_helpers import REPO

DOCS = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(REPO, "docs"))
                              if f.endswith(".md")) + sorted(
    os.path.join("docs", "guides", f) for f in os.listdir(os.path.join(REPO, "docs", "guides")) if f.endswith(".md"))

#: Appended to a recipe run: one short epoch on the CPU, quietly.
SHORT = ["training_params.max_epochs=1", "training_params.max_train_batches=2", "training_params.max_valid_batches=1",
         "training_params.progress_bar=false", "training_params.device=cpu"]
RECIPE_MODULES = ("fusetrain.train_from_recipe",)


def doc_commands():
    """(file, line, command) for every command of a bash/sh block; continuation lines joined."""
    out = []
    for doc in DOCS:
        text = open(os.path.join(REPO, doc)).read()
        for m in re.finditer(r"^```(bash|sh|shell)\n(.*?)^```", text, flags=re.S | re.M):
            body = m.group(2)
            if body.startswith("#!"):
                continue  # a launch template: test_launch_templates.py runs it
            line = text[:m.start()].count("\n") + 2
            pending, start = "", line
            for i, raw in enumerate(body.splitlines()):
                if not pending:
                    start = line + i
                pending += raw.rstrip("\\").rstrip() + " " if raw.rstrip().endswith("\\") else raw
                if raw.rstrip().endswith("\\"):
                    continue
                cmd = pending.strip()
                pending = ""
                if cmd and not cmd.startswith("#"):
                    out.append((doc, start, cmd))
    return out


def words(cmd):
    """The command's words without comments and leading VAR=value assignments; (env, words)."""
    toks = shlex.split(cmd, comments=True)
    env = {}
    while toks and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", toks[0]):
        k, _, v = toks.pop(0).partition("=")
        env[k] = v
    return env, toks


def external(args):
    """Why a recipe command cannot run on this machine (GPUs, nodes, data it does not have), or None."""
    text = " ".join(args)
    if re.search(r"num_gpus=\d|compile_step=cuda_graph|device=cuda", text):
        return "GPUs"
    if re.search(r"=/data/|dataset_params=(coco_detection|mask_folders|image_folder)", text) or \
            "--config-name=cifar_resnet" in text:
        return "external data"
    m = re.search(r"--config-dir[= ](\S+)", text)
    if m and not os.path.isdir(m.group(1)):
        return "a recipe folder of your own"
    return None


def classify(cmd):
    """(kind, details) of a documented command; kind None: no class knows it."""
    env, w = words(cmd)
    if not w:
        return None, cmd
    if w[0] in ("python", "python3") and len(w) > 2 and w[1] == "-m" and w[2] in RECIPE_MODULES:
        why = external(w[3:])
        return ("recipe-validate" if why else "recipe-run"), w[3:]
    if w[0] in ("python", "python3") and w[1:3] == ["-m", "fusetrain.export"]:
        return "export-run", w[3:]
    if w[0] in ("python", "python3") and w[1:2] == ["-c"]:
        return "python-run", w[2]
    if w[0] in ("python", "python3") and w[1:3] == ["-m", "pytest"]:
        return "pytest-validate", w[3:]
    if w[0] == "torchrun":
        return "torchrun-validate", w[1:]
    if w[0] == "pip" and w[1:2] == ["install"]:
        return "pip-validate", w[2:]
    if w[0] == "bash" and w[1:2] and w[1].startswith("scripts/"):
        return "script-validate", (w[1], w[2:], env)
    if w[0].startswith("scripts/"):
        return "script-validate", (w[0], w[1:], env)
    if w[0] in ("cmake", "ctest"):
        return "cmake-validate", w
    return None, cmd


COMMANDS = doc_commands()


def _id(entry):
    return f"{entry[0]}:{entry[1]}"


def test_every_documented_command_has_a_class():
    assert COMMANDS, "no commands found in the docs"
    unknown = [f"{doc}:{line}: {cmd}" for doc, line, cmd in COMMANDS if classify(cmd)[0] is None]
    assert not unknown, "documented commands no class of test_doc_commands.py knows:\n" + "\n".join(unknown)


def test_the_quick_start_has_exactly_the_two_commands():
    quick = [cmd for doc, _, cmd in COMMANDS if doc == "README.md" and "scripts/" in cmd]
    assert quick == ["bash scripts/setup && python3 -m fusetrain.train_from_recipe", "bash scripts/test"]


def _split_and(cmd):
    return [c.strip() for c in cmd.split("&&")]


def _expand(cmd):
    """A README line joined with && is two commands."""
    return _split_and(cmd) if "&&" in cmd else [cmd]


EXPANDED = [(doc, line, part) for doc, line, cmd in COMMANDS for part in _expand(cmd)]
#: Run as written, a whole epoch, by test_compile_and_ema_from_the_command_line_run_as_written (not shortened
#: again in test_documented_command_runs).
COMPILE_AND_EMA = ("python -m fusetrain.train_from_recipe training_params.max_epochs=1 "
                   "training_params.torch_compile=true training_params.ema=true")


def _runs_as_written(cmd):
    return words(cmd)[1][1:] == words(COMPILE_AND_EMA)[1][1:]


RUNS = [e for e in EXPANDED if classify(e[2])[0] in ("recipe-run", "export-run", "python-run")
        and not _runs_as_written(e[2])]
VALIDATIONS = [e for e in EXPANDED if classify(e[2])[0] not in (None, "recipe-run", "export-run", "python-run")]


def _run(argv, cwd, timeout=900):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _recipe(args, cwd):
    return _run([sys.executable, "-m", "fusetrain.train_from_recipe", *args], cwd)


def _shortened(args):
    if any(a.startswith("--plot-lr") or a == "--list" for a in args):
        return list(args)
    if any(a.startswith("--from-super-gradients") for a in args):
        return list(args) + ["super_gradients.max_train_batches=2", "super_gradients.max_valid_batches=1",
                             "super_gradients.silent_mode=true", "training_params.max_epochs=1",
                             "training_params.device=cpu"]
    return list(args) + SHORT


@pytest.mark.slow
@pytest.mark.parametrize("doc, line, cmd", RUNS, ids=[_id(e) for e in RUNS])
def test_documented_command_runs(tmp_path, doc, line, cmd):
    kind, detail = classify(cmd)
    if kind == "recipe-run":
        proc = _recipe(_shortened(detail), tmp_path)
    elif kind == "export-run":
        # The model the export reads: the default recipe, trained first as its command says.
        first = _recipe(SHORT, tmp_path)
        assert first.returncode == 0, first.stderr[-3000:]
        proc = _run([sys.executable, "-m", "fusetrain.export", *detail], tmp_path)
    else:
        proc = _run([sys.executable, "-c", detail], tmp_path)
    assert proc.returncode == 0, f"{doc}:{line}: {cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("doc, line, cmd", VALIDATIONS, ids=[_id(e) for e in VALIDATIONS])
def test_documented_command_validates(doc, line, cmd):
    kind, detail = classify(cmd)
    {"recipe-validate": _validate_recipe, "torchrun-validate": _validate_torchrun, "pip-validate": _validate_pip,
     "script-validate": _validate_script, "pytest-validate": _validate_pytest,
     "cmake-validate": _validate_cmake}[kind](detail)


def _validate_recipe(args):
    """Compose the recipe with the command's overrides and validate what needs no data or GPU."""
    from omegaconf import OmegaConf

    from fusetrain.models import check_arch_params
    from fusetrain.train_from_recipe import _parser, compose_recipe
    from fusetrain.training.params import resolve_training_params

    parsed = _parser().parse_intermixed_args(args)
    if parsed.config_dir and not os.path.isdir(parsed.config_dir):
        return  # a folder of the reader's own: the options parse
    cfg = OmegaConf.to_container(compose_recipe(parsed.config_name, parsed.overrides, parsed.config_dir),
                                 resolve=True)
    resolve_training_params(cfg["training_params"])
    arch = dict(cfg["arch_params"])
    check_arch_params(arch.pop("name"), arch)


def _validate_torchrun(args):
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args)
    if parsed.module:
        assert parsed.training_script in RECIPE_MODULES, parsed.training_script
    else:
        assert parsed.no_python and parsed.training_script == "fusetrain-train", args
    _validate_recipe(parsed.training_script_args)


def _pyproject():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _validate_pip(args):
    project = _pyproject()
    extras = project["project"]["optional-dependencies"]
    known = {re.split(r"[<>=\[ ]", r)[0] for r in project["build-system"]["requires"] + extras["dev"]}
    for arg in args:
        if arg.startswith("-"):
            assert arg in ("-e", "--no-build-isolation", "--no-deps") or arg.startswith("-C"), arg
            continue
        m = re.fullmatch(r"\.(?:\[([a-z,]+)\])?", arg)
        if m:
            for extra in (m.group(1) or "").split(","):
                assert not extra or extra in extras, f"no extra {extra!r} in pyproject.toml"
        elif arg.endswith(".whl"):
            assert re.fullmatch(r"(dist/)?fusetrain-\d+\.\d+\.\d+-cp3\d+-cp3\d+-linux_x86_64\.whl", arg), arg
        elif arg.startswith("torch=="):
            pass
        else:
            assert arg in known, f"{arg!r} is neither the checkout, a wheel nor a build tool pyproject.toml names"


def _validate_script(detail):
    path, args, env = detail
    full = os.path.join(REPO, path)
    assert os.path.isfile(full), path
    assert subprocess.run(["bash", "-n", full]).returncode == 0
    text = open(full).read()
    for a in args:
        if a.startswith("-"):
            assert re.search(rf"(^|[\s|(]){re.escape(a.split('=')[0])}[\s)|]", text), f"{path} has no option {a}"
    for k in env:
        assert k in text, f"{path} does not read {k}"


def _validate_pytest(args):
    markers = " ".join(_pyproject()["tool"]["pytest"]["ini_options"]["markers"])
    for i, a in enumerate(args):
        if a == "-m":
            for name in re.findall(r"[a-z_]+", args[i + 1]):
                assert name in ("not", "and", "or") or f"{name}:" in markers, name
        elif not a.startswith("-") and not args[i - 1] in ("-m", "-n"):
            assert os.path.exists(os.path.join(REPO, a)), a


def _validate_cmake(w):
    # scripts/build-cpp-examples (scripts/test) builds against the installed package; here: the options exist.
    text = open(os.path.join(REPO, "CMakeLists.txt")).read()
    for a in w:
        m = re.match(r"-D(FUSETRAIN_\w+)=", a)
        if m:
            assert m.group(1) in text, a


# ---- the commands the issue names, as written -----------------------------------------------------------------

@pytest.mark.slow
def test_compile_and_ema_from_the_command_line_run_as_written(tmp_path):
    cmd = COMPILE_AND_EMA
    assert any(_runs_as_written(c) for _, _, c in EXPANDED), "not in the docs"
    proc = _recipe(words(cmd)[1][3:], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert '"epoch": 1' in proc.stdout


@pytest.mark.slow
def test_the_lr_plot_example_shows_restarts(tmp_path):
    plot = [c for _, _, c in COMMANDS if "--plot-lr" in c]
    assert plot, "the docs show no --plot-lr command"
    args = words(plot[0])[1][3:]
    proc = _recipe([a.replace(".png", ".csv") if a.startswith("--plot-lr") else a for a in args], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = open(tmp_path / "lr.csv").read().splitlines()[1:]
    lrs = [float(r.split(",")[2]) for r in rows]
    rises = sum(1 for a, b in zip(lrs, lrs[1:]) if b > a * 1.5)
    assert rises >= 2, f"the documented schedule restarts {rises} times"


def test_an_unknown_training_params_key_is_the_validator_s_refusal(tmp_path):
    proc = _recipe(["training_params.torch_compil=true", f"ckpt_root_dir={tmp_path}"], tmp_path)
    assert proc.returncode == 2
    assert "training_params: unknown key 'torch_compil'; did you mean 'torch_compile'?" in proc.stderr
    assert "not in struct" not in proc.stderr


# ---- Python snippets ---------------------------------------------------------------------------------------------

SNIPPET_DOCS = ["README.md", os.path.join("docs", "optimizers.md")]


@pytest.mark.slow
@pytest.mark.parametrize("doc", SNIPPET_DOCS)
def test_python_snippets_run(tmp_path, doc):
    blocks = re.findall(r"^```python\n(.*?)^```", open(os.path.join(REPO, doc)).read(), flags=re.S | re.M)
    assert blocks, doc
    script = tmp_path / "snippets.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + "\n".join(blocks))
    proc = _run([sys.executable, str(script)], tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_the_readme_bf16_snippet_uses_no_loss_scaler():
    text = open(os.path.join(REPO, "README.md")).read()
    for block in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        if "bfloat16" in block:
            assert "LossScaler" not in block and "GradScaler" not in block and ".scale(" not in block, block


# ---- links ---------------------------------------------------------------------------------------------------------

def _slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped (not - and _), spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_point_at_files_and_headings_that_exist():
    problems = []
    for doc in DOCS + ["CONTRIBUTING.md", "CHANGELOG.md"]:
        text = open(os.path.join(REPO, doc)).read()
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(REPO, os.path.dirname(doc), path)) if path else \
                os.path.join(REPO, doc)
            if not os.path.exists(full):
                problems.append(f"{doc}: {target}: no file")
            elif anchor:
                headings = re.findall(r"^#+ (.*)$", open(full).read(), flags=re.M)
                if anchor not in {_slug(h) for h in headings}:
                    problems.append(f"{doc}: {target}: no such heading")
    assert not problems, "\n".join(problems)
