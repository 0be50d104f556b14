"""The training_params schema: defaults, per-key validation with its messages,
nested dicts, cross-key checks, OmegaConf input, immutability and the
generated reference page."""

import copy
import inspect
import json
import math
import pathlib
import pickle
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import fusetrain
from fusetrain import LossScaler, ModelEMA
from fusetrain.training import TRAINING_PARAMS, TrainingParams, TrainingParamsError, resolve_training_params
from fusetrain.training import params as P

REPO = pathlib.Path(__file__).resolve().parents[4]

EXPECTED_DEFAULTS = {
    "max_epochs": 10, "max_steps": None, "optimizer": "AdamW", "optimizer_params": {}, "initial_lr": 1e-3,
    "lr_mode": "constant",
    "lr_updates": [], "step_lr_update_freq": None, "lr_decay_factor": 0.1, "cosine_final_lr_ratio": 0.01, "cosine_restart_epochs": 10.0,
    "cosine_restart_mult": 1, "poly_power": 0.9, "plateau_patience": 10, "plateau_min_delta": 0.0,
    "linear_final_lr_ratio": 0.0,
    "onecycle_pct_start": 0.3, "onecycle_div_factor": 25.0, "onecycle_final_div_factor": 1e4,
    "cyclic_min_lr_ratio": 0.1, "cyclic_period_epochs": 2.0, "lr_warmup_epochs": 0, "lr_warmup_steps": 0,
    "lr_warmup_mode": "linear", "warmup_initial_lr": None, "lr_cooldown_epochs": 0,
    "momentum_schedule": "constant", "momentum_final": 0.85, "weight_decay_schedule": "constant",
    "weight_decay_final": 0.0,
    "zero_weight_decay_on_bias_and_bn": False,
    "lr_multipliers": {}, "layer_decay": None, "pretrained_weights": None,
    "pretrained_params": {"strict": False, "key_map": {}, "use_ema": False, "trusted": False}, "freeze": [],
    "freeze_bn_stats": False,
    "mixed_precision": False,
    "weights_dtype": "float32",
    "scaler_params": {}, "torch_compile": False, "torch_compile_mode": "default", "torch_compile_options": {},
    "compile_step": "off",
    "ema": False, "ema_params": {}, "clip_grad_norm": None, "batch_accumulate": 1, "batch_accumulate_reduction": "mean",
    "sync_bn": False,
    "channels_last": False, "loss": "cross_entropy", "loss_params": {}, "train_metrics": ["accuracy"],
    "valid_metrics": ["accuracy"], "metric_to_watch": "accuracy", "greater_metric_to_watch_is_better": True,
    "run_validation_freq": 1, "valid_every_n_steps": 0, "max_train_batches": None, "max_valid_batches": None,
    "save_ckpt_epoch_list": [], "average_best_models": False, "number_of_models_to_average": 10,
    "ckpt_every_n_steps": 0, "ckpt_every_minutes": 0.0, "keep_last_ckpts": 0, "async_checkpoints": True,
    "resume_skip": "fast", "resume": False, "preemption_signals": ["SIGTERM", "SIGUSR1"], "auto_requeue": False,
    "resume_path": None, "resume_trusted": False,
    "overwrite_experiment": False, "seed": 42, "cudnn_benchmark": True,
    "early_stopping": None,
    "log_interval": 0, "loggers": [], "logger_params": {}, "export": [], "model_input": "auto", "split_batch": None,
    "callbacks": [], "device": "auto", "multi_gpu": "auto",
    "fsdp_params": {"wrap": "blocks", "reshard_after_forward": True}, "num_gpus": None, "num_processes": None,
    "dist_backend": "auto", "dist_timeout_s": 300.0, "find_unused_parameters": False, "progress_bar": True,
}

BOOL = "a bool (true or false)"
OPTIMIZER_ALLOWED = ("one of 'AdamW', 'Adam', 'SGD', 'Lion', 'RMSprop', 'RMSpropTF', 'Adadelta', 'RAdam', 'NAdam', "
                     "'Lamb', 'AdamP', 'Muon' "
                     "(case-insensitive) or a torch.optim.Optimizer subclass (the class, not an instance)")
LOSS_ALLOWED = ("a loss name (a torch.nn loss class name such as 'CrossEntropyLoss', one of 'cross_entropy', 'mse', "
                "'l1', 'smooth_l1', 'bce_with_logits', 'nll', a name registered with fusetrain.register_loss, a class "
                "path, or 'model') or a callable (outputs, targets) -> loss (an nn.Module instance or a function)")
METRICS_ALLOWED = ("a list of metrics, each a registered name ('accuracy', 'loss', 'map', 'mean_iou', "
                   "'pixel_accuracy', 'top5'), a class path, a one-entry mapping {name: {arguments}}, or a metric "
                   "object (no duplicates)")


INITIAL_LR_ALLOWED = ("a float > 0, or a dict of parameter-name prefix -> learning rate > 0 with a 'default' entry "
                      "(e.g. {default: 0.01, backbone: 0.001})")


def _msg(key, value, allowed):
    return f"training_params.{key}: got {value!r} ({type(value).__name__}); allowed: {allowed}"


