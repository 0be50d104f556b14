"""Names other training libraries use (SuperGradients, PyTorch Lightning,
timm) for fusetrain's keys and values. A refused key or value is looked up
here before the closest spelling is guessed, so ``criterion_params`` points at
``loss_params`` rather than at a key that merely looks alike."""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from ..task.metrics import METRIC_NAME_SYNONYMS  # beside metric_name, which reads it

__all__ = ["KEY_SYNONYMS", "LR_MODE_SYNONYMS", "WARMUP_MODE_SYNONYMS", "METRIC_NAME_SYNONYMS",
           "OPTIMIZER_SYNONYMS", "LOSS_SYNONYMS", "DEVICE_SYNONYMS", "PRECISION_SYNONYMS"]

#: Key names from other libraries -> the fusetrain key (or nested key) that does the job.
KEY_SYNONYMS: Mapping[str, str] = MappingProxyType({
    # common spellings
    "lr": "initial_lr", "learning_rate": "initial_lr", "base_lr": "initial_lr", "weight_decay":
    "optimizer_params.weight_decay", "momentum": "optimizer_params.momentum", "amp": "mixed_precision",
    "epochs": "max_epochs", "num_epochs": "max_epochs",
    # SuperGradients
    "criterion_params": "loss_params", "silent_mode": "progress_bar", "train_metrics_list": "train_metrics",
    "valid_metrics_list": "valid_metrics", "warmup_mode": "lr_warmup_mode", "phase_callbacks": "callbacks",
    "sg_logger": "loggers", "sg_logger_params": "logger_params", "lr_schedule_function": "lr_mode",
    "max_train_batches_per_epoch": "max_train_batches", "ckpt_name": "resume_path",
    # PyTorch Lightning
    "max_steps_per_epoch": "max_train_batches", "limit_train_batches": "max_train_batches",
    "limit_val_batches": "max_valid_batches", "accumulate_grad_batches": "batch_accumulate",
    "gradient_clip_val": "clip_grad_norm", "precision": "mixed_precision", "check_val_every_n_epoch":
    "run_validation_freq", "val_check_interval": "valid_every_n_steps", "enable_progress_bar": "progress_bar",
    "ckpt_path": "resume_path", "sync_batchnorm": "sync_bn", "strategy": "multi_gpu", "devices": "num_gpus",
    "benchmark": "cudnn_benchmark", "log_every_n_steps": "log_interval", "logger": "loggers",
    # timm
    "opt": "optimizer", "opt_kwargs": "optimizer_params", "sched": "lr_mode", "warmup_epochs": "lr_warmup_epochs",
    "warmup_lr": "warmup_initial_lr", "min_lr": "cosine_final_lr_ratio", "decay_rate": "lr_decay_factor",
    "decay_epochs": "lr_updates", "cooldown_epochs": "lr_cooldown_epochs", "clip_grad": "clip_grad_norm",
    "model_ema": "ema", "model_ema_decay": "ema_params.decay", "smoothing": "loss_params.label_smoothing",
    "layer_decay_rate": "layer_decay", "grad_accum_steps": "batch_accumulate", "resume_from": "resume_path",
    "channels_last_memory": "channels_last", "model_ema_warmup": "ema_params.warmup",
    # EMA settings as flat keys (timm's model_ema_decay above; SG and others nest them)
    "ema_decay": "ema_params.decay", "ema_decay_type": "ema_params.decay_type", "ema_beta": "ema_params.beta",
    "ema_warmup": "ema_params.warmup",
})

#: lr_mode values of other libraries (SuperGradients' scheduler names and class names, torch's, timm's).
LR_MODE_SYNONYMS: Mapping[str, str] = MappingProxyType({
    "CosineLRScheduler": "cosine", "StepLRScheduler": "step", "PolyLRScheduler": "poly",
    "ExponentialLRScheduler": "exponential", "exp": "exponential", "CosineAnnealingLR": "cosine",
    "MultiStepLR": "step", "StepLR": "step", "ExponentialLR": "exponential", "PolynomialLR": "poly",
    "OneCycleLR": "onecycle", "CyclicLR": "cyclic", "LinearLR": "linear", "ConstantLR": "constant",
    "ReduceLROnPlateau": "plateau", "CosineAnnealingWarmRestarts": "cosine_restarts", "multistep": "step",
    "FunctionLRScheduler": "a function step -> lr (from Python)",
})

#: lr_warmup_mode values of SuperGradients (names and class names).
WARMUP_MODE_SYNONYMS: Mapping[str, str] = MappingProxyType({
    "LinearEpochLRWarmup": "linear_epoch", "linear_epoch_step": "linear_epoch",
    "LinearBatchLRWarmup": "linspace", "linear_batch_step": "linspace", "linear_step": "linear_epoch",
})

#: mixed_precision values of other libraries (PyTorch Lightning's precision, timm's amp_dtype, dtype names).
PRECISION_SYNONYMS: Mapping[str, str] = MappingProxyType({
    "16-mixed": "fp16", "16": "fp16", "float16": "fp16", "half": "fp16", "amp": "fp16",
    "bf16-mixed": "bf16", "bfloat16": "bf16", "bf16-true": "bf16 (with weights_dtype: bfloat16)",
    "32": "fp32", "32-true": "fp32", "float32": "fp32", "float": "fp32", "64": "fp32 (fusetrain trains in float32)",
})

#: Optimizer names of other libraries.
OPTIMIZER_SYNONYMS: Mapping[str, str] = MappingProxyType({
    "RMSProp": "RMSprop", "rmsproptf": "RMSpropTF", "momentum": "SGD", "nesterov": "SGD", "adamw_torch": "AdamW",
})

#: Device names of other libraries.
DEVICE_SYNONYMS: Mapping[str, str] = MappingProxyType({"gpu": "cuda", "cuda:gpu": "cuda", "nvidia": "cuda"})

#: Loss names of other libraries.
LOSS_SYNONYMS: Mapping[str, str] = MappingProxyType({
    "LabelSmoothingCrossEntropyLoss": "CrossEntropyLoss", "CrossEntropy": "cross_entropy", "ce": "cross_entropy",
    "MSE": "mse", "BCE": "bce_with_logits",
})
