"""The package's structure: no import cycle among its modules (every import
statement counts, those inside functions too), the training package's layers
(a lower one never imports a higher one), its size (a small top level,
modules that read in one sitting), and importing it leaves the process's
warning filters as they were."""

import ast
import os
import subprocess
import sys

import fusetrain

PACKAGE_DIR = os.path.dirname(os.path.abspath(fusetrain.__file__))


def _modules():
    """``{module name: source path}`` of the package's Python modules."""
    root = os.path.dirname(PACKAGE_DIR)
    out = {}
    for directory, _, files in os.walk(PACKAGE_DIR):
        for f in files:
            if f.endswith(".py"):
                name = os.path.relpath(os.path.join(directory, f), root)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = os.path.join(directory, f)
    return out


def _imports(name, path, modules):
    """The package modules that ``name`` imports. An import of one of its own parent packages is left out
    (a parent is always imported first)."""
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def test_no_import_cycle():
    modules = _modules()
    assert "fusetrain.training.trainer" in modules and "fusetrain.export.cli" in modules
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    cycles = []
    state = {}

    def visit(m, stack):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


#: The training package's layers, lowest first: a module imports training modules of its own layer or lower ones
#: only. The top level (the Trainer, the loop and its input checks) is the highest.
LAYERS = ("task", "params", "distributed", "data", "schedules", "checkpoint", "logging", "step", "")
#: Modules allowed past 400 lines: tables of data.
DATA_TABLES = ("fusetrain.training.params.table",)


def _layer(module):
    rest = module[len("fusetrain.training."):] if module.startswith("fusetrain.training.") else ""
    first = rest.split(".")[0]
    return LAYERS.index(first) if first in LAYERS[:-1] else len(LAYERS) - 1


def test_the_training_layers_import_only_downwards():
    modules = _modules()
    training = {m: p for m, p in modules.items() if m.startswith("fusetrain.training.")}
    assert "fusetrain.training.checkpoint.manager" in training and "fusetrain.training.task.batches" in training
    upward = []
    for m, p in training.items():
        for t in _imports(m, p, modules):
            if t.startswith("fusetrain.training.") and _layer(t) > _layer(m):
                upward.append(f"{m} ({LAYERS[_layer(m)] or 'top'}) imports {t} ({LAYERS[_layer(t)] or 'top'})")
    assert not upward, "imports from a lower layer into a higher one:\n" + "\n".join(sorted(upward))


def test_the_training_package_is_small_at_the_top_and_in_each_module():
    root = os.path.join(PACKAGE_DIR, "training")
    modules = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    packages = sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "__init__.py")))
    assert len(modules) <= 8 and len(packages) <= 9, (modules, packages)
    lines = {m: sum(1 for _ in open(p)) for m, p in _modules().items() if m.startswith("fusetrain.training")}
    assert lines.pop("fusetrain.training.loop") < 500
    long = {m: n for m, n in lines.items() if n > 400 and m not in DATA_TABLES}
    assert not long, long


def test_checkpoint_files_are_read_and_written_by_the_checkpoint_package_only():
    """NOTE [checkpoint schema]: one owner; no torch.save / torch.load of a checkpoint elsewhere in training."""
    found = []
    for m, path in _modules().items():
        if m.startswith("fusetrain.training.") and not m.startswith("fusetrain.training.checkpoint"):
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.Attribute) and node.attr in ("save", "load") and \
                        isinstance(node.value, ast.Name) and node.value.id == "torch":
                    found.append(f"{m}: torch.{node.attr}")
    assert not found, found


def test_import_leaves_warning_filters_alone():
    """torch's own import adds its filters; importing fusetrain's modules after it adds none."""
    code = ("import warnings\nimport torch\nbefore = list(warnings.filters)\n"
            "import fusetrain, fusetrain.training.trainer, fusetrain.train_from_recipe, fusetrain.export.cli\n"
            "import fusetrain.training.data, fusetrain.training.checkpoint.sharded, fusetrain.training.distributed.fsdp\n"
            "after = list(warnings.filters)\nassert after == before, [f for f in after if f not in before]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