# (key, a valid value, an invalid value, the exact error message for the invalid value)
CASES = [
    ("max_epochs", 3, 0, _msg("max_epochs", 0, "an int >= 1")),
    ("max_epochs", 3, 2.0, _msg("max_epochs", 2.0, "an int >= 1")),
    ("max_epochs", 3, True, _msg("max_epochs", True, "an int >= 1")),
    ("max_steps", 5000, 0, _msg("max_steps", 0, "an int >= 1 or None")),
    ("optimizer", "Lion", "adamax", _msg("optimizer", "adamax", OPTIMIZER_ALLOWED)
     + "; did you mean 'Adam' or 'RAdam' or 'NAdam'?"),
    ("optimizer", torch.optim.RMSprop, nn.Linear, _msg("optimizer", nn.Linear, OPTIMIZER_ALLOWED)),
    ("optimizer_params", {"weight_decay": 0.05, "betas": [0.9, 0.95]}, ["weight_decay"],
     _msg("optimizer_params", ["weight_decay"], "a dict of the optimizer's keyword arguments")),
    ("initial_lr", 0.01, -1, "training_params.initial_lr: got -1 (int); allowed: " + INITIAL_LR_ALLOWED),
    ("initial_lr", 0.01, 0.0, _msg("initial_lr", 0.0, INITIAL_LR_ALLOWED)),
    ("initial_lr", 0.01, "1e-3", _msg("initial_lr", "1e-3", INITIAL_LR_ALLOWED)),
    ("initial_lr", 0.01, True, _msg("initial_lr", True, INITIAL_LR_ALLOWED)),
    ("initial_lr", 0.01, float("inf"), _msg("initial_lr", float("inf"), INITIAL_LR_ALLOWED)),
    ("initial_lr", {"default": 0.1, "backbone": 0.01}, {"backbone": 0.01},
     "training_params.initial_lr: got {'backbone': 0.01} (dict) without a 'default' entry; allowed: "
     + INITIAL_LR_ALLOWED),
    ("lr_mode", "cosine", "exp",
     _msg("lr_mode", "exp", "one of 'constant', 'step', 'cosine', 'onecycle', 'cyclic', 'linear', 'poly', "
          "'exponential', 'cosine_restarts', 'plateau' or a function step -> lr (from Python)")
     + "; did you mean 'exponential'?"),
    ("lr_mode", math.sqrt, 3,
     _msg("lr_mode", 3, "one of 'constant', 'step', 'cosine', 'onecycle', 'cyclic', 'linear', 'poly', "
          "'exponential', 'cosine_restarts', 'plateau' or a function step -> lr (from Python)")),
    ("cosine_restart_epochs", 2.5, 0, _msg("cosine_restart_epochs", 0, "a float > 0")),
    ("cosine_restart_mult", 2, 1.5, _msg("cosine_restart_mult", 1.5, "an int >= 1")),
    ("poly_power", 2.0, -1.0, _msg("poly_power", -1.0, "a float > 0")),
    ("plateau_patience", 3, -1, _msg("plateau_patience", -1, "an int >= 0")),
    ("plateau_min_delta", 0.01, -0.1, _msg("plateau_min_delta", -0.1, "a float >= 0")),
    ("lr_warmup_mode", "exponential", "cosine",
     _msg("lr_warmup_mode", "cosine", "one of 'linear', 'constant', 'exponential', 'linear_epoch', 'linspace'")),
    ("step_lr_update_freq", 2.5, 0, _msg("step_lr_update_freq", 0, "a float > 0 or None")),
    ("lr_cooldown_epochs", 2, -1, _msg("lr_cooldown_epochs", -1, "an int >= 0")),
    ("momentum_schedule", "cosine", "cyclic",
     _msg("momentum_schedule", "cyclic", "one of 'constant', 'cosine', 'linear', 'onecycle'")),
    ("momentum_final", 0.9, 1.0, _msg("momentum_final", 1.0, "a float in [0, 1)")),
    ("weight_decay_schedule", "linear", "step",
     _msg("weight_decay_schedule", "step", "one of 'constant', 'cosine', 'linear'")),
    ("weight_decay_final", 0.01, -0.1, _msg("weight_decay_final", -0.1, "a float >= 0")),
    ("batch_accumulate_reduction", "sum", "avg", _msg("batch_accumulate_reduction", "avg", "one of 'mean', 'sum'")),
    ("lr_updates", [2, 5], "3", _msg("lr_updates", "3", "a list of ints >= 1 (epochs)")),
    ("lr_updates", [2, 5], [2, 0], "training_params.lr_updates[1]: got 0 (int); allowed: an int >= 1"),
    ("lr_decay_factor", 0.5, 0, _msg("lr_decay_factor", 0, "a float in (0, 1]")),
    ("lr_decay_factor", 1.0, 1.5, _msg("lr_decay_factor", 1.5, "a float in (0, 1]")),
    ("cosine_final_lr_ratio", 0.0, 1.1, _msg("cosine_final_lr_ratio", 1.1, "a float in [0, 1]")),
    ("linear_final_lr_ratio", 1.0, -0.1, _msg("linear_final_lr_ratio", -0.1, "a float in [0, 1]")),
    ("onecycle_pct_start", 0.5, 1, _msg("onecycle_pct_start", 1, "a float in (0, 1)")),
    ("onecycle_pct_start", 0.5, 0.0, _msg("onecycle_pct_start", 0.0, "a float in (0, 1)")),
    ("onecycle_div_factor", 10.0, 0, _msg("onecycle_div_factor", 0, "a float > 0")),
    ("onecycle_final_div_factor", 100.0, -1.0, _msg("onecycle_final_div_factor", -1.0, "a float > 0")),
    ("cyclic_min_lr_ratio", 1.0, 0.0, _msg("cyclic_min_lr_ratio", 0.0, "a float in (0, 1]")),
    ("cyclic_period_epochs", 0.5, 0, _msg("cyclic_period_epochs", 0, "a float > 0")),
    ("lr_warmup_epochs", 2, -1, _msg("lr_warmup_epochs", -1, "an int >= 0")),
    ("lr_warmup_steps", 100, 1.5, _msg("lr_warmup_steps", 1.5, "an int >= 0")),
    ("warmup_initial_lr", 0.0, -0.1, _msg("warmup_initial_lr", -0.1, "a float >= 0 or None")),
    ("zero_weight_decay_on_bias_and_bn", True, 1, _msg("zero_weight_decay_on_bias_and_bn", 1, BOOL)),
    ("lr_multipliers", {"backbone": 0.1, "*.bias": 2.0}, {"backbone": 0},
     "training_params.lr_multipliers['backbone']: got 0 (int); allowed: a float > 0"),
    ("layer_decay", {"rate": 0.75, "pattern": r"layers\.(\d+)\."}, {"pattern": "x"},
     "training_params.layer_decay: missing required key 'rate' (a float in (0, 1])"),
    ("pretrained_weights", "weights/resnet50.pth", 3, _msg("pretrained_weights", 3, "a file path or None")),
    ("pretrained_params", {"strict": True, "key_map": {"": "backbone."}, "use_ema": False, "trusted": True},
     {"key_map": {"a": 1}},
     "training_params.pretrained_params.key_map['a']: got 1 (int); allowed: a key prefix (a string, may be empty)"),
    ("freeze", ["backbone"], "backbone", _msg("freeze", "backbone", "a list of parameter-name patterns")),
    ("freeze_bn_stats", True, "yes", _msg("freeze_bn_stats", "yes", BOOL)),
    ("mixed_precision", "bf16", "fp8",
     _msg("mixed_precision", "fp8", "a bool (true or false) or one of 'fp16', 'bf16', 'fp32' (case-insensitive)")),
    ("mixed_precision", True, 1,
     _msg("mixed_precision", 1, "a bool (true or false) or one of 'fp16', 'bf16', 'fp32' (case-insensitive)")),
    ("weights_dtype", "bfloat16", "fp16", _msg("weights_dtype", "fp16", "one of 'float32', 'bfloat16' (case-insensitive)")),
    ("scaler_params", {"init_scale": 1024.0, "growth_interval": 100}, {"init_scal": 2.0},
     "training_params.scaler_params: unknown key 'init_scal'; did you mean 'init_scale'?"),
    ("torch_compile", True, "true", _msg("torch_compile", "true", BOOL)),
    ("torch_compile_mode", "max-autotune", "fast",
     _msg("torch_compile_mode", "fast", "one of 'default', 'reduce-overhead', 'max-autotune'")),
    ("torch_compile_options", {"fullgraph": True, "dynamic": None, "backend": "eager"}, {"fullgraph": 1},
     "training_params.torch_compile_options.fullgraph: got 1 (int); allowed: " + BOOL),
    ("compile_step", "compile", "Compile",
     _msg("compile_step", "Compile", "one of 'off', 'compile', 'cuda_graph' (false means 'off')")),
    ("ema", True, 0, _msg("ema", 0, BOOL)),
    ("ema_params", {"decay": 0.999, "decay_type": "threshold"}, {"decya": 0.9},
     "training_params.ema_params: unknown key 'decya'; did you mean 'decay'?"),
    ("clip_grad_norm", 1.0, 0.0, _msg("clip_grad_norm", 0.0, "a float > 0 or None")),
    ("batch_accumulate", 4, 0, _msg("batch_accumulate", 0, "an int >= 1")),
    ("sync_bn", True, None, _msg("sync_bn", None, BOOL)),
    ("channels_last", True, "no", _msg("channels_last", "no", BOOL)),
    ("loss", "mse", "hinge_embeding", "training_params.loss: unknown loss 'hinge_embeding'; did you mean "
                                     "'HingeEmbeddingLoss'?"),
    ("loss", "CrossEntropyLoss", 3, _msg("loss", 3, LOSS_ALLOWED)),
    ("loss", nn.MSELoss(), nn.MSELoss, _msg("loss", nn.MSELoss, LOSS_ALLOWED)),
    ("loss_params", {"label_smoothing": 0.1}, "label_smoothing",
     _msg("loss_params", "label_smoothing", "a dict of the loss class's keyword arguments")),
    ("train_metrics", ["accuracy", "top5", "loss"], ["acuracy"],
     "training_params.train_metrics[0]: unknown metric 'acuracy'; did you mean 'accuracy'?"),
    ("valid_metrics", ["accuracy", "top5"], "accuracy", _msg("valid_metrics", "accuracy", METRICS_ALLOWED)),
    ("valid_metrics", ["accuracy", "top5"], ["accuracy", "accuracy"],
     _msg("valid_metrics", ["accuracy", "accuracy"], METRICS_ALLOWED)),
    ("metric_to_watch", "loss", "",
     _msg("metric_to_watch", "", "a metric name: 'loss' or a name reported by valid_metrics")),
    ("greater_metric_to_watch_is_better", False, "False", _msg("greater_metric_to_watch_is_better", "False", BOOL)),
    ("run_validation_freq", 2, 0, _msg("run_validation_freq", 0, "an int >= 1")),
    ("max_train_batches", 5, 0, _msg("max_train_batches", 0, "an int >= 1 or None")),
    ("max_valid_batches", 3, -1, _msg("max_valid_batches", -1, "an int >= 1 or None")),
    ("save_ckpt_epoch_list", [1, 5], [0], "training_params.save_ckpt_epoch_list[0]: got 0 (int); allowed: an int >= 1"),
    ("valid_every_n_steps", 500, -1, _msg("valid_every_n_steps", -1, "an int >= 0")),
    ("ckpt_every_n_steps", 1000, 1.5, _msg("ckpt_every_n_steps", 1.5, "an int >= 0")),
    ("ckpt_every_minutes", 30, -2.0, _msg("ckpt_every_minutes", -2.0, "a float >= 0")),
    ("keep_last_ckpts", 3, -1, _msg("keep_last_ckpts", -1, "an int >= 0")),
    ("async_checkpoints", True, "yes", _msg("async_checkpoints", "yes", BOOL)),
    ("average_best_models", True, "yes", _msg("average_best_models", "yes", BOOL)),
    ("number_of_models_to_average", 5, 0, _msg("number_of_models_to_average", 0, "an int >= 1")),
    ("resume_skip", "replay", "skip", _msg("resume_skip", "skip", "one of 'fast', 'replay'")),
    ("resume", "auto", "True", _msg("resume", "True", "a bool or 'auto'")),
    ("preemption_signals", ["SIGUSR2"], "SIGUSR1",
     _msg("preemption_signals", "SIGUSR1", "a list of values, each a signal name ('SIGTERM', 'SIGUSR1', 'USR2', ...; "
          "not SIGINT, which always stops, nor SIGKILL), no duplicates")),
    ("auto_requeue", True, "yes", _msg("auto_requeue", "yes", BOOL)),
    ("resume_path", "runs/ckpt_latest.pth", "",
     _msg("resume_path", "", "a non-empty string (a checkpoint path) or None")),
    ("resume_trusted", True, "yes", _msg("resume_trusted", "yes", BOOL)),
    ("overwrite_experiment", True, "yes", _msg("overwrite_experiment", "yes", BOOL)),
    ("seed", 0, -1, _msg("seed", -1, "an int >= 0")),
    ("cudnn_benchmark", False, 1, _msg("cudnn_benchmark", 1, BOOL)),
    ("early_stopping", {"patience": 3, "min_delta": 0.01}, {"patience": 0},
     "training_params.early_stopping.patience: got 0 (int); allowed: an int >= 1"),
    ("log_interval", 10, -1, _msg("log_interval", -1, "an int >= 0")),
    ("loggers", ["csv", "jsonl"], ["csvv"],
     "training_params.loggers[0]: got 'csvv' (str); allowed: one of 'tensorboard', 'csv', 'jsonl', 'wandb', "
     "'mlflow' or an object with log_scalars(step, values) and close() (from Python); did you mean 'csv'?"),
    ("logger_params", {"wandb": {"project": "p"}}, ["wandb"],
     _msg("logger_params", ["wandb"], "a dict of logger name -> keyword arguments")),
    ("export", ["model.pt2", "model.onnx"], ["model.pth"],
     "training_params.export[0]: got 'model.pth' (str); allowed: a file name ending in .pt2 or .onnx"),
    ("model_input", "unpack", "spread", _msg("model_input", "spread", "one of 'auto', 'unpack', 'whole', or a "
                                             "function (model, inputs) -> outputs (or its path, "
                                             "package.module.function)")),
    ("split_batch", "operator.itemgetter", 3, _msg("split_batch", 3, "a function batch -> (inputs, targets) (or its "
                                                   "path, package.module.function) or None")),
    ("callbacks", ["ThresholdStop"], ["TresholdStop"],
     "training_params.callbacks[0]: unknown callback 'TresholdStop'; did you mean 'ThresholdStop'?"),
    ("device", "cuda:1", "gpu", _msg("device", "gpu", "'auto', 'cpu', 'cuda' or 'cuda:N' (N a device index)")
     + "; did you mean 'cuda'?"),
    ("multi_gpu", "fsdp", "mpi", _msg("multi_gpu", "mpi", "one of 'off', 'auto', 'ddp', 'fsdp' (case-insensitive; "
                                                          "false means 'off', true 'ddp')")),
    ("fsdp_params", {"wrap": ["Linear"], "reshard_after_forward": False}, {"wrap": "block"},
     _msg("fsdp_params.wrap", "block", "'blocks', a list of module class names, or a function module -> bool (or "
                                       "its path)") + "; did you mean 'blocks'?"),
    ("num_gpus", 1, 0, _msg("num_gpus", 0, "an int >= 1 or None")),
    ("num_processes", 1, 2.0, _msg("num_processes", 2.0, "an int >= 1 or None")),
    ("dist_backend", "gloo", "mpi", _msg("dist_backend", "mpi", "one of 'auto', 'nccl', 'gloo'")),
    ("dist_timeout_s", 60.0, 0, _msg("dist_timeout_s", 0, "a float > 0")),
    ("find_unused_parameters", True, "yes", _msg("find_unused_parameters", "yes", BOOL)),
    ("progress_bar", False, "off", _msg("progress_bar", "off", BOOL)),
]


