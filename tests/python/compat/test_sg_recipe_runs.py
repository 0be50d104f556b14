"""`train_from_recipe --from-super-gradients`: each SG recipe file, translated,
trains one short epoch on the shipped data of its task (digits
classification, segmentation and detection), the report printed first."""

import json
import os

import pytest

from fusetrain.compat.super_gradients import SG_RECIPES_DIR
from fusetrain.train_from_recipe import main

#: One short epoch, quietly, on the CPU.
SHORT = ["super_gradients.max_epochs=1", "super_gradients.max_train_batches=2", "super_gradients.max_valid_batches=1",
         "super_gradients.silent_mode=true", "training_params.device=cpu"]
SEG_METRICS = "[{PixelAccuracy: {ignore_label: 255}}, {IoU: {num_classes: 11, ignore_index: 255}}]"

#: Small task data: the canvases are generated at start-up.
CANVASES = ["dataset_params.num_train=64", "dataset_params.num_valid=16", "dataset_params.valid_batch_size=16"]
#: SG's mixed_precision: true becomes false on a CPU, as in SG; one recipe keeps it (and so runs fp32 the SG way).
FP32 = ["super_gradients.mixed_precision=false"]

RUNS = {
    "cifar10_resnet": ("default", []),
    "imagenet_resnet50": ("default", []),
    "imagenet_efficientnet": ("default", FP32),
    "coco2017_yolox": ("digits_detection", CANVASES + FP32 + [
        "training_params.loss=fusetrain.models.DenseDetectionLoss", "+training_params.callbacks=[]",
        "super_gradients.lr_warmup_epochs=0", "super_gradients.lr_cooldown_epochs=0"]),
    "coco2017_yolo_nas_s": ("digits_detection", CANVASES + FP32 + [
        "training_params.loss=fusetrain.models.DenseDetectionLoss"]),
    "cityscapes_pplite_seg": ("digits_segmentation", CANVASES + FP32 + [
        "training_params.loss=CrossEntropyLoss", f"super_gradients.train_metrics_list={SEG_METRICS}",
        "super_gradients.lr_warmup_epochs=0",
        "super_gradients.initial_lr={default: 0.1, stem: 0.01}"]),  # a per-prefix rate the digits model has
    "cityscapes_regseg48": ("digits_segmentation", CANVASES + [
        f"super_gradients.train_metrics_list={SEG_METRICS}", "super_gradients.criterion_params.ignore_index=255"]),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_translated_recipe_trains_one_epoch(tmp_path, capsys, name):
    config, extra = RUNS[name]
    path = os.path.join(SG_RECIPES_DIR, f"{name}_train_params.yaml")
    rc = main(["--config-name", config, "--from-super-gradients", path, f"ckpt_root_dir={tmp_path}"] + SHORT + extra)
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    assert out.index("SuperGradients training hyperparameters from") < out.index(f"recipe {config!r}: experiment")
    assert "reproduced on purpose" in out
    result = json.loads(out[out.index("{\n"):])
    assert result["best"]["epoch"] == 1
    assert os.path.isfile(os.path.join(result["run_dir"], "ckpt_latest.pth"))


def test_sg_only_objects_stop_the_run_with_one_error_each(tmp_path, capsys):
    path = os.path.join(SG_RECIPES_DIR, "coco2017_yolox_train_params.yaml")
    rc = main(["--config-name", "digits_detection", "--from-super-gradients", path, f"ckpt_root_dir={tmp_path}"]
              + SHORT)
    err = capsys.readouterr().err
    assert rc == 2
    assert "loss: 'YoloXDetectionLoss'" in err and "register_loss" in err
    assert "phase_callbacks:" in err and "callbacks" in err
    assert not os.listdir(tmp_path)


def test_a_malformed_sg_override_is_a_recipe_error(tmp_path, capsys):
    path = os.path.join(SG_RECIPES_DIR, "cifar10_resnet_train_params.yaml")
    rc = main(["--from-super-gradients", path, f"ckpt_root_dir={tmp_path}", "super_gradients.max_epochs"])
    assert rc == 2 and "super_gradients.KEY=VALUE" in capsys.readouterr().err


def sg_error(tmp_path, capsys, path, *overrides):
    """The CLI's refusal (exit 2, one error line first, no traceback) of an SG file; nothing was written."""
    rc = main([f"ckpt_root_dir={tmp_path / 'ck'}", "--from-super-gradients", str(path), *overrides])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: --from-super-gradients") and "Traceback" not in err
    assert not (tmp_path / "ck").exists()
    return err


def test_bad_sg_files_and_keys_end_with_an_error_line(tmp_path, capsys):
    cifar = os.path.join(SG_RECIPES_DIR, "cifar10_resnet_train_params.yaml")
    # A misspelled SG key, on the command line (after the options or before them) and in a file.
    assert "max_epoch: not an SG training hyperparameter this translation knows; did you mean 'max_epochs'?" in \
        sg_error(tmp_path, capsys, cifar, "super_gradients.max_epoch=1")
    rc = main([f"ckpt_root_dir={tmp_path / 'ck'}", "super_gradients.max_epoch=1", "--from-super-gradients", cifar])
    assert rc == 2 and "did you mean 'max_epochs'?" in capsys.readouterr().err
    misspelled = tmp_path / "misspelled.yaml"
    misspelled.write_text("defaults:\n  - default_train_params\nmax_epochs: 1\ninitial_lr: 0.1\nloss: "
                          "CrossEntropyLoss\nlr_warmup_epoch: 2\n")
    assert "lr_warmup_epoch: not an SG training hyperparameter this translation knows; did you mean " \
           "'lr_warmup_epochs'?" in sg_error(tmp_path, capsys, misspelled)
    # A missing file, a broken YAML file, a broken YAML value.
    assert f"no file at {tmp_path / 'missing.yaml'}" in sg_error(tmp_path, capsys, tmp_path / "missing.yaml")
    assert f"fusetrain ships a file of that name: {cifar}" in sg_error(
        tmp_path, capsys, tmp_path / "cifar10_resnet_train_params.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("max_epochs: 1\ninitial_lr: {default: 0.1\n")
    assert f"{broken} is not readable YAML (line 3, column 1)" in sg_error(tmp_path, capsys, broken)
    assert "'super_gradients.initial_lr={default: 0.1': the value is not readable YAML" in \
        sg_error(tmp_path, capsys, cifar, "super_gradients.initial_lr={default: 0.1")


def test_an_sg_prefix_learning_rate_the_model_lacks_is_refused_before_training(tmp_path, capsys):
    cifar = os.path.join(SG_RECIPES_DIR, "cifar10_resnet_train_params.yaml")
    rc = main(["--from-super-gradients", cifar, f"ckpt_root_dir={tmp_path}",
               "super_gradients.initial_lr={default: 0.1, encoder.backbone: 0.01}"] + SHORT)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.startswith("error: recipe 'default': training_params.initial_lr: prefix 'encoder.backbone' matches "
                          "no trainable parameter of the model; its closest parameter-name prefixes: ")
    assert not os.listdir(tmp_path)
