"""The shipped Hydra recipes and ``python -m fusetrain.train_from_recipe``."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("hydra", reason="the recipes need hydra-core")
from omegaconf import OmegaConf  # noqa: E402

import fusetrain  # noqa: E402
import fusetrain.train_from_recipe as tfr  # noqa: E402
from fusetrain.training.data import validate_dataset_params  # noqa: E402
from fusetrain.models import MODEL_NAMES, build_model, check_arch_params  # noqa: E402

SHIPPED = ["cifar_resnet", "default", "digits_detection", "digits_muon", "digits_segmentation", "seed_mnist_amp",
           "seed_mnist_fp32"]
# Values a recipe leaves missing (???) on purpose.
REQUIRED_OVERRIDES = {"cifar_resnet": ["dataset_params.root=/data/cifar10"]}
INPUT_SHAPES = {"digits": (2, 1, 28, 28), "mnist": (2, 1, 28, 28), "image_folder": (2, 3, 32, 32),
                "digits_detection": (2, 3, 64, 64), "digits_segmentation": (2, 3, 64, 64)}
# The training-mode output of each recipe's model for INPUT_SHAPES, by dataset.
OUTPUT_SHAPES = {"digits_detection": lambda c: (2, 8 * 8 + 4 * 4 + 2 * 2, 5 + c),
                 "digits_segmentation": lambda c: (2, c, 64, 64)}


def _trainer_importable():
    try:
        from fusetrain import Trainer  # noqa: F401
        return True
    except ImportError:
        pass
    try:
        from fusetrain.training.trainer import Trainer  # noqa: F401
        return True
    except ImportError:
        return False


def _run_cli(args, cwd, timeout=120):
    return subprocess.run([sys.executable, "-m", "fusetrain.train_from_recipe", *args], cwd=str(cwd),
                          capture_output=True, text=True, timeout=timeout)


# ---- the shipped recipes --------------------------------------------------------------------------------------

def test_recipes_are_package_data():
    d = tfr.recipes_dir()
    assert d == os.path.join(os.path.dirname(os.path.abspath(fusetrain.__file__)), "recipes")
    assert tfr.list_recipes() == SHIPPED
    for group, options in {"training_params": {"digits", "digits_muon", "seed_mnist", "cifar_resnet",
                                               "digits_detection", "digits_segmentation"},
                           "dataset_params": {"digits", "mnist", "image_folder", "digits_detection",
                                              "digits_segmentation", "coco_detection", "mask_folders"},
                           "arch_params": {"digits_cnn", "seed_mnist", "cifar_resnet", "yolo_csp_digits",
                                           "pplite_seg_digits"}}.items():
        assert set(tfr.list_recipes(os.path.join(d, group))) == options


@pytest.mark.parametrize("name", SHIPPED)
def test_recipe_composes_and_builds(name):
    cfg = tfr.compose_recipe(name)
    assert set(cfg.keys()) == set(tfr.RECIPE_KEYS)
    assert cfg.experiment_name and cfg.ckpt_root_dir is None
    cfg = tfr.compose_recipe(name, REQUIRED_OVERRIDES.get(name, []))
    recipe = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    ds = validate_dataset_params(recipe["dataset_params"])
    arch = dict(recipe["arch_params"])
    model_name = arch.pop("name")
    check_arch_params(model_name, arch)
    model = build_model(model_name, **arch)
    with torch.no_grad():
        out = model(torch.rand(*INPUT_SHAPES[ds["name"]]))
    assert out.shape == OUTPUT_SHAPES.get(ds["name"], lambda c: (2, c))(arch["num_classes"])


@pytest.mark.parametrize("name", SHIPPED)
def test_recipe_training_params_validate(name):
    params = pytest.importorskip("fusetrain.training.params")
    recipe = tfr.load_recipe(name, REQUIRED_OVERRIDES.get(name, []))
    resolved = params.resolve_training_params(recipe["training_params"]).to_dict()
    for key, value in recipe["training_params"].items():
        assert key in resolved
        if isinstance(value, (int, float, bool)) and not isinstance(value, str):
            assert resolved[key] == value, key


def test_recipe_contents():
    default = OmegaConf.to_container(tfr.compose_recipe("default"))
    assert default["arch_params"]["name"] == "digits_cnn" and default["dataset_params"]["name"] == "digits"
    tp = default["training_params"]
    assert (tp["optimizer"], tp["initial_lr"], tp["lr_mode"], tp["max_epochs"]) == ("AdamW", 3e-3, "cosine", 8)
    assert default["dataset_params"]["batch_size"] == 64

    fp32 = OmegaConf.to_container(tfr.compose_recipe("seed_mnist_fp32"))
    amp = OmegaConf.to_container(tfr.compose_recipe("seed_mnist_amp"))
    tp = fp32["training_params"]
    assert (tp["optimizer"], tp["initial_lr"], tp["lr_mode"], tp["max_epochs"], tp["mixed_precision"]) == \
        ("Adam", 1e-4, "constant", 10, False)
    assert fp32["dataset_params"]["name"] == "mnist" and fp32["dataset_params"]["root"] is None
    assert fp32["dataset_params"]["batch_size"] == 256 and fp32["arch_params"]["name"] == "seed_mnist"
    # The two seed recipes differ in the precision and the experiment name only.
    assert amp["training_params"].pop("mixed_precision") is True
    fp32["training_params"].pop("mixed_precision")
    assert amp.pop("experiment_name") != fp32.pop("experiment_name")
    assert amp == fp32

    cifar = tfr.compose_recipe("cifar_resnet")
    assert OmegaConf.is_missing(cifar.dataset_params, "root")
    assert cifar.arch_params.name == "cifar_resnet" and cifar.dataset_params.name == "image_folder"


def test_overrides_change_add_and_swap():
    cfg = tfr.compose_recipe("default", ["training_params.max_epochs=2", "+training_params.ema=true",
                                         "+training_params.ema_params={decay: 0.99}", "arch_params=seed_mnist",
                                         "dataset_params.batch_size=16", "ckpt_root_dir=/tmp/x"])
    assert cfg.training_params.max_epochs == 2 and cfg.training_params.ema is True
    assert cfg.training_params.ema_params.decay == 0.99
    assert cfg.arch_params.name == "seed_mnist" and "width" not in cfg.arch_params
    assert cfg.dataset_params.batch_size == 16 and cfg.ckpt_root_dir == "/tmp/x"


def test_user_config_dir(tmp_path):
    pytest.importorskip("fusetrain.training.params")
    (tmp_path / "training_params").mkdir()
    (tmp_path / "training_params" / "quick.yaml").write_text("max_epochs: 1\ninitial_lr: 0.01\n")
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - training_params: quick\n  - dataset_params: digits\n  - arch_params: digits_cnn\n"
        "  - _self_\nexperiment_name: mine\nckpt_root_dir: null\n")
    recipe = tfr.load_recipe("mine", config_dir=str(tmp_path))
    assert recipe["training_params"] == {"max_epochs": 1, "initial_lr": 0.01}
    assert recipe["arch_params"]["name"] == "digits_cnn" and recipe["experiment_name"] == "mine"
    # A shipped recipe stays reachable with --config-dir set, and the user's group options too.
    recipe = tfr.load_recipe("default", ["training_params=quick"], config_dir=str(tmp_path))
    assert recipe["experiment_name"] == "digits_cnn" and recipe["training_params"]["max_epochs"] == 1
    with pytest.raises(tfr.RecipeError, match="--config-dir: directory not found"):
        tfr.compose_recipe("default", config_dir=str(tmp_path / "absent"))


# ---- errors: exit status 2, a clear message, nothing written ------------------------------------------------

@pytest.mark.parametrize("override, needs_params, expected", [
    # NOTE [training_params overrides]: the validator, not Hydra's struct flag, refuses an unknown key.
    ("training_params.max_epoch=2", True, ["training_params: unknown key 'max_epoch'; did you mean 'max_epochs'?"]),
    ("dataset_params.bs=3", False, ["Could not override 'dataset_params.bs'",
                                    "To append to your config use +dataset_params.bs=3"]),
    ("+training_params.max_epoch=2", True, ["training_params: unknown key 'max_epoch'; did you mean 'max_epochs'?"]),
    ("training_params.max_epochs=0", True, ["training_params.max_epochs: got 0 (int); allowed: an int >= 1"]),
    ("training_params=nope", False, ["Could not find 'training_params/nope'",
                                     "Available options in 'training_params'", "digits", "seed_mnist"]),
])
def test_cli_broken_override_exits_2(tmp_path, override, needs_params, expected):
    if needs_params:
        pytest.importorskip("fusetrain.training.params")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    ckpt = tmp_path / "ck"
    proc = _run_cli([override, f"ckpt_root_dir={ckpt}"], cwd)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: recipe 'default': ")
    for text in expected:
        assert text in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not ckpt.exists()
    assert os.listdir(cwd) == []  # no outputs/ or checkpoints/ folder in the working directory


@pytest.mark.parametrize("argv, expected", [
    (["--config-name=cifar_resnet"], ["Missing mandatory value: root", "full_key: dataset_params.root",
                                      "set it on the command line: dataset_params.root=..."]),
    (["--config-name=cifar_resnet", "dataset_params.root=MISSING_DIR"],
     ["dataset_params.root: directory not found", "MISSING_DIR"]),
    (["--config-name=seed_mnist_fp32", "dataset_params.root=MISSING_DIR"],
     ["MNIST directory not found", "MISSING_DIR"]),
    (["--config-name=nope"], ["Cannot find primary config 'nope'",
                              "recipes there: " + ", ".join(SHIPPED)]),
    (["+batch=3"], ["unknown top-level key(s) 'batch'"]),
    (["+dataset_params.bs=3"], ["dataset_params: unknown key 'bs' for dataset 'digits'"]),
    (["arch_params.name=vgg"],
     ["arch_params.name: unknown model 'vgg'; allowed: " + ", ".join(MODEL_NAMES)]),
    (["+arch_params.depth=20"], ["arch_params: unknown key 'depth' for model 'digits_cnn'"]),
    (["experiment_name=a/b"], ["experiment_name: got 'a/b'"]),
    (["training_params.max_epochs=[1"], ["no viable alternative at input '[1'"]),
    (["--config-dir=MISSING_DIR"], ["--config-dir: directory not found"]),
    # Overrides before and after the options.
    (["training_params.max_epochs=1", "--config-dir=MISSING_DIR"], ["--config-dir: directory not found"]),
    # A per-prefix learning rate whose prefix names no parameter of the built model.
    (["+training_params.initial_lr={default: 0.1, features.9: 0.01}"],
     ["training_params.initial_lr: prefix 'features.9' matches no trainable parameter",
      "closest parameter-name prefixes: 'features.0'"]),
])
def test_main_recipe_errors(tmp_path, monkeypatch, capsys, argv, expected):
    pytest.importorskip("fusetrain.training.params")
    monkeypatch.chdir(tmp_path)
    missing = str(tmp_path / "missing")
    ckpt = tmp_path / "ck"
    argv = [a.replace("MISSING_DIR", missing) for a in argv] + [f"ckpt_root_dir={ckpt}"]
    assert tfr.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    for text in expected:
        assert text.replace("MISSING_DIR", missing) in err
    assert not ckpt.exists() and os.listdir(tmp_path) == []


def test_main_print_config_and_list(capsys):
    assert tfr.main(["--config-name=cifar_resnet", "--print-config", "arch_params.depth=32"]) == 0
    out = OmegaConf.create(capsys.readouterr().out)
    assert OmegaConf.is_missing(out.dataset_params, "root") and out.arch_params.depth == 32
    assert tfr.main(["--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert all(name in listed for name in SHIPPED)


# ---- end to end -----------------------------------------------------------------------------------------------

@pytest.mark.skipif(not _trainer_importable(), reason="fusetrain.Trainer is not importable in this build")
@pytest.mark.slow
def test_cli_trains_default_recipe(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    ckpt = tmp_path / "ck"
    proc = _run_cli(["training_params.max_epochs=1", "training_params.max_train_batches=3",
                     "training_params.max_valid_batches=2", "training_params.progress_bar=false",
                     f"ckpt_root_dir={ckpt}"], cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    result = json.loads("\n".join(lines[start:]))
    assert result["final"]["epoch"] == 1
    assert result["best"]["metric"] == "accuracy" and 0.0 <= result["best"]["value"] <= 1.0
    assert os.path.realpath(os.path.dirname(result["run_dir"])) == os.path.realpath(ckpt / "digits_cnn")
    assert {"ckpt_latest.pth", "training_params.yaml", "console.log"} <= set(os.listdir(result["run_dir"]))
    assert os.listdir(cwd) == []  # Hydra's compose API writes nothing in the working directory
    assert "recipe 'default': experiment 'digits_cnn', model digits_cnn" in proc.stdout


def test_a_recipe_builds_the_same_model_every_time():
    # training_params.seed seeds the model's initialisation, whatever the random states were before.
    recipe = tfr.load_recipe("default", [])
    weights = []
    for _ in range(2):
        torch.rand(3)
        _, _, model = tfr._build(recipe, "recipe")
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))
    other = tfr.load_recipe("default", ["training_params.seed=7"])
    _, _, model = tfr._build(other, "recipe")
    assert not torch.equal(next(model.parameters()), weights[0][0])


def test_muon_recipe_is_the_default_with_muon_and_trains(tmp_path):
    default = OmegaConf.to_container(tfr.compose_recipe("default"))
    muon = OmegaConf.to_container(tfr.compose_recipe("digits_muon"))
    assert muon["training_params"].pop("optimizer") == "Muon" and default["training_params"].pop("optimizer") == "AdamW"
    assert muon["training_params"].pop("optimizer_params") == {"weight_decay": 0.01, "adjust_lr_fn": "match_rms_adamw"}
    assert (muon["training_params"].pop("initial_lr"), default["training_params"].pop("initial_lr")) == (5e-3, 3e-3)
    default["training_params"].pop("optimizer_params")
    assert muon.pop("experiment_name") == "digits_cnn_muon" and default.pop("experiment_name") == "digits_cnn"
    assert muon == default
    # Two epochs of ten batches through the Trainer: the loss falls well below ln(10).
    recipe = tfr.load_recipe("digits_muon", ["training_params.max_epochs=2", "training_params.max_train_batches=10",
                                             "training_params.progress_bar=false", f"ckpt_root_dir={tmp_path}"])
    result = tfr.run_recipe(recipe)
    assert result["final"]["epoch"] == 2 and result["final"]["train_loss"] < 2.0


@pytest.mark.parametrize("name, watched", [("digits_detection", "map_50"), ("digits_segmentation", "mean_iou")])
@pytest.mark.slow
def test_cli_trains_detection_and_segmentation_recipes(tmp_path, name, watched):
    ckpt = tmp_path / "ck"
    proc = _run_cli([f"--config-name={name}", "training_params.max_epochs=1", "training_params.progress_bar=false",
                     "dataset_params.num_train=16", "dataset_params.num_valid=8", "dataset_params.batch_size=8",
                     "dataset_params.max_digits=2", f"ckpt_root_dir={ckpt}"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    result = json.loads("\n".join(lines[max(i for i, line in enumerate(lines) if line == "{"):]))
    assert result["best"]["metric"] == watched and 0.0 <= result["best"]["value"] <= 1.0
    assert f"valid_{watched}" in result["final"] and "train_loss" in result["final"]
    if name == "digits_detection":
        assert {"train_loss_obj", "train_loss_box", "train_loss_cls"} <= set(result["final"])


def test_coco_and_mask_folder_datasets_need_their_paths(tmp_path, capsys):
    assert tfr.main(["--config-name=digits_detection", "dataset_params=coco_detection",
                     f"ckpt_root_dir={tmp_path / 'ck'}"]) == 2
    assert "set it on the command line: dataset_params.train_images=..." in capsys.readouterr().err
    assert tfr.main(["--config-name=digits_segmentation", "dataset_params=mask_folders",
                     f"dataset_params.root={tmp_path / 'nowhere'}", f"ckpt_root_dir={tmp_path / 'ck'}"]) == 2
    assert "nowhere/train/images not found" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()


def test_plot_lr_writes_the_schedule_without_training(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    csv_path = tmp_path / "lr.csv"
    assert tfr.main(["--plot-lr", str(csv_path), "training_params.lr_mode=poly", "training_params.max_epochs=3",
                     "+training_params.lr_warmup_steps=4", "ckpt_root_dir=runs"]) == 0
    assert "steps" in capsys.readouterr().out
    rows = csv_path.read_text().splitlines()
    assert rows[0] == "step,epoch,lr"
    lrs = [float(r.split(",")[2]) for r in rows[1:]]
    recipe = tfr.load_recipe("default", ["training_params.lr_mode=poly", "training_params.max_epochs=3",
                                         "+training_params.lr_warmup_steps=4"])
    from fusetrain.training.params import resolve_training_params
    from fusetrain.training.schedules.lr import LRSchedule

    steps = len(lrs) // 3
    assert lrs == LRSchedule(resolve_training_params(recipe["training_params"]), steps).sample(range(len(lrs)))
    assert not (tmp_path / "runs").exists()  # nothing trained, nothing written
    png = tmp_path / "lr.png"
    assert tfr.main(["--plot-lr", str(png)]) == 0 and png.stat().st_size > 0
    assert tfr.main(["--plot-lr", str(tmp_path / "lr.txt")]) == 2
    assert "allowed: a path ending in .csv" in capsys.readouterr().err


@pytest.mark.skipif(not _trainer_importable(), reason="fusetrain.Trainer is not importable in this build")
@pytest.mark.slow
def test_the_same_command_twice_makes_two_runs_and_resume_continues_the_latest(tmp_path):
    ckpt = tmp_path / "ck"
    argv = ["training_params.max_epochs=1", "training_params.max_train_batches=2",
            "training_params.max_valid_batches=1", "training_params.progress_bar=false", f"ckpt_root_dir={ckpt}"]
    assert tfr.main(argv) == 0 and tfr.main(argv) == 0  # NOTE [run folders]
    runs = sorted(os.listdir(ckpt / "digits_cnn"))
    assert len(runs) == 2 and all(r.startswith("RUN_") for r in runs)
    for run in runs:
        assert {"training_params.yaml", "console.log", "metrics.jsonl"} <= set(os.listdir(ckpt / "digits_cnn" / run))
    assert tfr.main(argv[:1] + ["training_params.max_epochs=2", "training_params.resume=true"] + argv[1:]) == 0
    assert sorted(os.listdir(ckpt / "digits_cnn")) == runs  # continued in the newest run's folder
    with open(ckpt / "digits_cnn" / runs[-1] / "metrics.jsonl") as f:
        assert [json.loads(line)["epoch"] for line in f] == [1, 2]
