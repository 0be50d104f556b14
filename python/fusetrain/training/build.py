"""A run's parts, built from its training params: the device placement of
the model (bfloat16 weights, channels-last, SyncBatchNorm, DDP or FSDP2
shards), the EMA, the optimizer with its learning-rate tensors, the loss,
the metrics, the schedules, the logs, the step, and the checkpoint owner
with the components it saves; a resume is restored into them here, before
the step is built (a captured step reads the state at fixed addresses)."""

from __future__ import annotations

import random
from typing import Any, Dict, Optional

import numpy as np
import torch
from torch import nn

from .._warnings import warn
from ..amp import resolve_precision
from ..ema import ModelEMA
from ..optim._base import FusedOptimizer
from ..optim._kinds import KINDS
from . import finetune, preflight
from .checkpoint.components import EMAState, ModelState, OptimizerState, RNGState, ScalerState
from .checkpoint.elastic import data_order_record
from .checkpoint.manager import CheckpointManager, CheckpointSettings
from .checkpoint.position import EpochPosition
from .checkpoint.resume import ResumePlan
from .checkpoint.sharded import ShardedState
from .distributed import fsdp
from .distributed.preemption import GracefulStop
from .distributed.sharding import shard_train_loader, shard_valid_loader
from .logging import step_log
from .logging.experiment_log import ExperimentLogger, NullLogger
from .loop import Run
from .params import TrainingParams, TrainingParamsError, optimizer_class
from .params.resolve import watch_candidates
from .schedules.lr import LRSchedule, base_lr, run_steps
from .schedules.settings import SettingSchedule
from .schedules.triggers import StepTriggers
from .step import TrainStep
from .task.callbacks import CallbackList, TrainerState, build_callbacks
from .task.evaluation import resolve_fn
from .task.losses import build_loss
from .task.metrics import MetricSet

__all__ = ["build_run", "build_optimizer", "build_loss_fn", "named_loaders", "watch_key"]


def named_loaders(loaders: Any, what: str) -> Dict[str, Any]:
    """A loader, or a dict of name -> loader, as ``{name: loader}`` (the name
    ``""`` for a single loader, whose values are logged without a name)."""
    if loaders is None:
        return {}
    if isinstance(loaders, dict):
        bad = [k for k in loaders if not isinstance(k, str) or not k.isidentifier()]
        if bad or not loaders:
            raise ValueError(f"Trainer.train: {what} must be a loader or a non-empty dict of name -> loader with "
                             f"names made of letters, digits and underscores; got names {list(loaders)!r}")
        return dict(loaders)
    return {"": loaders}


def watch_key(p: TrainingParams, valid_loaders: Dict[str, Any]) -> str:
    """The row key of ``metric_to_watch`` (checked before anything is written)."""
    watch, names = p.metric_to_watch, list(valid_loaders)
    if names in ([], [""]):
        return f"valid_{watch}"
    if any(watch.startswith(f"{n}_") for n in names):
        return f"valid_{watch}"
    reported = watch_candidates(p.valid_metrics)
    if watch.startswith("loss") or reported is None or watch in reported:
        return f"valid_{names[0]}_{watch}"
    raise TrainingParamsError([f"training_params.metric_to_watch: got {watch!r}; allowed with the validation "
                               f"loaders {names}: a name valid_metrics reports ({reported!r}) or 'loss' (of the "
                               f"first loader, {names[0]!r}), or <loader>_<name>"])


def build_optimizer(model: nn.Module, p: TrainingParams, device: torch.device):
    """The optimizer of ``p`` over the model's parameter groups; returns ``(optimizer, fused)``."""
    cls = optimizer_class(p.optimizer)
    fused = issubclass(cls, FusedOptimizer)
    groups = finetune.param_groups(model, p.zero_weight_decay_on_bias_and_bn, p.lr_multipliers, p.layer_decay,
                                   p.initial_lr)
    _assign_lrs(groups, base_lr(p.initial_lr), fused, device)
    kwargs = dict(p.optimizer_params)
    if fused:
        kwargs["max_grad_norm"] = p.clip_grad_norm
    opt = cls(groups, lr=groups[0]["lr"], **kwargs)
    # NOTE [stalled updates]: bfloat16 weights without a master lose the updates below half an ulp; the
    # epoch row reports how many.
    if fused and p.weights_dtype == "bfloat16" and KINDS[opt._kind]["lean"] and \
            any(g["master_weights"] in (False, "stochastic") for g in opt.param_groups):
        opt.track_stalled_updates()
    return opt, fused


def _assign_lrs(groups, base_lr: float, fused: bool, device: torch.device) -> None:
    """Each group's lr: ``base_lr * lr_scale``. NOTE [lr tensor]: for fused
    optimizers a device tensor, one per distinct scale, that the schedule
    fills each step: no host sync, and no recompilation under torch.compile."""
    tensors: Dict[float, torch.Tensor] = {}
    for g in groups:
        scale = g.get("lr_scale", 1.0)
        if fused:
            if scale not in tensors:
                tensors[scale] = torch.tensor(base_lr * scale, dtype=torch.float32, device=device)
            g["lr"] = tensors[scale]
        else:
            g["lr"] = base_lr * scale