def _errors(user):
    with pytest.raises(TrainingParamsError) as info:
        resolve_training_params(user)
    return info.value


def _error(user):
    err = _errors(user)
    assert len(err.errors) == 1, err.errors
    return str(err)


# ---- defaults and the table ------------------------------------------------------------------


def test_defaults():
    for user in (None, {}, OmegaConf.create({})):
        p = resolve_training_params(user)
        assert p.to_dict() == EXPECTED_DEFAULTS
        assert list(p) == list(EXPECTED_DEFAULTS)  # the table's order
    assert TrainingParams().to_dict() == EXPECTED_DEFAULTS
    p = resolve_training_params(None)
    assert p.max_epochs == 10 and p.optimizer == "AdamW" and p.initial_lr == 1e-3 and p.warmup_initial_lr is None


def test_table_rows():
    assert list(TRAINING_PARAMS) == list(EXPECTED_DEFAULTS)
    for name, spec in TRAINING_PARAMS.items():
        assert spec.name == name
        # train_metrics None resolves to the default that fits the loss ([accuracy] for cross_entropy)
        assert spec.default == (None if name == "train_metrics" else EXPECTED_DEFAULTS[name])
        assert spec.allowed and spec.allowed == spec.validator.description
        # One user-facing paragraph per key.
        assert len(spec.doc) > 40 and "\n" not in spec.doc and spec.doc.endswith("."), name
        # The default passes its own validator unchanged.
        assert spec.validator(copy.deepcopy(spec.default), name) == spec.default


