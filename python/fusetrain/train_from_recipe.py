"""Train from a YAML recipe.

Usage::

    python -m fusetrain.train_from_recipe [--config-name=NAME] [--config-dir=DIR] [--print-config]
                                          [--plot-lr=PATH] [--from-super-gradients=PATH] [override ...]

With no arguments the ``default`` recipe runs (digits_cnn on the embedded
digits). Shipped recipes live in ``fusetrain/recipes`` (``--list`` prints
them): ``default``, ``seed_mnist_fp32``, ``seed_mnist_amp``, ``cifar_resnet``.
A recipe is a Hydra config with a defaults list over three config groups
(``training_params/``, ``dataset_params/``, ``arch_params/``) and two top-level
keys, ``experiment_name`` and ``ckpt_root_dir``.

Overrides use Hydra's syntax::

    training_params.max_epochs=2          # any training_params key, whether the recipe sets it or not
    ~training_params.optimizer_params     # delete a key
    arch_params=seed_mnist                # pick another option of a config group
    dataset_params.root=/data/mnist ckpt_root_dir=/tmp/runs

``--from-super-gradients=PATH`` trains the recipe's model and data with the
SuperGradients training hyperparameters in PATH, translated by
``fusetrain.compat.super_gradients.translate`` (its report is printed first;
``super_gradients.KEY=VALUE`` overrides set SG keys, see
``fusetrain.compat.super_gradients.recipe``).

``--config-dir=DIR`` adds a folder of your own recipes. A recipe in DIR is
composed with DIR first on the search path and the shipped recipes behind it,
so its defaults list can name shipped group options as well as group options
of its own (``DIR/training_params/fast.yaml``; a file in DIR with a shipped
name shadows the shipped one). A name that is not in DIR is looked up among the
shipped recipes, with DIR's group options still selectable
(``arch_params=my_net``).

What runs: the recipe is composed, then checked before anything is built or
written -- ``training_params`` through
``fusetrain.training.params.resolve_training_params``, ``dataset_params``
and ``arch_params`` against their key sets -- then the data loaders and the
model are built and ``fusetrain.Trainer(experiment_name,
ckpt_root_dir=ckpt_root_dir).train(...)`` runs; its result is printed as JSON.
Every ``training_params`` key can be set without Hydra's ``+`` (NOTE
[training_params overrides]): the validator, not Hydra's struct flag, refuses
a key that does not exist, with the closest valid one. Any recipe error (a Hydra composition or override error, a missing ``???``
value, an invalid or unknown key, a missing data path) is printed to stderr
with where it was found and the process exits with status 2, having created
nothing under the checkpoint root. Running a recipe again into a used
experiment folder takes ``training_params.resume=true`` (continue) or
``training_params.overwrite_experiment=true`` (start over); see
``docs/checkpoints.md``.

A run stopped by a signal (SIGINT or one of ``training_params.preemption_signals``)
writes a checkpoint and exits with status 75
(``fusetrain.training.distributed.preemption.EXIT_PREEMPTED``): run the same command again
with ``training_params.resume=auto`` to continue it.

Why Hydra's compose API and not ``@hydra.main``: ``hydra.main`` changes the
working directory per run and creates ``outputs/<date>/<time>`` folders with
its own logs, while the Trainer already owns the run folder
(``ckpt_root_dir/experiment_name``). Composing with
``hydra.initialize_config_dir`` + ``hydra.compose`` keeps the working
directory, writes nothing, and lets this module report errors itself. Relative
paths in a recipe (``ckpt_root_dir``, ``dataset_params.root``) are therefore
relative to the directory the command is run from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["RecipeError", "compose_recipe", "list_recipes", "load_recipe", "main", "plot_lr", "recipes_dir",
           "run_recipe"]

#: The top-level keys a recipe may have once composed.
RECIPE_KEYS = ("experiment_name", "ckpt_root_dir", "training_params", "dataset_params", "arch_params")

EXIT_RECIPE_ERROR = 2


class RecipeError(ValueError):
    """A recipe that cannot be composed or does not validate."""


def recipes_dir() -> str:
    """Absolute path of the shipped recipes (``fusetrain/recipes``, package data)."""
    # The package is installed as plain files (it holds compiled extensions), so
    # the resource path is a real directory that Hydra can search.
    path = resources.files("fusetrain").joinpath("recipes")
    candidate = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    if not os.path.isdir(candidate):  # e.g. an editable install whose finder maps only modules
        candidate = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")
    return os.path.abspath(candidate)


def list_recipes(config_dir: Optional[str] = None) -> List[str]:
    """Names of the top-level recipes in ``config_dir`` (default: the shipped ones)."""
    d = config_dir or recipes_dir()
    return sorted(os.path.splitext(f)[0] for f in os.listdir(d)
                  if f.endswith((".yaml", ".yml")) and os.path.isfile(os.path.join(d, f)))


def _error_text(exc: BaseException) -> str:
    """The message of ``exc`` followed by its causes (Hydra wraps OmegaConf
    errors, whose text names the full key)."""
    parts: List[str] = []
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e).strip()
        if text and text != "None" and not any(text in p for p in parts):
            parts.append(text)
        e = e.__cause__
    return "\n".join(parts) if parts else type(exc).__name__


def _require_hydra() -> None:
    from ._optional import require

    require("hydra", "the recipes (python -m fusetrain.train_from_recipe)")


def _open_override(text: str) -> str:
    """NOTE [training_params overrides]: Hydra refuses ``training_params.KEY=VALUE`` for a key the
    recipe's YAML does not list ("Key 'KEY' is not in struct") unless it is written ``+`` or ``++``,
    but every key of the training_params table may be set. Such an override is given to Hydra as
    ``++`` (set, adding the key where it is missing), and ``resolve_training_params`` then refuses
    a key that is not in the table, naming the closest valid one."""
    if text.startswith("training_params.") and "=" in text.split("@", 1)[0]:
        return "++" + text
    return text


def compose_recipe(config_name: str = "default", overrides: Sequence[str] = (), config_dir: Optional[str] = None):
    """Compose a recipe with Hydra and return the ``DictConfig`` (values are not
    resolved or validated yet). ``config_dir`` is searched before the shipped
    recipes. Raises :class:`RecipeError` naming the recipe and the search path."""
    _require_hydra()
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    shipped = recipes_dir()
    overrides = [_open_override(o) for o in overrides]
    if config_dir is not None:
        config_dir = os.path.abspath(os.path.expanduser(config_dir))
        if not os.path.isdir(config_dir):
            raise RecipeError(f"--config-dir: directory not found: {config_dir}")
        search = [config_dir, shipped]
        primary, extra = config_dir, shipped
        if not any(os.path.isfile(os.path.join(config_dir, config_name + ext)) for ext in (".yaml", ".yml")):
            # Hydra looks for the primary config only in the primary directory:
            # a shipped recipe named with --config-dir set is composed from the
            # shipped directory, with DIR behind it for group options.
            primary, extra = shipped, config_dir
        if primary != extra and not any(o.lstrip("+~").startswith("hydra.searchpath") for o in overrides):
            quoted = extra.replace("\\", "\\\\").replace("'", "\\'")
            overrides.append(f"hydra.searchpath=['file://{quoted}']")
        config_dir = primary
    else:
        config_dir = shipped
        search = [shipped]
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name="train_from_recipe"):
            return compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as exc:
        # Hydra's message for a wrong --config-name shows the search path but
        # not the recipes in it: name them.
        text = _error_text(exc)
        names = sorted({n for d in search if os.path.isdir(d) for n in list_recipes(d)})
        raise RecipeError(f"recipe {config_name!r}: {text}\n(recipe search path: {', '.join(search)}; "
                          f"recipes there: {', '.join(names)})") from exc


def load_recipe(config_name: str = "default", overrides: Sequence[str] = (),
                config_dir: Optional[str] = None) -> Dict[str, Any]:
    """Compose a recipe, resolve it to plain containers and validate every part
    without building or writing anything. Returns ``{"experiment_name",
    "ckpt_root_dir", "training_params", "dataset_params", "arch_params"}``
    (plain dicts; dataset_params with defaults filled in). Raises
    :class:`RecipeError`."""
    _require_hydra()
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = compose_recipe(config_name, overrides, config_dir)
    where = f"recipe {config_name!r}"
    try:
        recipe = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        hint = ""
        key = getattr(exc, "full_key", None)
        if exc.__class__.__name__ == "MissingMandatoryValue" and key:
            hint = f"\nset it on the command line: {key}=..."
        raise RecipeError(f"{where}: {_error_text(exc)}{hint}") from exc
    return validate_recipe(recipe, where)


def validate_recipe(recipe: Dict[str, Any], where: str = "recipe") -> Dict[str, Any]:
    """Validate a composed, resolved recipe (plain dict); see :func:`load_recipe`."""
    from .training.data import validate_dataset_params
    from .models import check_arch_params

    if not isinstance(recipe, dict):
        raise RecipeError(f"{where}: expected a mapping at the top level, got {type(recipe).__name__}")
    unknown = [k for k in recipe if k not in RECIPE_KEYS]
    if unknown:
        raise RecipeError(f"{where}: unknown top-level key(s) {', '.join(map(repr, unknown))}; allowed: "
                          + ", ".join(RECIPE_KEYS))
    for key in ("experiment_name", "training_params", "dataset_params", "arch_params"):
        if key not in recipe:
            raise RecipeError(f"{where}: missing top-level key {key!r}")
    name = recipe["experiment_name"]
    if not isinstance(name, str) or not name or "/" in name or os.sep in name:
        raise RecipeError(f"{where}: experiment_name: got {name!r}; allowed: a non-empty folder name (no '/')")
    root = recipe.get("ckpt_root_dir")
    if root is not None and (not isinstance(root, str) or not root):
        raise RecipeError(f"{where}: ckpt_root_dir: got {root!r}; allowed: a directory path or null")
    for key in ("training_params", "dataset_params", "arch_params"):
        if not isinstance(recipe[key], dict):
            raise RecipeError(f"{where}: {key}: expected a mapping, got {recipe[key]!r}")

    try:
        from .training.params import resolve_training_params
    except ImportError as exc:  # pragma: no cover - only while the package is incomplete
        raise RecipeError(f"{where}: cannot validate training_params: {exc}") from exc
    try:
        resolve_training_params(recipe["training_params"])
        dataset_params = validate_dataset_params(recipe["dataset_params"])
        arch = dict(recipe["arch_params"])
        if "name" not in arch:
            from .models import MODEL_NAMES
            raise ValueError("arch_params.name is required; allowed: " + ", ".join(MODEL_NAMES))
        model_name = arch.pop("name")
        check_arch_params(model_name, arch)
    except (ValueError, TypeError) as exc:
        raise RecipeError(f"{where}: {_error_text(exc)}") from exc
    out = dict(recipe)
    out["ckpt_root_dir"] = root
    out["dataset_params"] = dataset_params
    return out


def _build(recipe: Dict[str, Any], where: str):
    """Data loaders and model of a validated recipe; errors become RecipeError.
    The random states are seeded with ``training_params.seed`` first, so the
    model's initial weights (and any random split of the data) are the same in
    every run of the recipe."""
    from .training.data import build_dataloaders
    from .training.distributed.seeding import seed_everything
    from .models import build_model

    seed_everything(_training_params(recipe, where).seed)
    try:
        train_loader, valid_loader = build_dataloaders(recipe["dataset_params"])
        arch = dict(recipe["arch_params"])
        model = build_model(arch.pop("name"), **arch)
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError, ImportError) as exc:
        raise RecipeError(f"{where}: {_error_text(exc)}") from exc
    return train_loader, valid_loader, model


def _recipe_worker(recipe: Dict[str, Any], where: str) -> Dict[str, Any]:
    """What each worker started for ``multi_gpu: ddp`` / ``fsdp`` runs: the whole recipe,
    data and model built in the worker."""
    return run_recipe(recipe, where)


def run_recipe(recipe: Dict[str, Any], where: str = "recipe") -> Dict[str, Any]:
    """Build the data and the model of a validated recipe and train; returns the
    Trainer's result. With ``multi_gpu: ddp`` outside a launcher, starts the
    workers (each builds the data and the model itself) and returns rank 0's
    result; under a launcher (torchrun) each process trains its shard."""
    from .training import distributed
    from .training.distributed import launcher
    try:
        params = _training_params(recipe, where)
        n_workers = distributed.workers_to_launch(params)
    except ValueError as exc:  # num_gpus above the visible devices, multi_gpu 'ddp' without workers
        raise RecipeError(f"{where}: {_error_text(exc)}") from exc
    if n_workers > 1:
        mode = "ddp" if params.multi_gpu == "auto" else params.multi_gpu
        print(f"{where}: starting {n_workers} worker processes (multi_gpu: {mode})", flush=True)
        return launcher.launch(_recipe_worker, (recipe, where), n_workers, signals=params.preemption_signals)
    train_loader, valid_loader, model = _build(recipe, where)
    # Imported late: the Trainer pulls in the whole training stack.
    try:
        from . import Trainer
    except ImportError:
        from .training.trainer import Trainer

    n_params = sum(p.numel() for p in model.parameters())
    rank, world, _ = distributed.env_world()
    if rank == 0:
        size = f" (world size {world})" if world > 1 else ""
        print(f"{where}{size}: experiment {recipe['experiment_name']!r}, model {recipe['arch_params']['name']} "
              f"({n_params:,} parameters), data {recipe['dataset_params']['name']} "
              f"({len(train_loader.dataset)} train / {len(valid_loader.dataset)} valid samples)", flush=True)
    from .training.params import TrainingParamsError

    trainer = Trainer(recipe["experiment_name"], ckpt_root_dir=recipe["ckpt_root_dir"])
    try:
        return trainer.train(model=model, training_params=recipe["training_params"], train_loader=train_loader,
                             valid_loader=valid_loader)
    except TrainingParamsError as exc:  # checks that need the run's device (compile_step: cuda_graph on a CPU)
        raise RecipeError(f"{where}: {_error_text(exc)}") from exc


def plot_lr(recipe: Dict[str, Any], path: str, where: str = "recipe") -> str:
    """Write the learning-rate schedule of a validated recipe (steps per epoch
    from its train loader) to ``path``; returns a summary line."""
    from .training.data import build_dataloaders
    from .training.preflight import steps_per_epoch
    from .training.schedules.lr import LRSchedule, write_schedule

    p = _training_params(recipe, where)
    try:
        train_loader, _ = build_dataloaders(recipe["dataset_params"])
        steps = steps_per_epoch(train_loader, p)
        return write_schedule(LRSchedule(p, steps), path)
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError, ImportError, OSError) as exc:
        raise RecipeError(f"{where}: {_error_text(exc)}") from exc


def _training_params(recipe: Dict[str, Any], where: str):
    from .training.params import resolve_training_params

    try:
        return resolve_training_params(recipe["training_params"])
    except (ValueError, TypeError) as exc:
        raise RecipeError(f"{where}: {_error_text(exc)}") from exc


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fusetrain.train_from_recipe",
        description="Train a model from a YAML recipe (Hydra config). Overrides use Hydra's syntax: "
                    "training_params.max_epochs=2, training_params.ema=true (any training_params key), arch_params=seed_mnist.")
    p.add_argument("--config-name", "-cn", default="default",
                   help="recipe name (a YAML file without .yaml in the recipe search path); default: default")
    p.add_argument("--config-dir", "-cd", default=None,
                   help="directory of your own recipes, searched before the shipped ones")
    p.add_argument("--print-config", action="store_true",
                   help="print the composed recipe as YAML and exit without validating or training")
    p.add_argument("--list", action="store_true", help="list the available recipes and exit")
    p.add_argument("--plot-lr", metavar="PATH", default=None,
                   help="write the learning rate of every optimizer step the recipe will use to PATH (.png, .svg, "
                        ".pdf or .csv) and exit without training")
    p.add_argument("--from-super-gradients", metavar="PATH", default=None,
                   help="train the recipe's model and data with the SuperGradients training hyperparameters in "
                        "PATH (.yaml), translated (the report is printed first); super_gradients.KEY=VALUE sets an "
                        "SG key, training_params.KEY=VALUE supplies a fusetrain value "
                        "(docs/guides/from_super_gradients.md)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. training_params.max_epochs=2")
    return p


def _load(name: str, args: argparse.Namespace) -> Dict[str, Any]:
    """The validated recipe; with ``--from-super-gradients`` its training_params
    are the SG file's, translated (the report printed)."""
    if not args.from_super_gradients:
        return load_recipe(name, args.overrides, args.config_dir)
    from .compat.super_gradients.recipe import apply_sg_params, split_overrides

    try:
        hydra, sg, supplied = split_overrides(args.overrides)
    except ValueError as exc:
        raise RecipeError(f"--from-super-gradients: {exc}") from exc
    recipe = load_recipe(name, hydra, args.config_dir)
    try:
        print(apply_sg_params(recipe, args.from_super_gradients, sg, supplied), flush=True)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        raise RecipeError(f"--from-super-gradients {args.from_super_gradients}: {_error_text(exc)}") from exc
    return recipe


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ._optional import MissingExtra

    args = _parser().parse_intermixed_args(argv)  # overrides may come before and after the options
    name = args.config_name
    if name.endswith((".yaml", ".yml")):
        name = os.path.splitext(name)[0]
    try:
        if args.list:
            dirs = ([os.path.abspath(args.config_dir)] if args.config_dir else []) + [recipes_dir()]
            for d in dirs:
                if not os.path.isdir(d):
                    raise RecipeError(f"--config-dir: directory not found: {d}")
                print(f"{d}:")
                for n in list_recipes(d):
                    print(f"  {n}")
            return 0
        if args.print_config:
            _require_hydra()
            from omegaconf import OmegaConf
            print(OmegaConf.to_yaml(compose_recipe(name, args.overrides, args.config_dir)), end="")
            return 0
        recipe = _load(name, args)
        if args.plot_lr:
            print(plot_lr(recipe, args.plot_lr, where=f"recipe {name!r}"))
            return 0
        result = run_recipe(recipe, where=f"recipe {name!r}")
    except (RecipeError, MissingExtra) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_RECIPE_ERROR
    except KeyboardInterrupt as exc:
        from .training.distributed.preemption import TrainingInterrupted

        if not isinstance(exc, TrainingInterrupted):
            raise
        print(f"stopped: {exc}", file=sys.stderr, flush=True)  # NOTE [preemption]
        return exc.exit_status
    except Exception as exc:
        from .training.distributed.context import DistributedTrainingError

        if not isinstance(exc, DistributedTrainingError):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") == "0":  # under a launcher only rank 0 prints the result
        print(json.dumps(result, indent=2, default=str))
    return 0


def _entry() -> int:
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        # Started by torchrun: an exception is recorded for the launcher's failure summary.
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(main)()
    return main()


if __name__ == "__main__":
    sys.exit(_entry())
