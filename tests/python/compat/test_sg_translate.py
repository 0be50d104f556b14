"""SuperGradients training hyperparameters translated: the seven recipe files
shipped with fusetrain.compat.super_gradients, SG's defaults and semantics
(each checked against SG's documented rule), safe _target_ nodes and one
error per key that has no counterpart."""

import os

import pytest
import torch
from torch import nn

from fusetrain.training.build import build_optimizer
from fusetrain.amp import resolve_precision
from fusetrain.compat.super_gradients import SG_RECIPES_DIR, SGObject, SGTranslationError, load_sg_params, translate
from fusetrain.training.params import resolve_training_params
from fusetrain.training.schedules.lr import LRSchedule


#: The smallest SG training hyperparameters that translate.
BASE = {"max_epochs": 2, "initial_lr": 0.1, "loss": "CrossEntropyLoss", "valid_metrics_list": ["Accuracy"]}


def recipe(name):
    return os.path.join(SG_RECIPES_DIR, f"{name}_train_params.yaml")


#: The SG-only objects of each recipe file (SG key -> the fusetrain alternative its error names).
SG_ONLY = {
    "cifar10_resnet": {},
    "imagenet_resnet50": {},
    "imagenet_efficientnet": {},
    "coco2017_yolox": {"loss": "register_loss", "phase_callbacks": "callbacks"},
    "coco2017_yolo_nas_s": {"loss": "register_loss"},
    "cityscapes_pplite_seg": {"loss": "register_loss"},
    "cityscapes_regseg48": {},
}
#: fusetrain values that replace them.
SUPPLY = {"loss": "CrossEntropyLoss", "callbacks": []}


@pytest.mark.parametrize("name", sorted(SG_ONLY))
def test_each_recipe_translates_except_sg_only_objects(name):
    expected = SG_ONLY[name]
    if expected:
        with pytest.raises(SGTranslationError) as info:
            translate(recipe(name))
        errors = info.value.errors
        assert [e.split(":")[0] for e in errors] == list(expected), errors
        for error, alternative in zip(errors, expected.values()):
            assert alternative in error, error
        params, report = translate(recipe(name), supply={k: SUPPLY[k] for k in ("loss", "callbacks")})
        assert {e.sg_key for e in report.entries if e.kind == "supplied"} >= set(expected)
    else:
        params, report = translate(recipe(name))
    resolve_training_params(params)
    text = str(report)
    assert "reproduced on purpose" in text
    for line in report.reproduced:
        assert line in text
    sg_keys = set(load_sg_params(recipe(name)))
    assert sg_keys <= {e.sg_key for e in report.entries}  # every SG key is in the report


def test_sgd_merges_momentum_and_weight_decay_as_sg_does():
    params, report = translate(dict(BASE, optimizer="SGD"))
    assert params["optimizer_params"] == {"weight_decay": 1e-4, "momentum": 0.9}
    assert any("SGD" in r and "momentum" in r for r in report.reproduced)
    for sg_name, expected in [("Adam", {"weight_decay": 1e-4}), ("RMSProp", {"weight_decay": 1e-4, "momentum": 0.9}),
                              ("RMSpropTF", {"weight_decay": 1e-4, "momentum": 0.9}), ("AdamW", {})]:
        params, _ = translate(dict(BASE, optimizer=sg_name, optimizer_params={}))
        assert params["optimizer_params"] == expected, sg_name
    # The recipe's own values win over SG's defaults.
    params, _ = translate(dict(BASE, optimizer_params={"momentum": 0.5}))
    assert params["optimizer_params"] == {"weight_decay": 1e-4, "momentum": 0.5}


def test_the_translated_sgd_steps_like_torch_sgd_with_sg_hyperparameters():
    from fusetrain.training.trainer import Trainer

    params, _ = translate(recipe("cifar10_resnet"))
    p = resolve_training_params(params)
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    opt, _ = build_optimizer(model, p, torch.device("cpu"))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    for _ in range(3):
        x = torch.randn(8, 4)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_mixed_precision_is_fp16_with_a_loss_scaler(monkeypatch):
    # On a GPU; on a CPU SG turns mixed precision off (tests/python/training/test_meet_users.py).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    params, report = translate(recipe("imagenet_resnet50"))
    assert params["mixed_precision"] == "fp16"
    p = resolve_training_params(params)
    for device in ("cuda", "cpu"):
        precision = resolve_precision(p.mixed_precision, device)
        assert precision.name == "fp16" and precision.dtype == torch.float16
        assert precision.uses_scaler and precision.make_scaler().is_enabled()
    assert any("fp16" in r and "GradScaler" in r for r in report.reproduced)
    params, _ = translate(recipe("cifar10_resnet"))
    assert params["mixed_precision"] is False