def test_every_key_has_cases():
    assert {c[0] for c in CASES} == set(TRAINING_PARAMS)


@pytest.mark.parametrize("key,good,bad,message", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_key_accepts_and_rejects(key, good, bad, message):
    p = resolve_training_params({key: good})
    expected = {"early_stopping": {"patience": 3, "min_delta": 0.01}}.get(key, good)
    assert p[key] == expected
    assert getattr(p, key) == expected
    err = _errors({key: bad})
    assert err.errors == [message]
    assert str(err) == message
    assert isinstance(err, ValueError)


@pytest.mark.parametrize("key", [k for k, s in TRAINING_PARAMS.items() if s.allowed == BOOL])
def test_bool_keys_need_real_bools(key):
    for v in (True, False):
        assert resolve_training_params({key: v})[key] is v
    for v in (1, 0, "yes", "true", "False", None, 1.0):
        assert _error({key: v}) == _msg(key, v, BOOL)


def test_yaml_bools_accepted():
    cfg = OmegaConf.create("ema: true\nchannels_last: false\nprogress_bar: no\ntorch_compile: yes\n")
    p = resolve_training_params(cfg)
    assert (p.ema, p.channels_last, p.progress_bar, p.torch_compile) == (True, False, False, True)


@pytest.mark.parametrize("key", [k for k, s in TRAINING_PARAMS.items() if s.allowed.startswith("an int")])
def test_int_keys_reject_bools_and_floats(key):
    for v in (True, False, 3.0, "3"):
        msg = _error({key: v})
        assert msg.startswith(f"training_params.{key}: got {v!r} ({type(v).__name__}); allowed: an int")
    value = resolve_training_params({key: 7})[key]
    assert value == 7 and type(value) is int


@pytest.mark.parametrize("key", [k for k, s in TRAINING_PARAMS.items() if s.allowed.startswith("a float")])
def test_float_keys_accept_ints(key):
    value = resolve_training_params({key: {"onecycle_pct_start": 0.5, "momentum_final": 0}.get(key, 1)})[key]
    assert type(value) is float
    for v in (True, float("nan"), "0.5"):
        assert f"training_params.{key}: got {v!r} ({type(v).__name__}); allowed: a float" in _error({key: v})


def test_float_bounds_inclusive_and_exclusive():
    ok = [("lr_decay_factor", 1), ("cosine_final_lr_ratio", 0), ("cosine_final_lr_ratio", 1),
          ("cyclic_min_lr_ratio", 1), ("warmup_initial_lr", 0), ("onecycle_pct_start", 0.999)]
    bad = [("lr_decay_factor", 0), ("onecycle_pct_start", 0), ("onecycle_pct_start", 1), ("cyclic_min_lr_ratio", 0),
           ("initial_lr", 0), ("clip_grad_norm", 0), ("cyclic_period_epochs", -1e-9)]
    for key, v in ok:
        assert resolve_training_params({key: v})[key] == v
    for key, v in bad:
        _error({key: v})


def test_normalisation():
    p = resolve_training_params({"optimizer": "adamw", "mixed_precision": "FP16", "initial_lr": 1, "seed": 3})
    assert p.optimizer == "AdamW" and p.mixed_precision == "fp16"
    assert p.initial_lr == 1.0 and type(p.initial_lr) is float
    for given, canonical in [("ADAM", "Adam"), ("sgd", "SGD"), ("LiOn", "Lion"), ("AdamW", "AdamW"),
                             ("rmsprop", "RMSprop"), ("ADADELTA", "Adadelta"), ("radam", "RAdam")]:
        assert resolve_training_params({"optimizer": given}).optimizer == canonical
    for given, canonical in [("Bf16", "bf16"), ("fp32", "fp32"), (True, True), (False, False)]:
        assert resolve_training_params({"mixed_precision": given}).mixed_precision == canonical
    assert resolve_training_params({"lr_updates": (2, 4)}).lr_updates == [2, 4]
    assert P.optimizer_class("adamw") is fusetrain.optim.AdamW
    assert P.optimizer_class(torch.optim.SGD) is torch.optim.SGD
    assert P.optimizer_class("rmsprop") is fusetrain.optim.RMSprop
    with pytest.raises(ValueError, match="training_params.optimizer"):
        P.optimizer_class("adagrad")


# ---- unknown keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("typo,suggestion", [("max_epoch", "max_epochs"), ("mixed_precison", "mixed_precision"),
                                             ("inital_lr", "initial_lr"), ("lr", "initial_lr"),
                                             ("weight_decay", "optimizer_params.weight_decay")])