def build_loss_fn(p: TrainingParams, device: torch.device):
    loss_fn = build_loss(p.loss, p.loss_params)
    return loss_fn.to(device) if isinstance(loss_fn, nn.Module) else loss_fn


def _place_model(model: nn.Module, p: TrainingParams, ctx: Any, device: torch.device) -> nn.Module:
    model = model.to(device)
    if p.weights_dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    if p.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if p.sync_bn:
        if ctx.enabled:
            model = ctx.convert_sync_batchnorm(model)
        else:
            warn("training_params.sync_bn: not a distributed run, BatchNorm stays local")
    return model


def _build_ema(model: nn.Module, p: TrainingParams, ctx: Any, steps_per_epoch: int) -> Optional[ModelEMA]:
    if not p.ema:
        return None
    ema_kwargs = dict(p.ema_params)
    if p.weights_dtype == "bfloat16" and ema_kwargs.get("remainder") is False and ctx.is_main:
        warn("Trainer: ema_params.remainder false with weights_dtype bfloat16 keeps the EMA in bfloat16 "
             "alone, where an update smaller than half an ulp rounds away (NOTE [ema remainder]); leave "
             "remainder unset for the exact EMA")
    ema_kwargs.setdefault("total_steps", run_steps(p, steps_per_epoch))
    return ModelEMA(model, **ema_kwargs)


def _stateful_callbacks(callbacks: CallbackList) -> Dict[str, Any]:
    """The callbacks that keep a state (``state_dict`` and ``load_state_dict``), by checkpoint name
    ``callbacks.<class name>`` (``_2``, ``_3``, ... for repeats)."""
    out: Dict[str, Any] = {}
    for cb in callbacks.callbacks:
        if callable(getattr(cb, "state_dict", None)) and callable(getattr(cb, "load_state_dict", None)):
            name, k = f"callbacks.{type(cb).__name__}", 2
            while name in out:
                name, k = f"callbacks.{type(cb).__name__}_{k}", k + 1
            out[name] = cb
    return out


