"""Refused keys and values name what was meant: the synonym table (other
libraries' names) before the closest spelling, "did you mean" for values too,
and never a list of every valid key."""

import pytest

from fusetrain.training.params import TRAINING_PARAMS, TrainingParamsError, resolve_training_params
from fusetrain.training.params.synonyms import (KEY_SYNONYMS, LR_MODE_SYNONYMS, METRIC_NAME_SYNONYMS,
                                                WARMUP_MODE_SYNONYMS)
from fusetrain.training.params.table import LR_MODES, WARMUP_MODES


def refusal(params):
    with pytest.raises(TrainingParamsError) as info:
        resolve_training_params(params)
    assert len(info.value.errors) == 1, info.value.errors
    return info.value.errors[0]


@pytest.mark.parametrize("key, meant", [
    ("criterion_params", "loss_params"), ("silent_mode", "progress_bar"), ("train_metrics_list", "train_metrics"),
    ("phase_callbacks", "callbacks"), ("warmup_mode", "lr_warmup_mode"), ("accumulate_grad_batches",
                                                                           "batch_accumulate"),
    ("gradient_clip_val", "clip_grad_norm"), ("opt", "optimizer"), ("sched", "lr_mode"), ("lr", "initial_lr"),
    ("warmup_epochs", "lr_warmup_epochs"), ("cooldown_epochs", "lr_cooldown_epochs"),
])
def test_synonyms_come_before_the_closest_spelling(key, meant):
    assert refusal({key: 1}).endswith(f"unknown key {key!r}; did you mean {meant!r}?")


def test_a_misspelt_key_gets_the_closest_and_no_key_dump():
    assert "did you mean 'max_epochs'" in refusal({"max_epoch": 3})
    text = refusal({"zzzqqqxxy": 1})
    assert "docs/training_params.md" in text and "max_epochs" not in text and len(text) < 200


def test_the_synonym_table_points_at_real_keys():
    for key, target in KEY_SYNONYMS.items():
        assert key not in TRAINING_PARAMS, key
        assert target.split(".")[0] in TRAINING_PARAMS, (key, target)
    assert set(LR_MODE_SYNONYMS.values()) - set(LR_MODES) <= {"a function step -> lr (from Python)"}
    assert set(WARMUP_MODE_SYNONYMS.values()) <= set(WARMUP_MODES)


@pytest.mark.parametrize("mode, meant", [
    ("CosineLRScheduler", "cosine"), ("StepLRScheduler", "step"), ("PolyLRScheduler", "poly"),
    ("ExponentialLRScheduler", "exponential"), ("OneCycleLR", "onecycle"), ("cosin", "cosine"), ("Cosine", "cosine"),
])
def test_lr_mode_values_get_a_did_you_mean(mode, meant):
    text = refusal({"lr_mode": mode})
    assert text.startswith(f"training_params.lr_mode: got {mode!r}") and text.endswith(f"did you mean {meant!r}?")


def test_warmup_mode_and_optimizer_values_get_a_did_you_mean():
    assert refusal({"lr_warmup_mode": "LinearEpochLRWarmup"}).endswith("did you mean 'linear_epoch'?")
    assert refusal({"lr_warmup_mode": "LinearBatchLRWarmup"}).endswith("did you mean 'linspace'?")
    assert "did you mean 'AdamW'" in refusal({"optimizer": "adamw2"})


@pytest.mark.parametrize("watch, metrics, meant", [
    ("Accuracy", ["accuracy"], "accuracy"), ("IoU", ["mean_iou"], "mean_iou"), ("mAP@0.50:0.95", ["map"], "map"),
    ("mAP@0.50", ["map"], "map_50"), ("PixelAccuracy", ["pixel_accuracy"], "pixel_accuracy"),
])
def test_metric_to_watch_in_another_library_s_spelling_is_taken(watch, metrics, meant):
    # NOTE [metric names]: another library's name for a metric valid_metrics reports is that metric.
    assert resolve_training_params({"metric_to_watch": watch, "valid_metrics": metrics}).metric_to_watch == meant
    assert METRIC_NAME_SYNONYMS.get(watch, meant) == meant


def test_a_misspelt_metric_to_watch_gets_a_did_you_mean():
    text = refusal({"metric_to_watch": "accuracyy", "valid_metrics": ["accuracy"]})
    assert text.endswith("did you mean 'accuracy'?"), text


def test_a_nested_unknown_key_names_the_closest_only():
    text = refusal({"optimizer": "SGD", "optimizer_params": {"momentun": 0.9}})
    assert "did you mean 'momentum'?" in text