def test_unknown_key_suggests_closest(typo, suggestion):
    assert _error({typo: 1}) == f"training_params: unknown key {typo!r}; did you mean {suggestion!r}?"


def test_unknown_key_without_close_match_points_to_the_docs():
    assert _error({"qqqqqq": 1}) == (f"training_params: unknown key 'qqqqqq'; no valid key is close (see "
                                     f"docs/training_params.md for all {len(TRAINING_PARAMS)})")


def test_all_problems_reported():
    err = _errors({"max_epoch": 3, "ema": 1, "seed": -1})
    assert err.errors == ["training_params: unknown key 'max_epoch'; did you mean 'max_epochs'?",
                          _msg("ema", 1, BOOL), _msg("seed", -1, "an int >= 0")]
    assert str(err).startswith("training_params: 3 problems:\n  - training_params: unknown key 'max_epoch'")


def test_bad_top_level_input():
    assert _error([("max_epochs", 3)]) == ("training_params: got [('max_epochs', 3)] (list); allowed: a dict "
                                           "(or an OmegaConf DictConfig) of training parameters")
    assert _error({1: 2}) == "training_params: keys must be strings, got 1 (int)"


# ---- nested dicts -------------------------------------------------------------------------------


def test_ema_params_keys_are_model_ema_kwargs():
    names = [n for n in inspect.signature(ModelEMA.__init__).parameters if n not in ("self", "model")]
    values = {"decay": 0.99, "decay_type": "threshold", "beta": 10.0, "total_steps": 100, "warmup": True,
              "warmup_gamma": 2.0, "warmup_power": 0.75, "include_buffers": False, "remainder": False}
    assert sorted(values) == sorted(names)
    p = resolve_training_params({"ema": True, "ema_params": values})
    assert p.ema_params == values
    ema = ModelEMA(nn.Linear(3, 2), **p.ema_params)  # what the Trainer does with them
    assert ema.decay == 0.99 and ema.decay_type == "threshold"
    assert _error({"ema_params": {"model": None}}) == ("training_params.ema_params: key 'model' is not allowed; "
                                                       "the EMA follows the model being trained")
    assert _error({"ema_params": {"zzz": 1}}) == ("training_params.ema_params: unknown key 'zzz'; valid keys: "
                                                  + ", ".join(names))
    assert _error({"ema_params": 0.99}) == _msg("ema_params", 0.99, "a dict of fusetrain.ModelEMA keyword arguments")


