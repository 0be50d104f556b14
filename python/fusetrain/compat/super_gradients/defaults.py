"""SuperGradients' default training hyperparameters and optimizer arguments,
as its documentation states them: what a recipe that lists
``default_train_params`` in its defaults starts from."""

from __future__ import annotations

import copy
from types import MappingProxyType
from typing import Any, Dict, Mapping

__all__ = ["SG_DEFAULTS", "SG_OPTIMIZER_DEFAULTS", "sg_defaults"]

_DEFAULTS: Dict[str, Any] = {
    # run and resume
    "resume": False, "resume_path": None, "run_id": None, "ckpt_name": "ckpt_latest.pth",
    "resume_from_remote_sg_logger": False, "ckpt_best_name": "ckpt_best.pth",
    # learning rate
    "lr_mode": None, "lr_schedule_function": None, "lr_warmup_epochs": 0, "lr_warmup_steps": 0,
    "lr_cooldown_epochs": 0, "warmup_initial_lr": None, "step_lr_update_freq": None, "cosine_final_lr_ratio": 0.01,
    "warmup_mode": "LinearEpochLRWarmup", "lr_updates": [], "lr_decay_factor": 0.1,
    # optimizer
    "optimizer": "SGD", "optimizer_params": {}, "load_opt_params": True, "zero_weight_decay_on_bias_and_bn": False,
    # loss, EMA, metrics
    "loss": None, "criterion_params": {}, "ema": False,
    "ema_params": {"decay": 0.9999, "decay_type": "exp", "beta": 15},
    "train_metrics_list": [], "valid_metrics_list": [], "metric_to_watch": "Accuracy",
    "greater_metric_to_watch_is_better": True,
    # logging
    "launch_tensorboard": False, "tensorboard_port": None, "tb_files_user_prompt": False,
    "save_tensorboard_to_s3": False, "log_installed_packages": True, "save_full_train_log": False,
    "dataset_statistics": False, "silent_mode": False, "sg_logger": "base_sg_logger",
    "sg_logger_params": {"tb_files_user_prompt": False, "launch_tensorboard": False, "tensorboard_port": None,
                         "save_checkpoints_remote": False, "save_tensorboard_remote": False,
                         "save_logs_remote": False, "monitor_system": True},
    # the loop
    "precise_bn": False, "precise_bn_batch_size": None, "sync_bn": False, "mixed_precision": False,
    "save_ckpt_epoch_list": [], "average_best_models": True, "batch_accumulate": 1, "run_validation_freq": 1,
    "run_test_freq": 1, "save_model": True, "seed": 42, "phase_callbacks": [], "clip_grad_norm": None,
    "pre_prediction_callback": None, "max_train_batches": None, "max_valid_batches": None,
    "torch_compile": False, "torch_compile_loss": False,
    "torch_compile_options": {"mode": "reduce-overhead", "fullgraph": False, "dynamic": False, "backend": "inductor",
                              "options": None, "disable": False},
    "finetune": False, "kill_ddp_pgroup_on_end": True,
}

#: SuperGradients' default training hyperparameters (``max_epochs`` has none: a recipe sets it).
SG_DEFAULTS: Mapping[str, Any] = MappingProxyType(_DEFAULTS)

#: The arguments SuperGradients merges under a recipe's ``optimizer_params`` for these optimizers.
SG_OPTIMIZER_DEFAULTS: Mapping[str, Mapping[str, float]] = MappingProxyType({
    "SGD": MappingProxyType({"weight_decay": 1e-4, "momentum": 0.9}),
    "Adam": MappingProxyType({"weight_decay": 1e-4}),
    "RMSprop": MappingProxyType({"weight_decay": 1e-4, "momentum": 0.9}),
    "RMSpropTF": MappingProxyType({"weight_decay": 1e-4, "momentum": 0.9}),
})


def sg_defaults() -> Dict[str, Any]:
    """A fresh, mutable copy of :data:`SG_DEFAULTS`."""
    return copy.deepcopy(_DEFAULTS)
