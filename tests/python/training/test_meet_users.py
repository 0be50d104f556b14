"""Users arriving from SuperGradients, Lightning or timm are met in one round:
an SG training-params dict gets one error naming translate(); metric names
match ignoring case and the other libraries' spellings (NOTE [metric names]);
the synonym table answers Lightning's and timm's precision and EMA spellings;
an optimizer setting of another optimizer names the optimizers that take it
(read from their signatures); fp16 on the CPU is warned about once, naming
bf16; SG's mixed_precision: true on a CPU runs as SG runs it (fp32, said in the
report); an SG recipe shortened to one epoch with a longer warmup and cooldown
runs as SG runs it."""

import inspect
import json
import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fusetrain.amp as amp
from fusetrain import Trainer
from fusetrain.compat.super_gradients import SG_RECIPES_DIR, translate
from fusetrain.training.task.metrics import MetricSet, build_metric, metric_name
from fusetrain.training.params import OPTIMIZERS, TrainingParamsError, resolve_training_params
from fusetrain.training.schedules.lr import LRSchedule

SEED = 63

#: SG's training hyperparameters as an SG user passes them to SG's Trainer.train.
SG_PARAMS = {"max_epochs": 2, "initial_lr": 0.1, "lr_mode": "cosine", "optimizer": "SGD",
             "loss": "CrossEntropyLoss", "criterion_params": {"smooth_eps": 0.1}, "train_metrics_list": ["Accuracy"],
             "valid_metrics_list": ["Accuracy", "Top5"], "metric_to_watch": "Accuracy", "silent_mode": True}


def refusal(params):
    with pytest.raises(TrainingParamsError) as info:
        resolve_training_params(params)
    assert len(info.value.errors) == 1, info.value.errors
    return info.value.errors[0]


def loaders(n=32, classes=10):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 8, generator=g), torch.randint(0, classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8), DataLoader(TensorDataset(x, y), batch_size=8)


# ---- SuperGradients' dict -----------------------------------------------------------------------------------------

def test_an_sg_dict_passed_to_trainer_train_gets_one_error_naming_translate(tmp_path):
    train, valid = loaders()
    with pytest.raises(TrainingParamsError) as info:
        Trainer("sg", ckpt_root_dir=str(tmp_path)).train(nn.Linear(8, 10), SG_PARAMS, train, valid)
    assert len(info.value.errors) == 1
    msg = str(info.value)
    assert "SuperGradients" in msg and "from fusetrain.compat.super_gradients import translate" in msg
    assert "translate(sg_training_params)" in msg
    for key in ("train_metrics_list", "valid_metrics_list", "silent_mode", "criterion_params"):
        assert repr(key) in msg
    assert "train_metrics_list -> train_metrics" in msg and "criterion_params -> loss_params" in msg
    assert not os.listdir(tmp_path), "nothing is written before the params are valid"


def test_the_translate_call_the_error_shows_works_on_the_same_dict():
    params, report = translate(SG_PARAMS)
    p = resolve_training_params(params)
    assert p.valid_metrics == ["accuracy", "top5"] and p.metric_to_watch == "accuracy"
    assert p.progress_bar is False and p.loss_params == {"label_smoothing": 0.1}


def test_one_sg_key_alone_gets_the_synonym():
    assert refusal({"silent_mode": True}).endswith("unknown key 'silent_mode'; did you mean 'progress_bar'?")


# ---- metric names -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given, name", [
    ("Accuracy", "accuracy"), ("ACCURACY", "accuracy"), ("Top5", "top5"), ("top-5", "top5"), ("IoU", "mean_iou"),
    ("mIoU", "mean_iou"), ("PixelAccuracy", "pixel_accuracy"), ("Pixel_Accuracy", "pixel_accuracy"),
    ("mAP@0.50:0.95", "map"), ("accuracy", "accuracy"), ("no_such_metric", "no_such_metric"),
])
def test_metric_names_match_other_spellings(given, name):
    assert metric_name(given) == name


def test_torchmetrics_class_names_are_their_classes_any_case():
    torchmetrics = pytest.importorskip("torchmetrics")
    path = metric_name("multiclassf1score")
    assert path == "torchmetrics.classification.MulticlassF1Score"
    m = build_metric({"MulticlassF1Score": {"num_classes": 10}})
    assert isinstance(m.metric, torchmetrics.classification.MulticlassF1Score)


def test_sg_metric_names_in_valid_metrics_and_metric_to_watch_train(tmp_path):
    train, valid = loaders()
    result = Trainer("names", ckpt_root_dir=str(tmp_path)).train(
        nn.Linear(8, 10), {"max_epochs": 1, "valid_metrics": ["Accuracy", "Top5"], "train_metrics": ["ACCURACY"],
                           "metric_to_watch": "Accuracy", "progress_bar": False, "device": "cpu"}, train, valid)
    assert result["best"]["metric"] == "accuracy"
    assert {"valid_accuracy", "valid_top5", "train_accuracy"} <= set(result["final"])


def test_metric_set_built_from_sg_names_reports_fusetrain_names():
    ms = MetricSet(["Accuracy", {"Top5": {}}], "valid")
    logits, target = torch.eye(10)[:4] * 5, torch.arange(4)
    ms.update(logits, target, None)
    assert ms.compute() == {"accuracy": 1.0, "top5": 1.0}


# ---- synonyms: precision, EMA, another optimizer's settings ---------------------------------------------------------

@pytest.mark.parametrize("value, meant", [
    ("16-mixed", "fp16"), ("bf16-mixed", "bf16"), ("float16", "fp16"), ("bfloat16", "bf16"), ("32-true", "fp32"),
    ("16", "fp16"),
])
def test_precision_spellings_of_other_libraries_get_the_right_suggestion(value, meant):
    msg = refusal({"mixed_precision": value})
    assert msg.startswith(f"training_params.mixed_precision: got {value!r}") and msg.endswith(f"did you mean {meant!r}?")