def test_scaler_params_keys_are_loss_scaler_kwargs():
    values = {"init_scale": 256.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 10}
    p = resolve_training_params({"mixed_precision": "fp16", "scaler_params": values})
    assert p.scaler_params == values
    scaler = LossScaler(**p.scaler_params)
    assert scaler.is_enabled()
    for key in ("device", "enabled"):
        assert _error({"scaler_params": {key: True}}).startswith(
            f"training_params.scaler_params: key {key!r} is not allowed; ")
    assert _error({"scaler_params": {"growth_intervl": 5}}) == (
        "training_params.scaler_params: unknown key 'growth_intervl'; did you mean 'growth_interval'?")


@pytest.mark.parametrize("name,kwargs", [
    ("AdamW", {"betas": [0.9, 0.95], "eps": 1e-7, "weight_decay": 0.05, "amsgrad": True, "master_weights": True}),
    ("Adam", {"betas": (0.8, 0.9), "weight_decay": 0.01, "maximize": True}),
    ("SGD", {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-4, "dampening": 0.0}),
    ("Lion", {"betas": [0.95, 0.98], "weight_decay": 0.1}),
])
def test_optimizer_params_build_the_optimizer(name, kwargs):
    p = resolve_training_params({"optimizer": name.lower(), "optimizer_params": kwargs, "initial_lr": 0.02})
    w = nn.Parameter(torch.randn(5))
    opt = P.optimizer_class(p.optimizer)([w], lr=p.initial_lr, **p.optimizer_params)
    assert type(opt) is getattr(fusetrain.optim, name)
    assert opt.param_groups[0]["lr"] == 0.02
    for k, v in kwargs.items():
        got = opt.param_groups[0][k]
        assert tuple(got) == tuple(v) if isinstance(v, (list, tuple)) else got == v


def test_optimizer_params_checked_against_signature():
    assert _error({"optimizer_params": {"betaz": [0.9, 0.99]}}) == (
        "training_params.optimizer_params: unknown key 'betaz'; did you mean 'betas'? (for optimizer AdamW)")
    # A key another built-in optimizer takes names that optimizer (tests/python/training/test_meet_users.py).
    msg = _error({"optimizer": "SGD", "optimizer_params": {"betas": [0.9, 0.99]}})
    assert msg.startswith("training_params.optimizer_params: 'betas' is not an argument of SGD; it is one of AdamW, ")
    assert "SGD takes: momentum, dampening, " in msg
    msg = _error({"optimizer": "SGD", "optimizer_params": {"betaz": [0.9, 0.99]}})
    assert msg.startswith("training_params.optimizer_params: unknown key 'betaz'; valid keys: momentum, dampening, ")
    assert msg.endswith("(for optimizer SGD)")
    assert _error({"optimizer_params": {"lr": 0.1}}) == (
        "training_params.optimizer_params: key 'lr' is not allowed; set the learning rate with "
        "training_params.initial_lr")
    assert "key 'params' is not allowed" in _error({"optimizer_params": {"params": []}})
    assert _error({"optimizer": "Lion", "optimizer_params": {"max_grad_norm": 1.0}}) == (
        "training_params.optimizer_params: key 'max_grad_norm' is not allowed; set gradient clipping with "
        "training_params.clip_grad_norm")


def test_custom_optimizer_class():
    p = resolve_training_params({"optimizer": torch.optim.RMSprop, "optimizer_params": {"alpha": 0.9}})
    assert p.optimizer is torch.optim.RMSprop and p.optimizer_params == {"alpha": 0.9}
    assert _error({"optimizer": torch.optim.RMSprop, "optimizer_params": {"alpah": 0.9}}) == (
        "training_params.optimizer_params: unknown key 'alpah'; did you mean 'alpha'? (for optimizer RMSprop)")

    class AnyKwargs(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1, **kwargs):
            super().__init__(params, dict(lr=lr, **kwargs))

    class NoLr(torch.optim.Optimizer):
        def __init__(self, params, momentum=0.0):
            super().__init__(params, dict(momentum=momentum))

    p = resolve_training_params({"optimizer": AnyKwargs, "optimizer_params": {"anything": 1, "max_grad_norm": 2.0}})
    assert p.optimizer_params == {"anything": 1, "max_grad_norm": 2.0}
    assert "key 'lr' is not allowed" in _error({"optimizer": AnyKwargs, "optimizer_params": {"lr": 1.0}})
    assert _error({"optimizer": NoLr}) == (
        "training_params.optimizer: NoLr takes no 'lr' argument; the Trainer builds the optimizer as "
        "cls(param_groups, lr=initial_lr, **optimizer_params)")
    instance = torch.optim.SGD([nn.Parameter(torch.randn(2))], lr=0.1)
    assert _error({"optimizer": instance}) == f"training_params.optimizer: got <SGD object> (SGD); allowed: " \
                                              f"{OPTIMIZER_ALLOWED}"


def test_torch_compile_options():
    backend = lambda gm, example_inputs: gm  # noqa: E731
    values = {"fullgraph": False, "dynamic": True, "backend": backend, "options": {"trace.enabled": False},
              "disable": False}
    p = resolve_training_params({"torch_compile": True, "torch_compile_options": values})
    assert p.torch_compile_options == values
    assert p.torch_compile_options["backend"] is backend
    assert _error({"torch_compile_options": {"mode": "max-autotune"}}) == (
        "training_params.torch_compile_options: key 'mode' is not allowed; set it with "
        "training_params.torch_compile_mode")
    assert _error({"torch_compile_options": {"fulgraph": True}}) == (
        "training_params.torch_compile_options: unknown key 'fulgraph'; did you mean 'fullgraph'?")
    assert _error({"torch_compile_options": {"dynamic": "yes"}}) == (
        "training_params.torch_compile_options.dynamic: got 'yes' (str); allowed: " + BOOL + " or None")
    assert _error({"torch_compile_options": {"backend": 3}}).startswith(
        "training_params.torch_compile_options.backend: got 3 (int); allowed: a backend name or a callable backend")
    assert _error({"torch_compile_options": {"options": ["x"]}}) == (
        "training_params.torch_compile_options.options: got ['x'] (list); allowed: a dict with string keys")


