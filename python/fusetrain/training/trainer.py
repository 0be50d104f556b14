"""The Trainer: ``Trainer(experiment_name).train(model, training_params, train_loader, valid_loader)``.

``train`` checks the params, the model and the loaders, asks the checkpoint
owner once what the run continues (a fresh run or a checkpoint: NOTE [run
folders]), takes the run's folder and builds (:mod:`.build`) a
:class:`~fusetrain.training.loop.Run` whose phases make the loop: per epoch, train (the fused, host-sync-free :class:`TrainStep` on
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

import contextlib
import os
from typing import Any, Dict, List, Optional

from torch import nn

from ..amp import resolve_precision
from ..export import check_onnx_packages
from . import distributed as _dist
from . import after_training, finetune, preflight
from .build import build_loss_fn, build_run, named_loaders
from .checkpoint.manager import CheckpointManager
from .checkpoint.run_folder import RunFolder, new_run_name
from .distributed import launcher, preemption
from .distributed.preemption import TrainingInterrupted
from .logging import step_log
from .logging.console import ConsoleLog, write_training_params
from .logging.experiment_log import wait_for_plots
from .params import TrainingParams, TrainingParamsError, resolve_training_params
from .task.evaluation import batch_rules, evaluate
from .task.metrics import MetricSet

__all__ = ["Trainer"]


def _train_worker(experiment_name: str, ckpt_root_dir: str, run_name: str, model: nn.Module,
                  training_params: Dict[str, Any], train_loader, valid_loader, test_loader) -> Dict[str, Any]:
    """What each worker started for ``multi_gpu: ddp`` runs: the same train call, into the run folder its
    starter named."""
    trainer = Trainer(experiment_name, ckpt_root_dir=ckpt_root_dir)
    trainer._run_name = run_name
    return trainer.train(model, training_params, train_loader, valid_loader, test_loader)


class Trainer:
    """Trains a model with fusetrain's fused step; see ``docs/training_params.md``
    and the guides in ``docs/guides/``.

    Args:
      experiment_name: the experiment's folder under ``ckpt_root_dir``; each run
        writes a folder of its own in it (NOTE [run folders]).
      ckpt_root_dir: where experiments are written (default ``./checkpoints``).
    """

    def __init__(self, experiment_name: str, ckpt_root_dir: Optional[str] = None) -> None:
        if not isinstance(experiment_name, str) or not experiment_name or os.sep in experiment_name:
            raise ValueError(f"Trainer: experiment_name must be a non-empty folder name, got {experiment_name!r}")
        self.experiment_name = experiment_name
        self.ckpt_root_dir = ckpt_root_dir or os.path.join(os.getcwd(), "checkpoints")
        self.experiment_dir = os.path.join(self.ckpt_root_dir, experiment_name)
        self.params: Optional[TrainingParams] = None
        self._run_name: Optional[str] = None  # set by _train_worker: the run folder its starter named

    # ---- public API ------------------------------------------------------------------

    def train(self, model: nn.Module, training_params: Optional[Dict[str, Any]] = None, train_loader=None,
              valid_loader=None, test_loader=None) -> Dict[str, Any]:
        """Train ``model``. ``valid_loader`` and ``test_loader`` are a loader or a
        dict of name -> loader (logged as ``valid_<name>_<metric>``); the test
        loaders are evaluated once, after training, on the final weights (the
        EMA's with ``ema``). Returns ``{"final": last epoch's row, "best":
        {"metric", "value", "epoch"}, "test": {test_<metric>: value},
        "run_dir": this run's folder, "experiment_dir": the experiment's}``
        (and ``"average_model"`` with ``average_best_models``)."""
        p = resolve_training_params(training_params)
        self.params = p
        self._check_inputs(model, p, train_loader, valid_loader, test_loader)
        n_workers = _dist.workers_to_launch(p)
        # NOTE [checkpoints are data]: the checkpoint is read (or refused), its data order and global batch on
        # this many processes and its training_params checked, before anything is changed or written.
        plan = CheckpointManager.plan(self.experiment_dir, p, train_loader,
                                      n_workers if n_workers > 1 else _dist.env_world()[1])
        pretrained = self._prepare_model(model, p, plan.resumed)
        preflight.check_trainable(model)
        # Name prefixes and patterns (initial_lr, lr_multipliers, layer_decay) are checked before the folder is opened.
        finetune.lr_scales(model, p.lr_multipliers, p.layer_decay, p.initial_lr)
        if n_workers > 1:  # multi_gpu 'ddp' outside a launcher: start the workers, each runs this method
            return self._launch(model, p, train_loader, valid_loader, test_loader, n_workers)
        p = plan.data.params
        ctx, device = _dist.setup(p)
        run_dir = plan.run_dir or os.path.join(self.experiment_dir, ctx.broadcast_object(
            self._run_name or new_run_name()))
        # NOTE [metrics plot]: an earlier session's plot is written first (every run's, for overwrite_experiment)
        wait_for_plots(None if p.overwrite_experiment else run_dir)
        folder = RunFolder(run_dir)
        failed = True
        try:
            with contextlib.ExitStack() as stack:
                if ctx.is_main:  # rank 0 writes the folder (NOTE [folder lock], NOTE [run folders])
                    folder.open(clear_experiment=p.overwrite_experiment)
                    write_training_params(run_dir, p.to_dict(json_safe=True))
                    stack.enter_context(ConsoleLog(run_dir))
                    if p.resume == "auto":
                        print(f"resume: auto: {plan.describe()}" if plan.resumed else
                              f"resume: auto: no run of {self.experiment_dir} has a checkpoint; starting a fresh run",
                              flush=True)
                    if plan.data.note:
                        print(plan.data.note, flush=True)
                run = build_run(model, p, train_loader, valid_loader, test_loader, plan, run_dir,
                                self.experiment_name, ctx, device)
                del plan
                result = run.loop()
                if pretrained is not None:
                    result["pretrained"] = pretrained
                if p.export and ctx.is_main:
                    result["export"] = after_training.export(run)
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

    @staticmethod
    def _check_inputs(model, p: TrainingParams, train_loader, valid_loader, test_loader) -> None:
        """What can be checked of the inputs before anything is read or written."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"Trainer.train: model must be an nn.Module, got {type(model).__name__}")
        if train_loader is None:
            raise ValueError("Trainer.train: train_loader is required")
        named_loaders(valid_loader, "valid_loader")
        named_loaders(test_loader, "test_loader")
        preemption.check_auto_requeue(p)
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
        preflight.check_not_empty(train_loader, "train_loader")
        for what, loaders in (("valid_loader", valid_loader), ("test_loader", test_loader)):
            for name, loader in named_loaders(loaders, what).items():
                preflight.check_not_empty(loader, f"{what}[{name!r}]" if name else what)

    @staticmethod
    def _prepare_model(model: nn.Module, p: TrainingParams, resumed: bool):
        """Pretrained weights (not when resuming: the checkpoint has the weights)
        and frozen parameters, before anything is written; returns the load report."""
        report = None
        if p.pretrained_weights and not resumed:  # NOTE [checkpoints are data]
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
        return evaluate(model, test_loader, build_loss_fn(p, device), precision, ms, device, **batch_rules(p),
                        what="Trainer.test: test_loader")

    def _launch(self, model, p, train_loader, valid_loader, test_loader, nprocs: int) -> Dict[str, Any]:
        """Start ``nprocs`` workers that each run this ``train`` call (a fresh run into the run folder named
        here; a resumed one into its own); then load the final weights (the last checkpoint) into ``model`` so
        the caller holds the trained model, as after a single-process run. Returns rank 0's result."""
        args = (self.experiment_name, self.ckpt_root_dir, new_run_name(), model, p, train_loader, valid_loader,
                test_loader)
        result = launcher.launch(_train_worker, args, nprocs,
                                 payload_names=("experiment_name", "ckpt_root_dir", "the run's name", "the model",
                                                "training_params", "the train loader", "the validation loader",
                                                "the test loader"),
                                 signals=p.preemption_signals)
        CheckpointManager.load_final_weights(result["run_dir"], model)
        return result
