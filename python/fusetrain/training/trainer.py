"""The Trainer: ``Trainer(experiment_name).train(model, training_params, train_loader, valid_loader)``.

A flat loop over a :class:`~fusetrain.training.run.Run`: per epoch, train
(the fused, host-sync-free :class:`TrainStep` on batches of any structure),
validate on each validation loader under ``torch.inference_mode()`` with the
training precision (on the EMA weights when ``ema`` is on), log the epoch
(CSV, JSONL, TensorBoard, console) and write checkpoints atomically; after the
last epoch, evaluate the test loaders. The running loss, its components and
the metrics stay in device tensors, read once per epoch (or once per
``log_interval`` steps for the progress bar). Callbacks run at the phases of
:data:`fusetrain.training.callbacks.HOOKS`. ``resume=True`` continues the
same run bit-identically (model, EMA, optimizer with master weights, scaler,
schedule position, RNG states).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import resource
import sys
import time
import warnings
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch import nn

from ..amp import SCALE_FLOOR, Precision, resolve_precision
from ..ema import ModelEMA, unwrap_model
from ..export import check_onnx_packages, export_model
from ..optim._base import FusedOptimizer
from . import distributed as _dist
from . import finetune, fsdp, launcher, preflight, resume, sharded_checkpoints, step_log
from .batches import call_model, count_samples, split_batch, to_channels_last, to_device
from .callbacks import CallbackList, TrainerState, build_callbacks
from .checkpoints import atomic_copy, atomic_save, load_checkpoint
from .data.sharding import set_epoch, shard_train_loader, shard_valid_loader
from .experiment_dir import ExperimentDir
from .experiment_log import ExperimentLogger, NullLogger
from .losses import build_loss, split_loss
from .metrics import MetricSet
from .params import TrainingParams, TrainingParamsError, optimizer_class, resolve_training_params
from .params.resolve import watch_candidates
from .position import resume_iterator, rng_state, set_rng_state
from .registry import import_path
from .run import LossSums, Run
from .schedules import LRSchedule, run_epochs, run_steps
from .step import TrainStep
from .triggers import GracefulStop, StepTriggers, TrainingInterrupted

__all__ = ["Trainer"]


def _memory_mb(device: torch.device) -> Dict[str, float]:
    if device.type == "cuda":
        return {"reserved_memory_mb": torch.cuda.memory_reserved(device) / 2**20,
                "peak_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20}
    # CPU: the process's peak resident set size (ru_maxrss is in KiB on Linux).
    return {"peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


class _Progress:
    """tqdm bar whose rate (and so ETA) excludes the first, warm-up step."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                warnings.warn("progress_bar=True but tqdm is not installed, so no progress bar is shown; install it "
                              "with `pip install tqdm` or `pip install fusetrain[logging]`, or set progress_bar=False",
                              stacklevel=3)
                self.bar = None
        self.total = total

    def first_step_done(self) -> None:
        if self.bar is not None:
            self.bar.reset(total=self.total)  # restart the clock after warm-up/compilation
            self.bar.update(1)

    def update(self, **postfix) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if postfix:
                self.bar.set_postfix(**postfix)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _named_loaders(loaders: Any, what: str) -> Dict[str, Any]:
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


def _prefixed(phase: str, name: str, results: Dict[str, float]) -> Dict[str, float]:
    prefix = f"{phase}_{name}_" if name else f"{phase}_"
    return {prefix + k: v for k, v in results.items()}


def _resolve_fn(value: Any) -> Any:
    """A function given by its path in a recipe (``package.module.function``)."""
    if isinstance(value, str) and "." in value:
        return import_path(value, "training_params")
    return value


def _train_worker(experiment_name: str, ckpt_root_dir: str, model: nn.Module, training_params: Dict[str, Any],
                  train_loader, valid_loader, test_loader) -> Dict[str, Any]:
    """What each worker started for ``multi_gpu: ddp`` runs: the same train call."""
    return Trainer(experiment_name, ckpt_root_dir=ckpt_root_dir).train(model, training_params, train_loader,
                                                                         valid_loader, test_loader)