def test_early_stopping():
    assert resolve_training_params({"early_stopping": {"patience": 2}}).early_stopping == {"patience": 2,
                                                                                          "min_delta": 0.0}
    p = resolve_training_params({"early_stopping": {"patience": 2, "min_delta": 1}})
    assert p.early_stopping == {"patience": 2, "min_delta": 1.0} and type(p.early_stopping["min_delta"]) is float
    assert resolve_training_params({"early_stopping": None}).early_stopping is None
    assert _error({"early_stopping": {"min_delta": 0.1}}) == (
        "training_params.early_stopping: missing required key 'patience' (an int >= 1)")
    assert _error({"early_stopping": {"patience": True}}) == (
        "training_params.early_stopping.patience: got True (bool); allowed: an int >= 1")
    assert _error({"early_stopping": {"patience": 2, "min_delta": -0.1}}) == (
        "training_params.early_stopping.min_delta: got -0.1 (float); allowed: a float >= 0")
    assert _error({"early_stopping": {"patience": 2, "min_detla": 0.1}}) == (
        "training_params.early_stopping: unknown key 'min_detla'; did you mean 'min_delta'?")
    assert _error({"early_stopping": 5}).startswith("training_params.early_stopping: got 5 (int); allowed: a dict {")


def test_loss_and_loss_params():
    def my_loss(outputs, targets):
        return (outputs - targets).abs().mean()

    module = nn.SmoothL1Loss(beta=0.5)
    assert resolve_training_params({"loss": my_loss}).loss is my_loss
    assert resolve_training_params({"loss": module}).loss is module
    p = resolve_training_params({"loss": "smooth_l1", "loss_params": {"beta": 0.5, "reduction": "sum"}})
    built = P.LOSSES[p.loss](**p.loss_params)
    assert isinstance(built, nn.SmoothL1Loss) and built.beta == 0.5 and built.reduction == "sum"
    assert _error({"loss_params": {"label_smothing": 0.1}}) == (
        "training_params.loss_params: unknown key 'label_smothing'; did you mean 'label_smoothing'?")
    assert _error({"loss": "mse", "loss_params": {"label_smoothing": 0.1}}) == (
        "training_params.loss_params: unknown key 'label_smoothing'; valid keys: reduction")
    assert _error({"loss_params": {"size_average": False}}) == (
        "training_params.loss_params: key 'size_average' is not allowed; deprecated by torch; use reduction")
    assert _error({"loss": my_loss, "loss_params": {"reduction": "sum"}}) == (
        "training_params.loss_params: got {'reduction': 'sum'} (dict); allowed: only {} when loss is a callable "
        "(configure the callable itself)")


# ---- cross-key checks ----------------------------------------------------------------------------


def test_warmup_epochs_and_steps_exclusive():
    assert resolve_training_params({"lr_warmup_epochs": 2}).lr_warmup_epochs == 2
    assert resolve_training_params({"lr_warmup_steps": 50, "lr_warmup_epochs": 0}).lr_warmup_steps == 50
    assert _error({"lr_warmup_epochs": 2, "lr_warmup_steps": 50}) == (
        "training_params.lr_warmup_epochs / lr_warmup_steps: got 2 and 50; allowed: at most one of them > 0")


def test_metric_to_watch_must_be_validated():
    assert resolve_training_params({"metric_to_watch": "loss", "valid_metrics": []}).metric_to_watch == "loss"
    assert resolve_training_params({"metric_to_watch": "top5", "valid_metrics": ["top5"]}).metric_to_watch == "top5"
    assert _error({"metric_to_watch": "top5"}) == (
        "training_params.metric_to_watch: got 'top5' (str); allowed: 'loss' or one of valid_metrics (['accuracy']); "
        "add it to valid_metrics or watch 'loss'")
    assert "metric_to_watch: got 'accuracy'" in _error({"valid_metrics": ["loss"]})


@pytest.mark.parametrize("updates,ok", [([3, 9], True), ([1], True), ([], False), ([5, 3], False), ([3, 3], False),
                                        ([3, 10], False), ([12], False)])
def test_lr_updates_for_step_mode(updates, ok):
    user = {"lr_mode": "step", "lr_updates": updates, "max_epochs": 10}
    if ok:
        assert resolve_training_params(user).lr_updates == updates
    else:
        assert _error(user) == (
            f"training_params.lr_updates: got {updates!r} (list); allowed: for lr_mode 'step', a non-empty list of "
            f"epochs in increasing order without duplicates, each >= 1 and < max_epochs (10)")


def test_lr_updates_ignored_by_other_modes():
    assert resolve_training_params({"lr_mode": "cosine", "lr_updates": [5, 3]}).lr_updates == [5, 3]


def test_cross_checks_run_after_value_checks():
    # An invalid max_epochs is reported as such, not as a confusing lr_updates problem.
    err = _errors({"lr_mode": "step", "lr_updates": [3], "max_epochs": 0})
    assert err.errors == [_msg("max_epochs", 0, "an int >= 1")]


# ---- OmegaConf input ---------------------------------------------------------------------------------


def test_omegaconf_input():
    cfg = OmegaConf.create("""
max_epochs: 12
initial_lr: 3e-3
optimizer: sgd
optimizer_params: {momentum: 0.9, nesterov: true}
lr_mode: step
lr_updates: [4, 8]
mixed_precision: BF16
early_stopping: {patience: 3}
train_metrics: [accuracy, loss]
warmup_initial_lr: null
""")
    p = resolve_training_params(cfg)
    assert p.max_epochs == 12 and p.initial_lr == 3e-3 and p.optimizer == "SGD"
    assert p.optimizer_params == {"momentum": 0.9, "nesterov": True} and type(p.optimizer_params) is dict
    assert p.lr_updates == [4, 8] and type(p.lr_updates) is list
    assert p.mixed_precision == "bf16" and p.early_stopping == {"patience": 3, "min_delta": 0.0}
    assert p.train_metrics == ["accuracy", "loss"] and p.warmup_initial_lr is None
    json.dumps(p.to_dict())  # no OmegaConf containers left