@pytest.mark.parametrize("key", ["ema_decay", "model_ema_decay"])
def test_ema_decay_spellings_point_at_ema_params(key):
    assert refusal({key: 0.999}).endswith(f"unknown key {key!r}; did you mean 'ema_params.decay'?")


def _takes(cls, key):
    return key in inspect.signature(cls.__init__).parameters


def test_momentum_for_adamw_names_the_optimizers_that_take_it():
    msg = refusal({"optimizer": "AdamW", "optimizer_params": {"momentum": 0.9}})
    owners = [n for n, cls in OPTIMIZERS.items() if n != "AdamW" and _takes(cls, "momentum")]
    assert {"SGD", "RMSprop"} <= set(owners)
    assert msg.startswith("training_params.optimizer_params: 'momentum' is not an argument of AdamW; it is one of "
                          + ", ".join(owners))
    assert "AdamW takes: betas, eps, weight_decay" in msg


def test_a_setting_no_optimizer_has_still_gets_the_closest_spelling():
    assert "did you mean 'momentum'?" in refusal({"optimizer": "SGD", "optimizer_params": {"momentun": 0.9}})


# ---- fp16 on the CPU ----------------------------------------------------------------------------------------------

def test_fp16_on_the_cpu_is_warned_once_naming_bf16(monkeypatch):
    monkeypatch.setattr(amp, "_warned_slow_fp16", False)
    with pytest.warns(UserWarning, match="mixed_precision 'fp16' on the CPU.*'bf16'") as record:
        assert amp.resolve_precision("fp16", "cpu").name == "fp16"
        amp.resolve_precision("fp16", "cpu")
    assert len([w for w in record if "fp16' on the CPU" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.resolve_precision("bf16", "cpu")
        amp.resolve_precision(True, "cpu")


def test_sg_mixed_precision_on_a_cpu_runs_as_sg_runs_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    params, report = translate(dict(SG_PARAMS, mixed_precision=True))
    assert params["mixed_precision"] is False
    assert any("mixed_precision true on a CPU" in r and "bf16" in r for r in report.reproduced)
    params, _ = translate(dict(SG_PARAMS, mixed_precision=True), supply={"device": "cpu"})
    assert params["mixed_precision"] is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    params, report = translate(dict(SG_PARAMS, mixed_precision=True))
    assert params["mixed_precision"] == "fp16"


# ---- an SG recipe shortened to one epoch ------------------------------------------------------------------------------

YOLOX = os.path.join(SG_RECIPES_DIR, "coco2017_yolox_train_params.yaml")
SUPPLY = {"loss": "model", "callbacks": []}


def test_yolox_shortened_to_one_epoch_translates_to_sg_s_rates():
    params, report = translate(YOLOX, supply=SUPPLY, overrides={"max_epochs": 1})
    assert params["lr_mode"] == "constant" and params["lr_cooldown_epochs"] == 0
    assert params["lr_warmup_epochs"] == 5 and params["lr_warmup_mode"] == "linear_epoch"
    assert any("lr_cooldown_epochs 15 >= max_epochs 1" in r for r in report.reproduced)
    # SG's LinearEpochLRWarmup at epoch 0: initial_lr / (lr_warmup_epochs + 1); its cosine never starts.
    sched = LRSchedule(resolve_training_params(params), 10)
    assert [sched(k) for k in (0, 9)] == pytest.approx([0.02 / 6] * 2)


@pytest.mark.parametrize("max_epochs, expected", [
    (3, [0.02 / 6, 0.02 / 6 + 0.02 * 5 / 6 / 5, 0.02 / 6 + 2 * 0.02 * 5 / 6 / 5]),  # every epoch in the warmup
    (7, [0.02 / 6 + e * 0.02 * 5 / 6 / 5 for e in range(5)] + [0.02, 0.02]),  # then initial_lr, as SG leaves it
])
def test_yolox_shortened_runs_the_warmup_then_holds_initial_lr(max_epochs, expected):
    params, _ = translate(YOLOX, supply=SUPPLY, overrides={"max_epochs": max_epochs})
    sched = LRSchedule(resolve_training_params(params), 4)
    assert [sched(4 * e) for e in range(max_epochs)] == pytest.approx(expected)


def test_the_full_yolox_schedule_keeps_its_cosine():
    params, _ = translate(YOLOX, supply=SUPPLY)
    assert params["lr_mode"] == "cosine" and params["lr_cooldown_epochs"] == 15


@pytest.mark.slow
def test_yolox_shortened_the_sg_way_trains_from_the_command_line(tmp_path, capsys):
    from fusetrain.train_from_recipe import main

    rc = main(["--config-name", "digits_detection", "--from-super-gradients", YOLOX, f"ckpt_root_dir={tmp_path}",
               "super_gradients.max_epochs=1", "super_gradients.max_train_batches=2",
               "super_gradients.max_valid_batches=1", "super_gradients.silent_mode=true", "training_params.device=cpu",
               "training_params.loss=fusetrain.models.DenseDetectionLoss", "training_params.callbacks=[]",
               "dataset_params.num_train=64", "dataset_params.num_valid=16", "dataset_params.valid_batch_size=16"])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    assert "lr_cooldown_epochs 15 >= max_epochs 1" in out
    result = json.loads(out[out.index("{\n"):])
    assert result["final"]["lr"] == pytest.approx(0.02 / 6)


def test_a_bare_name_of_a_shipped_sg_file_is_found():
    from fusetrain.compat.super_gradients import load_sg_params

    assert load_sg_params("coco2017_yolox_train_params.yaml")["lr_cooldown_epochs"] == 15
