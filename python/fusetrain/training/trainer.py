"""The Trainer: ``Trainer(experiment_name).train(model, training_params, train_loader, valid_loader)``.

``train`` checks the params, the model and the loaders, takes the experiment
folder and builds a :class:`~fusetrain.training.loop.Run` whose phases make the
loop: per epoch, train (the fused, host-sync-free :class:`TrainStep` on
batches of any structure), validate on each validation loader under
``torch.inference_mode()`` with the training precision (on the EMA weights
when ``ema`` is on), log the epoch (CSV, JSONL, TensorBoard, console) and
write checkpoints atomically (the run's
:class:`~fusetrain.training.checkpoint.manager.CheckpointManager`); after the
last epoch, evaluate the test loaders. The running loss, its components and
the metrics stay in device tensors, read once per epoch (or once per
``log_interval`` steps for the progress bar). Callbacks run at the phases of
:data:`fusetrain.training.task.callbacks.HOOKS` and read the run's
:class:`~fusetrain.training.task.callbacks.TrainerState`. ``resume=True``
continues the same run bit-identically (model, EMA, optimizer with master
weights, scaler, schedule position, RNG states).
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch import nn

from ..amp import resolve_precision
from ..ema import ModelEMA
from ..export import check_onnx_packages
from ..optim._base import FusedOptimizer
from ..optim._kinds import KINDS
from . import distributed as _dist
from . import finetune, preflight
from .checkpoint import resume_plan as elastic_resume
from .distributed import fsdp
from .distributed import launcher
from .distributed import preemption
from .logging import step_log
from .task.callbacks import CallbackList, TrainerState, build_callbacks
from .checkpoint.manager import CheckpointManager
from .distributed.sharding import shard_train_loader, shard_valid_loader
from .task.evaluation import batch_rules, evaluate, resolve_fn
from .checkpoint.run_folder import ExperimentDir
from .logging.experiment_log import ExperimentLogger, NullLogger, wait_for_plots
from .task.losses import build_loss
from .task.metrics import MetricSet
from .params import TrainingParams, TrainingParamsError, optimizer_class, resolve_training_params
from .params.resolve import watch_candidates
from .logging.progress_bar import Progress as _Progress  # noqa: F401  (the progress bar, under its former name)
from .loop import Run
from .schedules.lr import LRSchedule, base_lr, run_steps
from .schedules.settings import SettingSchedule
from .step.train_step import TrainStep
from .distributed.preemption import GracefulStop, TrainingInterrupted
from .schedules.triggers import StepTriggers

__all__ = ["Trainer"]


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

    _rank_position = staticmethod(elastic_resume.rank_position)  # this rank's part of a mid-epoch position

    # ---- building blocks -----------------------------------------------------------

    @staticmethod
    def _build_optimizer(model: nn.Module, p: TrainingParams, device: torch.device):
        cls = optimizer_class(p.optimizer)
        fused = issubclass(cls, FusedOptimizer)
        groups = finetune.param_groups(model, p.zero_weight_decay_on_bias_and_bn, p.lr_multipliers, p.layer_decay,
                                       p.initial_lr)
        Trainer._assign_lrs(groups, base_lr(p.initial_lr), fused, device)
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

    # ---- public API ------------------------------------------------------------------

    def train(self, model: nn.Module, training_params: Optional[Dict[str, Any]] = None, train_loader=None,
              valid_loader=None, test_loader=None) -> Dict[str, Any]:
        """Train ``model``. ``valid_loader`` and ``test_loader`` are a loader or a
        dict of name -> loader (logged as ``valid_<name>_<metric>``); the test
        loaders are evaluated once, after training, on the final weights (the
        EMA's with ``ema``). Returns ``{"final": last epoch's row, "best":
        {"metric", "value", "epoch"}, "test": {test_<metric>: value},
        "experiment_dir": path}`` (and ``"average_model"`` with
        ``average_best_models``)."""
        p = resolve_training_params(training_params)
        self.params = p
        if not isinstance(model, nn.Module):
            raise TypeError(f"Trainer.train: model must be an nn.Module, got {type(model).__name__}")
        if train_loader is None:
            raise ValueError("Trainer.train: train_loader is required")
        _named_loaders(valid_loader, "valid_loader")
        _named_loaders(test_loader, "test_loader")
        preemption.check_auto_requeue(p)
        resume_path = CheckpointManager.resume_file(self.experiment_dir, p)
        if p.lr_mode == "plateau" and valid_loader is None:
            raise TrainingParamsError(["training_params.lr_mode: got 'plateau' without a valid_loader; allowed: "
                                       "another lr_mode, or pass valid_loader (plateau follows metric_to_watch "
                                       "after each validation)"])
        if p.average_best_models and valid_loader is None:
            raise TrainingParamsError(["training_params.average_best_models: got True without a valid_loader; "
                                       "allowed: pass valid_loader (the best models are those of metric_to_watch "
                                       "after each validation), or average_best_models=False"])
        if p.weights_dtype == "bfloat16" and p.mixed_precision in (False, "fp32", "fp16"):
            raise TrainingParamsError([
                f"training_params.weights_dtype: got 'bfloat16' with mixed_precision {p.mixed_precision!r}; "
                "allowed: mixed_precision bf16 (or true), whose autocast feeds the bfloat16 weights "
                "(or weights_dtype float32)"])
        step_log.check_logger_packages(p.loggers)
        if any(name.endswith(".onnx") for name in p.export):
            check_onnx_packages()
        # NOTE [checkpoints are data]: the checkpoint is read (or refused) before anything is changed.
        resume_ck = CheckpointManager.read(resume_path, p) if resume_path is not None else None
        pretrained = self._prepare_model(model, p, resume_path)
        preflight.check_trainable(model)
        # Name prefixes and patterns (initial_lr, lr_multipliers, layer_decay) are checked before the folder is opened.
        finetune.lr_scales(model, p.lr_multipliers, p.layer_decay, p.initial_lr)
        preflight.check_not_empty(train_loader, "train_loader")
        for what, loaders in (("valid_loader", valid_loader), ("test_loader", test_loader)):
            for name, loader in _named_loaders(loaders, what).items():
                preflight.check_not_empty(loader, f"{what}[{name!r}]" if name else what)
        n_workers = _dist.workers_to_launch(p)
        # The data order and the global batch on this many processes, checked before anything is written
        # (NOTE [resume on another process count]).
        data = elastic_resume.plan(resume_ck, resume_path, p, train_loader,
                                   n_workers if n_workers > 1 else _dist.env_world()[1])
        if n_workers > 1:  # multi_gpu 'ddp' outside a launcher: start the workers, each runs this method
            del resume_ck  # each worker reads it
            return self._launch(model, p, train_loader, valid_loader, test_loader, n_workers)
        p = data.params
        ctx, device = _dist.setup(p)
        wait_for_plots(self.experiment_dir)  # NOTE [metrics plot]: an earlier run's plot is written first
        folder = ExperimentDir(self.experiment_dir)
        failed = True
        try:
            if ctx.is_main:  # rank 0 writes the folder (NOTE [folder lock])
                self._announce_resume(p, resume_path, resume_ck)
                # resume: auto without a checkpoint: the files of an attempt that wrote none are replaced.
                auto_fresh = p.resume == "auto" and resume_path is None
                folder.open(resume=resume_path is not None, overwrite=p.overwrite_experiment or auto_fresh,
                            why="resume: auto found no checkpoint" if auto_fresh else "overwrite_experiment=True")
            if ctx.is_main and data.note:
                print(data.note, flush=True)
            run = self._setup(model, p, train_loader, valid_loader, test_loader, resume_path, resume_ck, ctx, device,
                              data)
            del resume_ck
            result = run.loop()
            if pretrained is not None:
                result["pretrained"] = pretrained
            if p.export and ctx.is_main:
                result["export"] = run.export()
            failed = False
            return result
        except TrainingInterrupted:  # every rank stops at the same step, after the checkpoint: an orderly end
            failed = False
            raise
        except BaseException as exc:
            other_rank_failed = ctx.on_failure(exc, "during training")
            if other_rank_failed is not None:
                raise other_rank_failed from exc
            raise
        finally:
            folder.close()
            ctx.teardown(failed)

    def _announce_resume(self, p: TrainingParams, path: Optional[str], ck: Optional[Dict[str, Any]]) -> None:
        """``resume: auto`` says whether it continues a checkpoint or starts fresh."""
        if p.resume != "auto":
            return
        if path is None:
            missing = p.resume_path or os.path.join(self.experiment_dir, "ckpt_latest.pth")
            print(f"resume: auto: no checkpoint at {missing}; starting a fresh run", flush=True)
            return
        where = (f"inside epoch {ck['position']['epoch'] + 1}" if ck.get("position") is not None
                 else f"after epoch {ck['epoch']}")
        print(f"resume: auto: continuing from {path} (optimizer step {ck['global_step']}, {where}, written by "
              f"{ck.get('world_size', 1)} process(es))", flush=True)

    @staticmethod
    def _prepare_model(model: nn.Module, p: TrainingParams, resume_path: Optional[str]):
        """Pretrained weights (not when resuming: the checkpoint has the weights)
        and frozen parameters, before anything is written; returns the load report."""
        report = None
        if p.pretrained_weights and resume_path is None:  # NOTE [checkpoints are data]
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
        device = _dist.single_device(p.device)
        model = model.to(device)
        precision = resolve_precision(p.mixed_precision, device)
        ms = MetricSet(metrics if metrics is not None else list(p.valid_metrics), "test").to(device)
        return evaluate(model, test_loader, self._loss_fn(p, device), precision, ms, device, **batch_rules(p),
                        what="Trainer.test: test_loader")

    # ---- setup ---------------------------------------------------------------------------

    def _launch(self, model, p, train_loader, valid_loader, test_loader, nprocs: int) -> Dict[str, Any]:
        """Start ``nprocs`` workers that each run this ``train`` call; then load the
        final weights (the last checkpoint) into ``model`` so the caller holds the
        trained model, as after a single-process run. Returns rank 0's result."""
        args = (self.experiment_name, self.ckpt_root_dir, model, p, train_loader, valid_loader, test_loader)
        result = launcher.launch(_train_worker, args, nprocs,
                                 payload_names=("experiment_name", "ckpt_root_dir", "the model", "training_params",
                                                "the train loader", "the validation loader", "the test loader"),
                                 signals=p.preemption_signals)
        CheckpointManager.load_final_weights(self.experiment_dir, model)
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
               resume_path: Optional[str], resume_ck: Optional[Dict[str, Any]], ctx: "_dist.DistContext",
               device: torch.device, data: elastic_resume.DataPlan) -> Run:
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
        model = model.to(device)
        if p.weights_dtype == "bfloat16":
            model = model.to(torch.bfloat16)
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
            if p.weights_dtype == "bfloat16" and ema_kwargs.get("remainder") is False and ctx.is_main:
                warnings.warn("Trainer: ema_params.remainder false with weights_dtype bfloat16 keeps the EMA in "
                              "bfloat16 alone, where an update smaller than half an ulp rounds away (NOTE [ema "
                              "remainder]); leave remainder unset for the exact EMA", stacklevel=3)
            ema_kwargs.setdefault("total_steps", run_steps(p, steps_per_epoch))
            ema = ModelEMA(model, **ema_kwargs)
        if ctx.fsdp:  # the EMA copy is sharded like the model, so the fused step updates it shard by shard
            fsdp.shard([model] + ([ema.module] if ema is not None else []), device, ctx.world_size,
                       p.fsdp_params["wrap"], p.fsdp_params["reshard_after_forward"], precision.name)
            if ema is not None:
                ema.rebuild_index()
        opt, fused = self._build_optimizer(model, p, device)
        loss_fn = self._loss_fn(p, device)
        state = TrainerState(params=p, model=model, optimizer=opt, scaler=scaler, ema=ema, device=device,
                             experiment_dir=self.experiment_dir, is_main=ctx.is_main, world_size=ctx.world_size,
                             best={"metric": p.metric_to_watch, "value": None, "epoch": None})
        logger = ExperimentLogger(self.experiment_dir) if ctx.is_main else NullLogger()
        schedule = LRSchedule(p, steps_per_epoch)
        settings = SettingSchedule(p, schedule, opt)  # momentum / weight decay schedules
        ckpts = CheckpointManager(self.experiment_dir, p, ctx, state, model, opt, scaler, ema, schedule, train_loader,
                                  callbacks)
        if resume_ck is not None:
            ckpts.restore(resume_ck, resume_path, data.changed)
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
        return Run(p=p, ctx=ctx, device=device, model=model, train_step=train_step, eval_model=eval_model, opt=opt,
                   fused=fused, scaler=scaler, precision=precision, ema=ema, loss_fn=loss_fn, schedule=schedule,
                   settings=settings if settings.active else None,
                   steps_per_epoch=steps_per_epoch, train_loader=train_loader, valid_loaders=valid_loaders,
                   test_loaders=test_loaders, train_metrics=train_metrics, valid_metrics=valid_metrics,
                   callbacks=callbacks, state=state, checkpoints=ckpts, logger=logger, watch_key=watch_key,
                   experiment_dir=self.experiment_dir,
                   triggers=StepTriggers(p, ctx, device, GracefulStop(p.preemption_signals)),
                   step_log=step_log.StepLog(step_log.build_loggers(p.loggers, p.logger_params, self.experiment_dir,
                                                                    self.experiment_name) if ctx.is_main else [],
                                             p.log_interval or steps_per_epoch, device),
                   split_fn=resolve_fn(p.split_batch), model_input=resolve_fn(p.model_input),
                   frozen_bn=finetune.frozen_bn_modules(model) if p.freeze_bn_stats else [])