def test_omegaconf_nested_and_interpolated():
    root = OmegaConf.create({"epochs": 6, "tp": {"max_epochs": "${epochs}", "lr_updates": [2, 4], "lr_mode": "step",
                                                 "ema_params": {"decay": 0.9}}})
    p = resolve_training_params(root.tp)
    assert p.max_epochs == 6 and p.ema_params == {"decay": 0.9}
    # OmegaConf containers inside a plain dict (e.g. merged by hand).
    p = resolve_training_params({"lr_updates": OmegaConf.create([3]), "lr_mode": "step",
                                 "optimizer_params": OmegaConf.create({"betas": [0.9, 0.9]})})
    assert p.lr_updates == [3] and p.optimizer_params == {"betas": [0.9, 0.9]}
    assert type(p.optimizer_params["betas"]) is list
    assert _error(OmegaConf.create({"max_epoch": 3})) == (
        "training_params: unknown key 'max_epoch'; did you mean 'max_epochs'?")


# ---- the TrainingParams object --------------------------------------------------------------------


def test_immutable():
    p = resolve_training_params({"lr_updates": [2], "optimizer_params": {"betas": [0.9, 0.99]}})
    with pytest.raises(AttributeError, match="immutable"):
        p.max_epochs = 3
    with pytest.raises(AttributeError, match="immutable"):
        p.new_key = 3
    with pytest.raises(AttributeError, match="immutable"):
        del p.max_epochs
    with pytest.raises(TypeError):
        p["max_epochs"] = 3
    # Containers handed out are copies: changing them leaves the parameters alone.
    p.lr_updates.append(5)
    p.optimizer_params["betas"][0] = 0.0
    p.to_dict()["lr_updates"].append(7)
    assert p.lr_updates == [2] and p.optimizer_params == {"betas": [0.9, 0.99]}
    # And the user's input is copied too.
    user = {"lr_updates": [2]}
    q = resolve_training_params(user)
    user["lr_updates"].append(3)
    assert q.lr_updates == [2]
    with pytest.raises(AttributeError, match="did you mean 'max_epochs'"):
        p.max_epoch


def test_mapping_access_repr_replace_pickle():
    p = resolve_training_params({"max_epochs": 3, "ema": True})
    assert p["max_epochs"] == 3 and len(p) == len(TRAINING_PARAMS) and "ema" in p
    assert dict(p) == p.to_dict() and p == resolve_training_params({"ema": True, "max_epochs": 3})
    assert resolve_training_params(p) is p
    r = repr(p)
    assert r.startswith("TrainingParams(max_epochs=3, max_steps=None, optimizer='AdamW', optimizer_params={}, "
                        "initial_lr=0.001")
    assert all(f"{k}=" in r for k in TRAINING_PARAMS)
    q = p.replace(max_epochs=5, optimizer="lion")
    assert q.max_epochs == 5 and q.optimizer == "Lion" and q.ema is True and p.max_epochs == 3
    assert _error_replace(p, max_epochs=0) == _msg("max_epochs", 0, "an int >= 1")
    assert pickle.loads(pickle.dumps(p)) == p
    assert copy.deepcopy(p) == p


def _error_replace(p, **changes):
    with pytest.raises(TrainingParamsError) as info:
        p.replace(**changes)
    return str(info.value)


def test_to_dict_json_safe():
    def my_loss(outputs, targets):
        return outputs.sum()

    p = resolve_training_params({"optimizer": torch.optim.RMSprop, "loss": my_loss, "torch_compile": True,
                                 "torch_compile_options": {"backend": my_loss},
                                 "optimizer_params": {"alpha": 0.9, "centered": True}})
    plain = p.to_dict()
    assert plain["optimizer"] is torch.optim.RMSprop and plain["loss"] is my_loss
    safe = p.to_dict(json_safe=True)
    assert json.loads(json.dumps(safe)) == safe
    assert safe["optimizer"] == "torch.optim.rmsprop.RMSprop"
    assert safe["loss"] == f"{__name__}.test_to_dict_json_safe.<locals>.my_loss"
    assert safe["torch_compile_options"] == {"backend": safe["loss"]}
    safe = resolve_training_params({"loss": nn.MSELoss()}).to_dict(json_safe=True)
    assert safe["loss"] == "torch.nn.modules.loss.MSELoss"
    assert resolve_training_params(None).to_dict(json_safe=True) == EXPECTED_DEFAULTS


# ---- the reference page --------------------------------------------------------------------------


def test_markdown_lists_every_key():
    md = P.render_markdown()
    for name, spec in TRAINING_PARAMS.items():
        assert f"| [`{name}`](#{name}) |" in md
        assert f"\n## {name}\n\n{spec.doc}\n" in md
    assert "Keys for `SGD`: `momentum`, `dampening`" in md
    assert "`decay`, `decay_type`" in md and "`init_scale`" in md


def test_docs_page_is_up_to_date():
    path = REPO / "docs" / "training_params.md"
    assert path.read_text() == P.render_markdown(), (
        "docs/training_params.md is stale: regenerate it with "
        "`python -m fusetrain.training.params --markdown > docs/training_params.md`")


def test_markdown_command():
    out = subprocess.run([sys.executable, "-m", "fusetrain.training.params", "--markdown"], capture_output=True,
                         text=True, check=True, cwd=str(REPO), timeout=120)
    assert out.stdout == P.render_markdown()
    assert out.stderr == ""


def test_unresolvable_interpolation():
    msg = _error(OmegaConf.create({"max_epochs": "${nope}"}))
    assert msg.startswith("training_params: cannot read the config: Interpolation key 'nope' not found")


def test_importing_the_params_leaves_the_warning_filters_alone():
    code = ("import warnings, torch; before = list(warnings.filters); import fusetrain.training.params; "
            "assert list(warnings.filters) == before, [f for f in warnings.filters if f not in before]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