class Trainer:
    """Trains a model with fusetrain's fused step; see ``docs/training_params.md``
    and the guides in ``docs/guides/``.

    Args:
      experiment_name: folder name of the run under ``ckpt_root_dir``.
      ckpt_root_dir: where experiments are written (default ``./checkpoints``).
    """

    def __init__(self, experiment_name: str, ckpt_root_dir: Optional[str] = None) -> None:
        if not isinstance(experiment_name, str) or not experiment_name or os.sep in experiment_name:
            raise ValueError(f"Trainer: experiment_name must be a non-empty folder name, got {experiment_name!r}")
        self.experiment_name = experiment_name
        self.ckpt_root_dir = ckpt_root_dir or os.path.join(os.getcwd(), "checkpoints")
        self.experiment_dir = os.path.join(self.ckpt_root_dir, experiment_name)
        self.params: Optional[TrainingParams] = None

    # ---- building blocks -----------------------------------------------------------

    @staticmethod
    def _build_optimizer(model: nn.Module, p: TrainingParams, device: torch.device):
        cls = optimizer_class(p.optimizer)
        fused = issubclass(cls, FusedOptimizer)
        groups = finetune.param_groups(model, p.zero_weight_decay_on_bias_and_bn, p.lr_multipliers, p.layer_decay)
        Trainer._assign_lrs(groups, p.initial_lr, fused, device)
        kwargs = dict(p.optimizer_params)
        if fused:
            kwargs["max_grad_norm"] = p.clip_grad_norm
        return cls(groups, lr=groups[0]["lr"], **kwargs), fused

    @staticmethod
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

    @staticmethod
    def _loss_fn(p: TrainingParams, device: torch.device):
        loss_fn = build_loss(p.loss, p.loss_params)
        return loss_fn.to(device) if isinstance(loss_fn, nn.Module) else loss_fn

    @staticmethod
    def _set_lr(opt, value: float) -> None:
        seen = set()
        for g in opt.param_groups:
            lr, scaled = g["lr"], value * g.get("lr_scale", 1.0)
            if isinstance(lr, torch.Tensor):
                if id(lr) not in seen:
                    seen.add(id(lr))
                    lr.fill_(scaled)
            else:
                g["lr"] = scaled

    # ---- public API ------------------------------------------------------------------

    def train(self, model: nn.Module, training_params: Optional[Dict[str, Any]] = None, train_loader=None,
              valid_loader=None, test_loader=None) -> Dict[str, Any]:
        """Train ``model``. ``valid_loader`` and ``test_loader`` are a loader or a
        dict of name -> loader (logged as ``valid_<name>_<metric>``); the test
        loaders are evaluated once, after training, on the final weights (the
        EMA's with ``ema``). Returns ``{"final": last epoch's row, "best":
        {"metric", "value", "epoch"}, "test": {test_<metric>: value},
        "experiment_dir": path}``."""
        p = resolve_training_params(training_params)
        self.params = p
        if not isinstance(model, nn.Module):
            raise TypeError(f"Trainer.train: model must be an nn.Module, got {type(model).__name__}")
        if train_loader is None:
            raise ValueError("Trainer.train: train_loader is required")
        _named_loaders(valid_loader, "valid_loader")
        _named_loaders(test_loader, "test_loader")
        resume_path = None
        if p.resume or p.resume_path:
            resume_path = p.resume_path or os.path.join(self.experiment_dir, "ckpt_latest.pth")
            if not os.path.isfile(resume_path):
                raise FileNotFoundError(f"training_params.resume: no checkpoint at {resume_path}")
        if p.lr_mode == "plateau" and valid_loader is None:
            raise TrainingParamsError(["training_params.lr_mode: got 'plateau' without a valid_loader; allowed: "
                                       "another lr_mode, or pass valid_loader (plateau follows metric_to_watch "
                                       "after each validation)"])
        step_log.check_logger_packages(p.loggers)
        if any(name.endswith(".onnx") for name in p.export):
            check_onnx_packages()
        pretrained = self._prepare_model(model, p, resume_path)
        preflight.check_trainable(model)
        preflight.check_not_empty(train_loader, "train_loader")
        for what, loaders in (("valid_loader", valid_loader), ("test_loader", test_loader)):
            for name, loader in _named_loaders(loaders, what).items():
                preflight.check_not_empty(loader, f"{what}[{name!r}]" if name else what)
        n_workers = _dist.workers_to_launch(p)
        if n_workers > 1:  # multi_gpu 'ddp' outside a launcher: start the workers, each runs this method
            return self._launch(model, p, train_loader, valid_loader, test_loader, n_workers)
        ctx, device = _dist.setup(p)
        folder = ExperimentDir(self.experiment_dir)
        failed = True
        try:
            if ctx.is_main:  # rank 0 writes the folder (NOTE [folder lock])
                folder.open(resume=resume_path is not None, overwrite=p.overwrite_experiment)
            run = self._setup(model, p, train_loader, valid_loader, test_loader, resume_path, ctx, device)
            result = self._loop(run)
            if pretrained is not None:
                result["pretrained"] = pretrained
            if p.export and ctx.is_main:
                result["export"] = self._export(run)
            failed = False
            return result
        except BaseException as exc:
            other_rank_failed = ctx.on_failure(exc, "during training")
            if other_rank_failed is not None:
                raise other_rank_failed from exc
            raise
        finally:
            folder.close()
            ctx.teardown(failed)

    @staticmethod
    def _prepare_model(model: nn.Module, p: TrainingParams, resume_path: Optional[str]):
        """Pretrained weights (not when resuming: the checkpoint has the weights)
        and frozen parameters, before anything is written; returns the load report."""
        report = None
        if p.pretrained_weights and resume_path is None:
            report = finetune.load_pretrained(model, p.pretrained_weights, **p.pretrained_params)
            finetune.warn_report(report, p.pretrained_weights)
        if p.freeze:
            finetune.freeze(model, p.freeze)
        return report

    def test(self, model: nn.Module, test_loader, metrics: Optional[List[Any]] = None,
             training_params: Optional[Dict[str, Any]] = None) -> Dict[str, float]:
        """Evaluate ``model`` on ``test_loader`` (precision, loss, device, batch
        rules from ``training_params``, default those of the last ``train``);
        returns ``{"loss": ..., <metric>: ...}``. Writes nothing."""
        p = resolve_training_params(training_params) if training_params is not None else (
            self.params or resolve_training_params({}))
        device = _dist._single_device(p.device)
        model = model.to(device)
        precision = resolve_precision(p.mixed_precision, device)
        ms = MetricSet(metrics if metrics is not None else list(p.valid_metrics), "test").to(device)
        return self._evaluate(p, model, test_loader, self._loss_fn(p, device), precision, ms, device, None,
                              what="Trainer.test: test_loader")

    # ---- setup ---------------------------------------------------------------------------

    def _launch(self, model, p, train_loader, valid_loader, test_loader, nprocs: int) -> Dict[str, Any]:
        """Start ``nprocs`` workers that each run this ``train`` call; then load the
        final weights (the last checkpoint) into ``model`` so the caller holds the
        trained model, as after a single-process run. Returns rank 0's result."""
        args = (self.experiment_name, self.ckpt_root_dir, model, p, train_loader, valid_loader, test_loader)
        result = launcher.launch(_train_worker, args, nprocs,
                                 payload_names=("experiment_name", "ckpt_root_dir", "the model", "training_params",
                                                "the train loader", "the validation loader", "the test loader"))
        path = os.path.join(self.experiment_dir, "ckpt_latest.pth")
        if os.path.isfile(path):
            unwrap_model(model).load_state_dict(sharded_checkpoints.full_state_dict(path))
        return result

    def _watch_key(self, p: TrainingParams, valid_loaders: Dict[str, Any]) -> str:
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

    def _setup(self, model: nn.Module, p: TrainingParams, train_loader, valid_loader, test_loader,
               resume_path: Optional[str], ctx: "_dist.DistContext", device: torch.device) -> Run:
        if p.compile_step == "cuda_graph" and (device.type != "cuda" or ctx.enabled):
            raise TrainingParamsError(["training_params.compile_step: got 'cuda_graph' "
                                       + (f"but the device is {device}; CUDA graphs need a GPU"
                                          if device.type != "cuda" else "in a distributed run")
                                       + "; allowed here: 'off' or 'compile'"])
        valid_loaders = _named_loaders(valid_loader, "valid_loader")
        test_loaders = _named_loaders(test_loader, "test_loader")
        watch_key = self._watch_key(p, valid_loaders)
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
            warnings.warn("Trainer: the autograd profiler is active and slows every step", stacklevel=3)

        train_loader = shard_train_loader(train_loader, ctx, p.seed)
        valid_loaders = {k: shard_valid_loader(v, ctx) for k, v in valid_loaders.items()}
        test_loaders = {k: shard_valid_loader(v, ctx) for k, v in test_loaders.items()}
        if ctx.enabled:
            preflight.check_not_empty(train_loader, f"the train loader's shard of rank {ctx.rank}")
        steps_per_epoch = preflight.steps_per_epoch(train_loader, p)
        precision = resolve_precision(p.mixed_precision, device)
        scaler = precision.make_scaler(**p.scaler_params)
        model = model.to(device)
        if p.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if p.sync_bn:
            if ctx.enabled:
                model = ctx.convert_sync_batchnorm(model)
            else:
                warnings.warn("training_params.sync_bn: not a distributed run, BatchNorm stays local", stacklevel=3)
        # Every rank starts from rank 0's weights (DDP broadcasts them; fsdp: before they are cut into shards),
        # before the optimizer (master weights) and the EMA copy them.
        if ctx.fsdp:
            ctx.broadcast_module(model)
            ddp_model = model
        else:
            ddp_model = ctx.wrap(model, device, p.find_unused_parameters)
        ema = None
        if p.ema:
            ema_kwargs = dict(p.ema_params)
            ema_kwargs.setdefault("total_steps", run_steps(p, steps_per_epoch))
            ema = ModelEMA(model, **ema_kwargs)
        if ctx.fsdp:  # the EMA copy is sharded like the model, so the fused step updates it shard by shard
            fsdp.shard([model] + ([ema.module] if ema is not None else []), device, ctx.world_size,
                       p.fsdp_params["wrap"], p.fsdp_params["reshard_after_forward"], precision.name)
            if ema is not None:
                ema.rebuild_index()
        opt, fused = self._build_optimizer(model, p, device)
        loss_fn = self._loss_fn(p, device)
        best = {"metric": p.metric_to_watch, "value": None, "epoch": None}
        logger = ExperimentLogger(self.experiment_dir) if ctx.is_main else NullLogger()
        start_epoch = global_step = stale_epochs = 0
        skipped_before = 0.0
        position = None
        schedule = LRSchedule(p, steps_per_epoch)
        if resume_path is not None:
            ck = load_checkpoint(resume_path)
            schedule.load_state_dict(ck.get("schedule"))
            resume.check_changes(ck.get("training_params"), p, resume_path)
            # The fresh param groups' settings (lr_scale, the lr tensors of NOTE [lr tensor]) are re-applied.
            resume.restore(ck, resume_path, model, opt, scaler, ema)
            start_epoch, global_step = int(ck["epoch"]), int(ck["global_step"])
            best = ck.get("best", best)
            stale_epochs = int(ck.get("stale_epochs", 0))
            skipped_before = float(ck.get("skipped_steps", 0.0))
            set_rng_state(ck["rng"], train_loader)
            position = self._rank_position(ck.get("position"), ctx, resume_path)
            logger.load_existing(start_epoch, global_step)
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
                               precision, mode=p.compile_step, accumulate=p.batch_accumulate, ema=ema,
                               compile_options=compile_kw, channels_last=p.channels_last,
                               clip_grad_norm=None if fused else p.clip_grad_norm,
                               model_input=_resolve_fn(p.model_input))
        state = TrainerState(params=p, model=model, optimizer=opt, scaler=scaler, ema=ema, device=device,
                             experiment_dir=self.experiment_dir, is_main=ctx.is_main, world_size=ctx.world_size,
                             epoch=start_epoch, global_step=global_step, best=best)
        return Run(p=p, ctx=ctx, device=device, model=model, train_step=train_step, eval_model=eval_model, opt=opt,
                   fused=fused, scaler=scaler, precision=precision, ema=ema, loss_fn=loss_fn,
                   schedule=schedule, steps_per_epoch=steps_per_epoch,
                   train_loader=train_loader, valid_loaders=valid_loaders, test_loaders=test_loaders,
                   train_metrics=train_metrics, valid_metrics=valid_metrics, callbacks=callbacks, state=state,
                   logger=logger, watch_key=watch_key, split_fn=_resolve_fn(p.split_batch),
                   model_input=_resolve_fn(p.model_input), sums=LossSums(device), start_epoch=start_epoch,
                   global_step=global_step, best=best, stale_epochs=stale_epochs, skipped_before=skipped_before,
                   skipped_seen=position["skipped_seen"] if position else skipped_before, resume_position=position,
                   triggers=StepTriggers(p, ctx, device, GracefulStop()),
                   frozen_bn=finetune.frozen_bn_modules(model) if p.freeze_bn_stats else [],
                   step_log=step_log.StepLog(step_log.build_loggers(p.loggers, p.logger_params, self.experiment_dir,
                                                                    self.experiment_name) if ctx.is_main else [],
                                             p.log_interval or steps_per_epoch, device))

    @staticmethod
    def _rank_position(position: Optional[Dict[str, Any]], ctx, path: str) -> Optional[Dict[str, Any]]:
        """This rank's part of a mid-epoch checkpoint's position (NOTE [mid-epoch resume]), or None."""
        if position is None:
            return None
        ranks = position["ranks"]
        if len(ranks) != ctx.world_size:
            raise ValueError(f"resume: {path} was written in the middle of epoch {position['epoch'] + 1} by "
                             f"{len(ranks)} process(es); allowed: resume it with {len(ranks)} process(es) (the "
                             f"position in the epoch belongs to each process's shard of the data), or resume from "
                             f"a checkpoint written at an epoch end")
        return {**ranks[ctx.rank], **{k: v for k, v in position.items() if k != "ranks"}}

    # ---- the loop ------------------------------------------------------------------------

    def _loop(self, run: Run) -> Dict[str, Any]:
        state, cbs = run.state, run.callbacks
        # A resumed run that has nothing left to do reports the checkpoint's last epoch.
        last: Dict[str, Any] = dict(run.logger.rows[-1]) if run.logger.rows else {}
        test: Dict[str, float] = {}
        completed = False
        cbs("on_train_start", state)
        try:
            with run.triggers.stop:  # NOTE [graceful stop]
                last = self._epochs(run, last)
            completed = True
        finally:
            if run.ema is not None:
                run.ema.detach()
            if run.logger.rows:
                try:
                    run.logger.plot()
                except Exception as e:  # the plot is a convenience, never a failure
                    warnings.warn(f"could not write the metrics plot: {e}", stacklevel=2)
            run.logger.close()
            run.step_log.close()
            cbs("on_train_end", state)
        if completed and run.test_loaders:
            test = self._run_tests(run)
        return {"final": last, "best": run.best, "test": test, "experiment_dir": self.experiment_dir}

    def _epochs(self, run: Run, last: Dict[str, Any]) -> Dict[str, Any]:
        """The epochs from ``run.start_epoch``; returns the last epoch's row."""
        p, ctx, state, cbs = run.p, run.ctx, run.state, run.callbacks
        n_epochs = run_epochs(p, run.steps_per_epoch)
        # With max_steps the epochs go on until the step count is reached (a loader without a length may
        # give fewer steps per epoch than counted).
        epochs = itertools.count(run.start_epoch) if p.max_steps else range(run.start_epoch, n_epochs)
        for epoch in epochs:
            if self._steps_done(run):
                break
            state.epoch = epoch
            if ctx.enabled:  # per rank and epoch, so a resumed run re-derives it
                _dist.seed_everything(_dist.epoch_seed(p.seed, ctx.rank, epoch))
            set_epoch(run.train_loader, epoch)
            cbs("on_epoch_start", state)
            row = self._train_epoch(run, epoch)
            ctx.broadcast_buffers([run.model, run.ema.module if run.ema is not None else None])
            if (epoch + 1) % p.run_validation_freq == 0 or epoch + 1 == n_epochs or self._steps_done(run):
                self._validate(run, row)
                run.schedule.observe(row.get(run.watch_key), p.greater_metric_to_watch_is_better)
            row.update(_memory_mb(run.device))
            cbs("on_epoch_end", state)
            self._end_epoch(run, epoch, row)
            last = row
            if run.triggers.stop_at_epoch_end():
                raise self._interrupted(run)
            stop = self._stop_message(run, epoch)
            if stop:
                if ctx.is_main:
                    print(stop, flush=True)
                break
        return last

    def _interrupted(self, run: Run) -> TrainingInterrupted:
        return TrainingInterrupted(
            f"training stopped on {run.triggers.stop.signal} after optimizer step {run.global_step}; "
            f"{os.path.join(self.experiment_dir, 'ckpt_latest.pth')} continues it with resume=True")

    @staticmethod
    def _steps_done(run: Run) -> bool:
        return bool(run.p.max_steps) and run.global_step >= run.p.max_steps

    @staticmethod
    def _log_step(run: Run, loss: torch.Tensor) -> None:
        """The step's scalars into the step log (device copies; NOTE [step log without syncs])."""
        if not run.step_log.loggers:
            return
        scaler = run.scaler
        scale = scaler.get_scale_tensor() if scaler.is_enabled() else None
        norm = run.opt.last_grad_norm if run.fused else None
        step = run.global_step - 1
        run.step_log.record(step, run.schedule(step), loss, scale, norm)

    def _export(self, run: Run) -> List[Dict[str, Any]]:
        """training_params.export: the final weights (the EMA's with ema) to files in the experiment folder, each
        checked against the eager model on the first validation batch."""
        model = run.ema.module if run.ema is not None else run.model
        loader = next(iter(run.valid_loaders.values()), None) or run.train_loader
        inputs, _, _ = split_batch(to_device(next(iter(loader)), run.device), run.split_fn)
        was_training = model.training
        try:
            return [export_model(model, inputs, os.path.join(self.experiment_dir, name)) for name in run.p.export]
        finally:
            model.train(was_training)

    @staticmethod
    def _stop_message(run: Run, epoch: int) -> str:
        p = run.p
        if p.early_stopping and run.stale_epochs >= p.early_stopping["patience"]:
            return (f"Early stopping after epoch {epoch + 1}: no improvement of {p.metric_to_watch} for "
                    f"{run.stale_epochs} validation(s)")
        return f"Stopping after epoch {epoch + 1}: {run.state.stop_reason}" if run.state.stop_training else ""

    def _train_epoch(self, run: Run, epoch: int) -> Dict[str, Any]:
        p, train_step, state, cbs, sums = run.p, run.train_step, run.state, run.callbacks, run.sums
        batch_hooks, step_hooks = cbs.has("on_train_batch_end"), cbs.has("on_step_end")
        self._train_mode(run)
        run.train_metrics.reset()
        sums.reset()
        loader = run.train_loader
        has_len = (n_batches := preflight.loader_length(loader)) is not None
        if p.max_train_batches:
            n_batches = min(n_batches or p.max_train_batches, p.max_train_batches)
        batches, step0 = 0, run.global_step
        samples = first_batch = 0
        # NOTE [mid-epoch resume]: the random states before the epoch's iterator is made go into mid-epoch
        # checkpoints; a resume into this epoch makes the iterator from them and continues after its position.
        at, run.resume_position = run.resume_position, None
        if at is not None:
            set_rng_state(at["rng_start"], loader)
        run.epoch_start = {"rng_start": rng_state(loader), "step0": step0}
        batch_iter = loader
        if at is not None:
            batch_iter = resume_iterator(loader, at["batches"], p.resume_skip)
            batches, samples, step0 = at["batches"], at["samples"], at["step0"]
            run.epoch_start["step0"] = step0
            sums.load_state_dict(at["sums"])
            run.train_metrics.load_state_dict(at["train_metrics"])
            set_rng_state(at["rng"], loader)
        progress = _Progress(p.progress_bar and run.ctx.is_main, n_batches or 0,
                             f"epoch {epoch + 1}/{run_epochs(p, run.steps_per_epoch)}")
        t0 = time.perf_counter()
        warmup_time = None
        for i, batch in enumerate(batch_iter, batches):
            if p.max_train_batches and i >= p.max_train_batches:
                break
            batch = to_device(batch, run.device)
            x, y, extras = split_batch(batch, run.split_fn)
            batches += 1
            # Once per session, with a cross-entropy loss: one read of the targets' range.
            first = warmup_time is None and epoch == run.start_epoch and preflight.class_loss(p)
            # The step (channels_last conversion, forward, loss, backward and, on
            # the last micro-batch of a group, the optimizer tail: TrainStep).
            last_micro = n_batches is not None and i + 1 == n_batches
            do_step = train_step.will_step(last_micro)
            if do_step:
                self._set_lr(run.opt, run.schedule(run.global_step))
            rng = preflight.target_range(y) if first else None
            try:
                with run.ctx.grad_sync(train_step.model, do_step):  # DDP: all-reduce only on the stepping micro-batch
                    out_d, loss_d = train_step(x, y, last=last_micro)
            except Exception as e:
                if not run.ctx.fsdp:  # its forward would be a collective the other ranks never join
                    self._explain_failure(run, e, x, y, rng)
                raise
            if first:
                cause = preflight.targets_out_of_range(out_d, y, rng, run.p.loss_params.get("ignore_index", -100))
                if cause:
                    raise ValueError(f"Trainer.train: {cause}")
            if do_step:
                run.global_step += 1
                self._log_step(run, loss_d)
            n = count_samples(x, run.model_input)
            sums.add(loss_d, train_step.components, n)
            run.train_metrics.update(out_d, y, loss_d)
            samples += n
            if batch_hooks or step_hooks:
                state.batch_idx, state.global_step, state.batch = i, run.global_step, (x, y, extras)
                state.outputs, state.loss, state.loss_components = out_d, loss_d, train_step.components
                cbs("on_train_batch_end", state)
                if do_step:
                    cbs("on_step_end", state)
            if warmup_time is None:
                warmup_time = time.perf_counter() - t0
                t_steady = time.perf_counter()
                first_batch = n
                progress.first_step_done()
            elif p.log_interval and progress.bar is not None and (i + 1) % p.log_interval == 0:
                # One host read per log interval, not per step.
                progress.update(loss=f"{self._interval_read(run, samples):.4f}")
            else:
                progress.update()
            if do_step and self._steps_done(run):  # max_steps: the run ends at this step
                break
            if do_step and not last_micro:
                self._between_steps(run, epoch, i + 1, samples)
        progress.close()
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
        elapsed = time.perf_counter() - t0
        steady = time.perf_counter() - t_steady if warmup_time is not None else 0.0
        first_batch *= run.ctx.world_size
        # first_batch also leaves out the samples trained on before a mid-epoch resume (from the throughput).
        first_batch += run.ctx.world_size * (at["samples"] if at is not None else 0)
        samples = int(run.ctx.sum_(sums.tensors() + run.train_metrics.state_tensors(), [samples])[0])
        if samples == 0:
            raise ValueError(f"Trainer.train: the train loader yielded no batches in epoch {epoch + 1}; it must "
                             f"yield at least one per epoch")
        if not has_len and batches < n_batches:
            warnings.warn(f"the train loader (no length) ended after {batches} batches, before max_train_batches="
                          f"{n_batches}, which the lr schedule and the EMA count as one epoch; set max_train_batches "
                          f"to the batches of an epoch", stacklevel=3)
        row: Dict[str, Any] = {"epoch": epoch + 1}
        row.update(_prefixed("train", "", sums.means(samples)))
        row.update({k: v for k, v in _prefixed("train", "", run.train_metrics.compute()).items() if k not in row})
        row["lr"] = run.schedule(max(0, run.global_step - 1))
        row["epoch_time_s"] = elapsed
        row["warmup_time_s"] = warmup_time or 0.0
        row["samples_per_s"] = (samples - first_batch) / steady if steady > 0 else 0.0
        scaler = run.scaler
        if scaler.is_enabled() and scaler.skipped_steps is not None:
            row["skipped_steps"] = run.skipped_before + float(scaler.skipped_steps.item())
            row["loss_scale"] = scaler.get_scale()
            self._check_divergence(run, epoch, row, run.global_step - step0)
        run.state.global_step, run.state.metrics = run.global_step, row
        run.callbacks("on_train_epoch_end", run.state)
        return row

    @staticmethod
    def _interval_read(run: Run, samples: int) -> float:
        """The running loss (for the progress bar), read with the loss scale at
        no extra sync: a scale at its floor is reported at once."""
        scale = run.scaler.get_scale_tensor() if run.scaler.is_enabled() else None
        if scale is None:
            return run.sums.loss.item() / samples
        loss, scale_v = torch.stack([run.sums.loss, scale.double()]).tolist()
        if scale_v <= SCALE_FLOOR and not run.state.stop_training:
            warnings.warn(f"the run diverged at step {run.global_step}: the loss scale is at its floor 2**-126 "
                          f"(every recent step had non-finite gradients); training stops at the end of this epoch",
                          RuntimeWarning, stacklevel=3)
            run.state.request_stop("the run diverged (loss scale at its floor)")
        return loss / samples

    @staticmethod
    def _check_divergence(run: Run, epoch: int, row: Dict[str, Any], steps: int) -> None:
        """NOTE [divergence]: read from the epoch's row (no extra sync). A scale
        at its floor means every recent step had non-finite gradients: the run
        stops, saying so. A fully skipped epoch above the floor only warns (the
        scale may still be settling)."""
        skipped = row["skipped_steps"] - run.skipped_seen
        run.skipped_seen = row["skipped_steps"]
        if row["loss_scale"] <= SCALE_FLOOR:
            msg = (f"the run diverged: the loss scale reached its floor 2**-126 in epoch {epoch + 1} ({skipped:.0f} of "
                   f"its {steps} steps skipped for non-finite gradients; a skipped step leaves the weights as they "
                   f"were); stopping. Lower initial_lr, set clip_grad_norm or check the data for inf/NaN, and start "
                   f"again from an earlier checkpoint")
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            run.state.request_stop(msg)
        elif steps and skipped >= steps:
            warnings.warn(f"every optimizer step of epoch {epoch + 1} ({steps}) was skipped for non-finite gradients; "
                          f"the optimizer did not change the weights in this epoch (loss scale now "
                          f"{row['loss_scale']:g})", RuntimeWarning, stacklevel=3)

    @staticmethod
    def _explain_failure(run: Run, exc: Exception, x, y, rng) -> None:
        """Raise a ValueError naming the cause of a failed step when it is a usual one."""
        def forward(inputs):
            with run.precision.autocast():
                return call_model(run.model, inputs, run.model_input)

        rng = rng if rng is not None else preflight.target_range(y)
        cause = preflight.explain_batch_error(run.model, x, y, rng, run.p.loss_params.get("ignore_index", -100),
                                              forward)
        if cause:
            raise ValueError(f"Trainer.train: the training step failed: {cause}") from exc

    def _validate(self, run: Run, row: Dict[str, Any]) -> None:
        for name, loader in run.valid_loaders.items():
            res = self._evaluate(run.p, run.eval_model, loader, run.loss_fn, run.precision, run.valid_metrics[name],
                                 run.device, run.p.max_valid_batches, run.ctx,
                                 what=f"valid_loader[{name!r}]" if name else "valid_loader")
            row.update(_prefixed("valid", name, res))
            run.callbacks("on_validation_end", run.state, name, res)

    def _run_tests(self, run: Run) -> Dict[str, float]:
        """Each test loader once, on the final weights (the EMA's with ``ema``)."""
        out: Dict[str, float] = {}
        model = run.ema.module if run.ema is not None else run.model
        for name, loader in run.test_loaders.items():
            metrics = MetricSet(run.p.valid_metrics, "test").to(run.device)
            res = self._evaluate(run.p, model, loader, run.loss_fn, run.precision, metrics, run.device, None,
                                 run.ctx, what=f"test_loader[{name!r}]" if name else "test_loader")
            out.update(_prefixed("test", name, res))
            run.callbacks("on_test_end", run.state, name, res)
        if run.ctx.is_main:
            print("Test: " + ", ".join(f"{k}: {v:.4f}" for k, v in out.items()), flush=True)
            os.makedirs(self.experiment_dir, exist_ok=True)
            with open(os.path.join(self.experiment_dir, "test_metrics.json"), "w") as f:
                json.dump(out, f, indent=2)
        return out

    @staticmethod
    def _evaluate(p: TrainingParams, model, loader, loss_fn, precision: Precision, metrics: MetricSet, device,
                  max_batches: Optional[int], ctx: Optional["_dist.DistContext"] = None,
                  what: str = "the loader") -> Dict[str, float]:
        """Loss (unless the model computes its own) and metrics over ``loader``,
        in eval mode under ``inference_mode``; the model is called without
        targets. A distributed run sums every rank's shard."""
        was_training = model.training
        model.eval()
        metrics.reset()
        sums = LossSums(device)
        n = 0
        split_fn, model_input = _resolve_fn(p.split_batch), _resolve_fn(p.model_input)
        batches = itertools.islice(loader, max_batches) if max_batches else loader
        # A sharded model's forward is a collective: every rank runs as many as the rank with the most batches.
        pairs = (fsdp.lockstep(batches, device, f"Trainer: {what}") if ctx is not None and ctx.fsdp
                 else ((b, True) for b in batches))
        with torch.inference_mode(), precision.autocast():
            for batch, real in pairs:
                x, y, _ = split_batch(to_device(batch, device), split_fn)
                if p.channels_last:
                    x = to_channels_last(x)
                out = call_model(model, x, model_input)
                if not real:
                    continue
                b = count_samples(x, model_input)
                loss = None
                if loss_fn is not None:
                    loss, comps = split_loss(loss_fn(out, y))
                    sums.add(loss, comps, b)
                n += b
                metrics.update(out, y, loss)
        model.train(was_training)
        if ctx is not None and ctx.enabled:  # each rank evaluated its shard
            n = ctx.sum_(sums.tensors() + metrics.state_tensors(), [n])[0]
        if n == 0:  # a loss of 0.0 over no samples would pass for a perfect score
            raise ValueError(f"Trainer: {what} yielded no samples; it must yield at least one batch")
        res = sums.means(n) if loss_fn is not None else {}
        res.update({k: v for k, v in metrics.compute().items() if k not in res})
        return res

    def _end_epoch(self, run: Run, epoch: int, row: Dict[str, Any]) -> None:
        """Best metric and early-stopping count, the epoch's log line and files, checkpoints."""
        p, ctx = run.p, run.ctx
        improved = self._update_best(run, row, epoch)
        run.stale_epochs = 0 if improved else run.stale_epochs + (1 if run.watch_key in row else 0)
        run.logger.log_epoch(row)
        run.step_log.flush()
        shards = self._save_shards(run)
        if ctx.is_main:  # logs and checkpoints on rank 0; the others wait at the barrier
            self._print_epoch(row)
            self._write_checkpoint(run, self._checkpoint(run, epoch + 1, shards), latest=True, best=improved,
                                   epoch_file=epoch + 1 if epoch + 1 in p.save_ckpt_epoch_list else None)
        run.triggers.checkpoint_written()
        ctx.barrier()

    # ---- between two steps of an epoch -----------------------------------------------------

    def _between_steps(self, run: Run, epoch: int, batches: int, samples: int) -> None:
        """Validation, a checkpoint and a graceful stop after an optimizer step
        inside an epoch, when ``valid_every_n_steps``, ``ckpt_every_n_steps``,
        ``ckpt_every_minutes`` or a signal ask for them (host tests only)."""
        validate, checkpoint, stop = run.triggers.after_step(run.global_step)
        run.state.global_step = run.global_step  # what the callbacks of a validation or a checkpoint read
        improved = self._validate_at_step(run, epoch) if validate else False
        if checkpoint or improved:
            self._save_mid_epoch(run, epoch, batches, samples, latest=checkpoint, best=improved)
        if stop:
            raise self._interrupted(run)

    def _validate_at_step(self, run: Run, epoch: int) -> bool:
        """``valid_every_n_steps``: validate, report at the step; returns whether the watched metric improved."""
        step = run.global_step - 1  # the index of the step just taken, as in the step log
        row: Dict[str, Any] = {"epoch": epoch + 1, "step": step}
        self._validate(run, row)
        self._train_mode(run)
        improved = self._update_best(run, row, epoch, step=run.global_step)
        values = {k: v for k, v in row.items() if k.startswith("valid_")}
        run.step_log.write(step, values)
        if run.ctx.is_main:
            print(f"Step: {run.global_step}, " + ", ".join(f"{k}: {v:.4f}" for k, v in values.items()), flush=True)
            run.logger.log_step_validation(row)
        return improved

    def _save_mid_epoch(self, run: Run, epoch: int, batches: int, samples: int, latest: bool, best: bool) -> None:
        """A checkpoint with the position in the epoch (NOTE [mid-epoch resume]); every rank sends its part."""
        run.step_log.flush()
        mine = {"rng_start": run.epoch_start["rng_start"], "rng": rng_state(run.train_loader),
                "sums": run.sums.state_dict(), "train_metrics": run.train_metrics.state_dict(), "samples": samples}
        ranks = run.ctx.gather_object(mine)
        shards = self._save_shards(run)
        if run.ctx.is_main:
            state = self._checkpoint(run, epoch, shards)
            state["position"] = {"epoch": epoch, "batches": batches, "step0": run.epoch_start["step0"],
                                 "skipped_seen": run.skipped_seen, "ranks": ranks}
            self._write_checkpoint(run, state, latest=latest, best=best)
        if latest:
            run.triggers.checkpoint_written()
        run.ctx.barrier()

    @staticmethod
    def _train_mode(run: Run) -> None:
        run.model.train()
        for m in run.frozen_bn:  # freeze_bn_stats: pretrained running statistics stay
            m.eval()

    @staticmethod
    def _update_best(run: Run, row: Dict[str, Any], epoch: int, step: Optional[int] = None) -> bool:
        p, best, key = run.p, run.best, run.watch_key
        if key not in row:
            return False
        v = row[key]
        min_delta = p.early_stopping["min_delta"] if p.early_stopping else 0.0
        if best["value"] is None:
            better = True
        elif p.greater_metric_to_watch_is_better:
            better = v > best["value"] + min_delta
        else:
            better = v < best["value"] - min_delta
        if better:
            best.update(value=v, epoch=epoch + 1)
            if step is not None:  # a valid_every_n_steps validation: the optimizer steps done
                best["step"] = step
            else:
                best.pop("step", None)
        return better

    @staticmethod
    def _print_epoch(row: Dict[str, Any]) -> None:
        parts = [f"Epoch: {row['epoch']}", f"Loss: {row['train_loss']:.4f}"]
        for k, v in row.items():
            if k.startswith(("train_", "valid_")) and k != "train_loss":
                parts.append(f"{k}: {v:.4f}")
        parts.append(f"Elapsed Time: {row['epoch_time_s']:.2f}sec")
        if "reserved_memory_mb" in row:
            parts.append(f"Reserved Memory: {row['reserved_memory_mb']:.2f}MB")
        parts.append(f"Peak Memory: {row['peak_memory_mb']:.2f}MB")
        parts.append(f"Throughput: {row['samples_per_s']:.1f} samples/s")
        print(", ".join(parts), flush=True)

    # ---- checkpoints -----------------------------------------------------------------------

    @staticmethod
    def _save_shards(run: Run) -> Optional[str]:
        """fsdp: every rank writes its shards (NOTE [sharded checkpoints]); returns their folder's name."""
        if not run.ctx.fsdp:
            return None
        name = sharded_checkpoints.new_name(run.global_step)
        sharded_checkpoints.save(run.state.experiment_dir, name, run.model, run.opt,
                                 run.ema.module if run.ema is not None else None)
        return name

    def _checkpoint(self, run: Run, epoch: int, shards: Optional[str] = None) -> Dict[str, Any]:
        """The checkpoint's contents; with ``shards`` the tensors that are sharded live in that folder."""
        scaler, ema = run.scaler, run.ema
        skipped = (float(scaler.skipped_steps.item()) if scaler.is_enabled() and scaler.skipped_steps is not None
                   else 0.0)
        ema_state = ema.state_dict() if ema is not None else None
        if shards is not None and ema_state is not None:
            del ema_state["module"]
        return {"model": unwrap_model(run.model).state_dict() if shards is None else None,
                "optimizer": run.opt.state_dict() if shards is None else None, "shards": shards,
                "scaler": scaler.state_dict(), "ema": ema_state,
                "epoch": epoch, "global_step": run.global_step, "best": dict(run.best),
                "stale_epochs": run.stale_epochs, "rng": rng_state(run.train_loader),
                "training_params": run.p.to_dict(json_safe=True), "world_size": run.ctx.world_size,
                "skipped_steps": run.skipped_before + skipped, "schedule": run.schedule.state_dict()}

    def _write_checkpoint(self, run: Run, state: Dict[str, Any], latest: bool, best: bool,
                          epoch_file: Optional[int] = None) -> None:
        """Write ``state`` (atomically) as ``ckpt_latest.pth`` and/or ``ckpt_best.pth``, the epoch's file of
        ``save_ckpt_epoch_list`` and, with ``keep_last_ckpts``, ``ckpt_step_<N>.pth`` (the files after the first
        are links to it, or copies where the file system has no links)."""
        names = (["ckpt_latest.pth"] if latest else []) + (["ckpt_best.pth"] if best else [])
        names += [f"ckpt_epoch_{epoch_file}.pth"] if epoch_file is not None else []
        names += [f"ckpt_step_{run.global_step}.pth"] if latest and run.p.keep_last_ckpts else []
        paths = [os.path.join(self.experiment_dir, n) for n in names]
        for k, path in enumerate(paths):
            if k == 0:
                atomic_save(state, path)
            else:
                atomic_copy(paths[0], path)
            run.callbacks("on_checkpoint_saved", run.state, path)
        if latest and run.p.keep_last_ckpts:
            self._prune_step_checkpoints(run.p.keep_last_ckpts)
        sharded_checkpoints.collect_garbage(self.experiment_dir)  # also after a sharded run resumed unsharded

    def _prune_step_checkpoints(self, keep: int) -> None:
        found = sorted((int(m.group(1)), n) for n in os.listdir(self.experiment_dir)
                       if (m := re.fullmatch(r"ckpt_step_(\d+)\.pth", n)))
        for _, name in found[:-keep]:
            os.remove(os.path.join(self.experiment_dir, name))