def test_batch_accumulate_sums_as_sg_does():
    params, report = translate(recipe("imagenet_efficientnet"))
    assert params["batch_accumulate"] == 2 and params["batch_accumulate_reduction"] == "sum"
    assert any("sums the gradients" in r for r in report.reproduced)


def _sg_linear_epoch_warmup(initial_lr, warmup_epochs, warmup_initial_lr, epoch):
    """SG's LinearEpochLRWarmup at the start of ``epoch`` (its documented rule)."""
    start = initial_lr / (warmup_epochs + 1) if warmup_initial_lr is None else warmup_initial_lr
    return start + epoch * (initial_lr - start) / warmup_epochs


def test_epoch_warmup_gives_sg_rate_at_every_warmup_step():
    params, report = translate(recipe("imagenet_resnet50"))
    assert params["lr_warmup_mode"] == "linear_epoch" and params["lr_warmup_epochs"] == 5
    schedule = LRSchedule(resolve_training_params(params), 7)
    for step in range(5 * 7):
        assert schedule(step) == pytest.approx(_sg_linear_epoch_warmup(0.1, 5, None, step // 7), rel=1e-12), step
    assert schedule(5 * 7) == pytest.approx(0.1)
    assert any("initial_lr / (lr_warmup_epochs + 1)" in r for r in report.reproduced)
    params, _ = translate(recipe("imagenet_efficientnet"))  # an explicit warmup_initial_lr
    schedule = LRSchedule(resolve_training_params(params), 4)
    for step in range(3 * 4):
        assert schedule(step) == pytest.approx(_sg_linear_epoch_warmup(0.016, 3, 1e-6, step // 4)), step


def test_batch_warmup_gives_sg_rate_at_every_warmup_step():
    params, report = translate(recipe("coco2017_yolo_nas_s"), supply={"loss": "model"})
    assert params["lr_warmup_mode"] == "linspace" and params["lr_warmup_steps"] == 1000
    p = resolve_training_params(dict(params, valid_metrics=["map"], metric_to_watch="map_50"))
    for spe in (400, 2000):  # SG caps the warmup at one epoch: min(1000, steps per epoch) points of a linspace
        schedule = LRSchedule(p, spe)
        n = min(1000, spe)
        sg = [1e-6 + (2e-4 - 1e-6) * k / (n - 1) for k in range(n)] + [2e-4] * (1000 - n)
        got = [schedule(k) for k in range(1000)]
        assert got == pytest.approx(sg, rel=1e-9, abs=1e-15)
    assert any("capped at one epoch" in r for r in report.reproduced)


def test_step_decays_follow_sg_epochs():
    params, report = translate(recipe("imagenet_resnet50"))
    assert params["lr_updates"] == [31, 61]  # numpy.arange(30, 90, 30), each applied after its epoch ends
    params, _ = translate(recipe("cifar10_resnet"))
    schedule = LRSchedule(resolve_training_params(params), 1)
    # SG: StepLRScheduler at the end of epoch e (from 0) sets initial_lr * 0.1 ** #{u <= e}, used from epoch e + 1.
    for epoch in (0, 100, 101, 150, 151, 200, 201, 249):
        sg = 0.1 * 0.1 ** sum(1 for u in (100, 150, 200) if u <= epoch - 1)
        assert schedule(epoch) == pytest.approx(sg), epoch
    params, report = translate(recipe("imagenet_efficientnet"))  # step_lr_update_freq 2.4 from epoch 3
    import math
    sg = [math.ceil(2.4 * x) for x in range(1, 450) if 3 <= math.ceil(2.4 * x) < 450]
    assert params["lr_updates"] == [u + 1 for u in sg if u + 1 < 450]


def test_metric_names_match_as_sg_matches_them():
    for watch, metrics, expected in [("Accuracy", ["Accuracy"], "accuracy"), ("accuracy", ["Accuracy"], "accuracy"),
                                     ("top-5", ["Top5"], "top5"), ("iou", [{"IoU": {"num_classes": 3}}], "mean_iou"),
                                     ("map@0.50", ["DetectionMetrics_050"], "map_50"),
                                     ("mAP@0.50:0.95", ["DetectionMetrics"], "map"),
                                     ("CrossEntropyLoss", ["Accuracy"], "loss")]:
        params, report = translate({"max_epochs": 2, "initial_lr": 0.1, "loss": "CrossEntropyLoss",
                                    "valid_metrics_list": metrics, "metric_to_watch": watch})
        assert params["metric_to_watch"] == expected, watch
    assert params["valid_metrics"] == ["accuracy"] and params["train_metrics"] == []  # SG's default train list
    params, _ = translate(recipe("cityscapes_pplite_seg"), supply={"loss": "CrossEntropyLoss"})
    assert params["valid_metrics"] == [{"pixel_accuracy": {"ignore_index": 19}},
                                       {"mean_iou": {"num_classes": 20, "ignore_index": 19}}]
    assert params["metric_to_watch"] == "mean_iou"
    with pytest.raises(SGTranslationError, match="metric_to_watch: 'Recall@0.50'"):
        translate({"max_epochs": 2, "initial_lr": 0.1, "loss": "CrossEntropyLoss",
                   "valid_metrics_list": ["DetectionMetrics_050"], "metric_to_watch": "Recall@0.50"})


def test_loss_names_and_label_smoothing():
    params, report = translate({"max_epochs": 2, "initial_lr": 0.1, "loss": {"CrossEntropyLoss": {"smooth_eps": 0.1}},
                                "valid_metrics_list": ["Accuracy"]})
    assert params["loss"] == "CrossEntropyLoss" and params["loss_params"] == {"label_smoothing": 0.1}
    with pytest.raises(SGTranslationError, match="criterion_params.*smooth_dist"):
        translate(dict(BASE, criterion_params={"smooth_dist": [0.5, 0.5]}))


def test_per_prefix_initial_lr_and_frozen_prefixes():
    params, report = translate(recipe("cityscapes_pplite_seg"), supply={"loss": "CrossEntropyLoss"})
    assert params["initial_lr"] == {"encoder.backbone": 0.01, "default": 0.1}
    assert params["lr_mode"] == "poly" and params["poly_power"] == 0.9
    params, _ = translate(dict(BASE, initial_lr={"default": 0.1, "stem": 0}))
    assert params["initial_lr"] == {"default": 0.1} and params["freeze"] == ["stem*"]


def test_unsafe_targets_are_never_imported(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.yaml"
    path.write_text("defaults: [default_train_params]\nmax_epochs: 2\ninitial_lr: 0.1\nloss: CrossEntropyLoss\n"
                    "valid_metrics_list: [Accuracy]\n"
                    f"lr_updates:\n  _target_: os.system\n  command: touch {marker}\n"
                    f"warmup_initial_lr:\n  _target_: builtins.eval\n  _args_: [\"open('{marker}', 'w')\"]\n")
    sg = load_sg_params(str(path))
    assert isinstance(sg["lr_updates"], SGObject) and sg["lr_updates"].target == "os.system"
    with pytest.raises(SGTranslationError):
        translate(str(path), overrides={"lr_mode": "step", "lr_warmup_epochs": 1})
    assert not marker.exists()


def test_defaults_interpolations_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("defaults: [default_train_params]\nmax_epochs: 10\ninitial_lr: 0.5\n"
                                        "valid_metrics_list: [Accuracy]\n")
    (tmp_path / "mine.yaml").write_text("defaults: [base]\nloss: CrossEntropyLoss\nlr_mode: step\n"
                                        "lr_updates: {_target_: numpy.arange, start: 2, stop: '${max_epochs}', "
                                        "step: 4}\n")
    sg = load_sg_params(str(tmp_path / "mine.yaml"))
    assert sg["lr_updates"] == [2, 6] and sg["initial_lr"] == 0.5 and sg["optimizer"] == "SGD"
    params, _ = translate(str(tmp_path / "mine.yaml"), overrides={"max_epochs": 5})
    assert params["max_epochs"] == 5 and params["lr_updates"] == [3]


def test_unknown_and_sg_only_keys_are_one_error_each():
    with pytest.raises(SGTranslationError) as info:
        translate(dict(BASE, loss="PPYoloELoss", sg_logger="clearml_sg_logger", precise_bn=True, max_epoch=3))
    errors = info.value.errors
    assert len(errors) == 4, errors
    text = "\n".join(errors)
    assert "register_loss" in text and "loggers" in text and "callbacks" in text and "did you mean 'max_epochs'" in text


def test_no_warmup_callback_keeps_initial_lr_through_the_warmup_epochs():
    # SG without a warmup callback: its schedules start after lr_warmup_epochs, which run at initial_lr.
    params, report = translate(dict(BASE, warmup_mode=None, lr_warmup_epochs=1, lr_mode="cosine", max_epochs=3))
    schedule = LRSchedule(resolve_training_params(params), 2)
    assert [schedule(k) for k in range(3)] == pytest.approx([0.1, 0.1, 0.1])
    assert any("warmup_mode empty" in r for r in report.reproduced)


def test_a_broken_yaml_file_is_a_value_error_naming_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("defaults:\n  - default_train_params\nmax_epochs: [1\n")
    with pytest.raises(ValueError, match=rf"{path} is not readable YAML \(line 4, column 1\): expected ',' or ']'"):
        translate(str(path))
    path.write_bytes(b"\x80\x81")
    with pytest.raises(ValueError, match=rf"{path} is not readable YAML: 'utf-8' codec"):
        translate(str(path))