def build_run(model: nn.Module, p: TrainingParams, train_loader, valid_loader, test_loader, plan: ResumePlan,
              run_dir: str, experiment_name: str, ctx: Any, device: torch.device) -> Run:
    """The run of ``p`` on this process, with ``plan``'s checkpoint restored."""
    if p.compile_step == "cuda_graph" and (device.type != "cuda" or ctx.enabled):
        raise TrainingParamsError(["training_params.compile_step: got 'cuda_graph' "
                                   + (f"but the device is {device}; CUDA graphs need a GPU"
                                      if device.type != "cuda" else "in a distributed run")
                                   + "; allowed here: 'off' or 'compile'"])
    valid_loaders = named_loaders(valid_loader, "valid_loader")
    test_loaders = named_loaders(test_loader, "test_loader")
    key = watch_key(p, valid_loaders)
    callbacks = CallbackList(build_callbacks(p.callbacks))
    train_metrics = MetricSet(p.train_metrics, "train").to(device)
    valid_metrics = {name: MetricSet(p.valid_metrics, "valid").to(device) for name in valid_loaders}
    # Reproducibility and speed switches.
    torch.manual_seed(p.seed)
    random.seed(p.seed)
    np.random.seed(p.seed % 2**32)
    torch.backends.cudnn.benchmark = bool(p.cudnn_benchmark)
    torch.autograd.set_detect_anomaly(False)
    if torch.autograd._profiler_enabled():
        warn("Trainer: the autograd profiler is active and slows every step")

    data = plan.data
    train_loader = shard_train_loader(train_loader, ctx, data.seed, data.batch_size, p.batch_accumulate)
    valid_loaders = {k: shard_valid_loader(v, ctx) for k, v in valid_loaders.items()}
    test_loaders = {k: shard_valid_loader(v, ctx) for k, v in test_loaders.items()}
    if ctx.enabled:
        preflight.check_not_empty(train_loader, f"the train loader's shard of rank {ctx.rank}")
    steps_per_epoch = preflight.steps_per_epoch(train_loader, p)
    precision = resolve_precision(p.mixed_precision, device)
    scaler = precision.make_scaler(**p.scaler_params)
    if p.weights_dtype == "bfloat16" and precision.name != "bf16":
        raise TrainingParamsError([f"training_params.weights_dtype: got 'bfloat16' but mixed_precision "
                                   f"{p.mixed_precision!r} resolves to {precision.name} on {device}; allowed: "
                                   "mixed_precision bf16 (or weights_dtype float32)"])
    model = _place_model(model, p, ctx, device)
    # Every rank starts from rank 0's weights (DDP broadcasts them; fsdp: before they are cut into shards),
    # before the optimizer (master weights) and the EMA copy them.
    if ctx.fsdp:
        ctx.broadcast_module(model)
        ddp_model = model
    else:
        ddp_model = ctx.wrap(model, device, p.find_unused_parameters)
    ema = _build_ema(model, p, ctx, steps_per_epoch)
    if ctx.fsdp:  # the EMA copy is sharded like the model, so the fused step updates it shard by shard
        fsdp.shard([model] + ([ema.module] if ema is not None else []), device, ctx.world_size,
                   p.fsdp_params["wrap"], p.fsdp_params["reshard_after_forward"], precision.name)
        if ema is not None:
            ema.rebuild_index()
    opt, fused = build_optimizer(model, p, device)
    loss_fn = build_loss_fn(p, device)
    state = TrainerState(params=p, model=model, optimizer=opt, scaler=scaler, ema=ema, device=device,
                         experiment_dir=run_dir, is_main=ctx.is_main, world_size=ctx.world_size,
                         best={"metric": p.metric_to_watch, "value": None, "epoch": None})
    logger = ExperimentLogger(run_dir) if ctx.is_main else NullLogger()
    schedule = LRSchedule(p, steps_per_epoch)
    settings = SettingSchedule(p, schedule, opt)  # momentum / weight decay schedules

    # The checkpoint owner and what it saves (NOTE [checkpoint schema]), in the order a resume restores them.
    ckpts = CheckpointManager(run_dir, CheckpointSettings.of(p, data_order_record(train_loader, p, ctx.world_size)),
                              ctx)
    ckpts.register_sharded(ShardedState(model, opt, ema), write=ctx.fsdp)
    ckpts.register("model", ModelState(model))
    ckpts.register("optimizer", OptimizerState(opt))
    ckpts.register("scaler", ScalerState(scaler))
    if ema is not None:
        ckpts.register("ema", EMAState(ema, sharded=ctx.fsdp))
    ckpts.register("schedule", schedule)
    ckpts.register("progress", state)
    for name, cb in _stateful_callbacks(callbacks).items():
        ckpts.register(name, cb)
    ckpts.register("rng", RNGState(train_loader))
    position = EpochPosition(train_loader, p.resume_skip)
    skipped_seen = 0.0
    if plan.resumed:
        at = ckpts.restore(plan, getattr(train_loader, "batch_size", None))
        state.epoch, state.global_step = at["epoch"], at["global_step"]
        position.resume_at(at["position"])
        skipped_seen = at["position"]["skipped_seen"] if at["position"] else state.skipped_before
        logger.load_existing(state.epoch, state.global_step)
    if ema is not None and fused:
        ema.attach(opt)

    # Distributed: the DDP-wrapped module is compiled, so Dynamo's DDPOptimizer can split the graph at the
    # gradient buckets and overlap the all-reduces with the backward (docs/design.md).
    compile_kw = dict(mode=p.torch_compile_mode, **p.torch_compile_options)
    train_model = torch.compile(ddp_model, **compile_kw) if p.torch_compile else ddp_model
    eval_model = ema.module if ema is not None else train_model
    if ema is None and ddp_model is not model:  # validate without DDP: no collectives, shards may differ
        eval_model = torch.compile(model, **compile_kw) if p.torch_compile else model
    if p.torch_compile and ema is not None:
        eval_model = torch.compile(ema.module, **compile_kw)
    # The per-batch step (compile_step); built after a resume has loaded the state (a captured step reads it
    # at fixed addresses). It runs the DDP wrapper, or the torch.compile'd model when compile_step is off.
    train_step = TrainStep(ddp_model if p.compile_step != "off" else train_model, loss_fn, opt, scaler,
                           precision, mode=p.compile_step, accumulate=p.batch_accumulate,
                           accumulate_reduction=p.batch_accumulate_reduction, ema=ema,
                           compile_options=compile_kw, channels_last=p.channels_last,
                           clip_grad_norm=None if fused else p.clip_grad_norm,
                           model_input=resolve_fn(p.model_input))
    loggers = step_log.build_loggers(p.loggers, p.logger_params, run_dir, experiment_name) if ctx.is_main else []
    return Run(p=p, ctx=ctx, device=device, model=model, train_step=train_step, eval_model=eval_model, opt=opt,
               fused=fused, scaler=scaler, precision=precision, ema=ema, loss_fn=loss_fn, schedule=schedule,
               settings=settings if settings.active else None,
               steps_per_epoch=steps_per_epoch, train_loader=train_loader, valid_loaders=valid_loaders,
               test_loaders=test_loaders, train_metrics=train_metrics, valid_metrics=valid_metrics,
               callbacks=callbacks, state=state, checkpoints=ckpts, position=position, skipped_seen=skipped_seen,
               logger=logger, watch_key=key, run_dir=run_dir,
               triggers=StepTriggers(p, ctx, device, GracefulStop(p.preemption_signals)),
               step_log=step_log.StepLog(loggers, p.log_interval or steps_per_epoch, device),
               split_fn=resolve_fn(p.split_batch), model_input=resolve_fn(p.model_input),
               frozen_bn=finetune.frozen_bn_modules(model) if p.freeze_bn_stats else [])
