"""The Trainer: ``Trainer(experiment_name).train(model, training_params, train_loader, valid_loader)``.

The loop runs the fused, host-sync-free step (fusetrain optimizers with the
LossScaler and an attached ModelEMA), keeps the running loss and metrics in
device tensors (read once per epoch, or once per ``log_interval`` steps for the
progress bar), validates under ``torch.inference_mode()`` with the training
precision (on the EMA weights when ``ema`` is on), logs each epoch (CSV, JSONL,
TensorBoard, console) and writes checkpoints atomically. ``resume=True``
continues the same run bit-identically (model, EMA, optimizer with master
weights, scaler, schedule position, RNG states).
"""

from __future__ import annotations

import os
import random
import resource
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from torch import Tensor, nn

from ..amp import LossScaler, Precision, resolve_precision
from ..ema import ModelEMA, unwrap_model
from ..optim._base import FusedOptimizer
from . import distributed as _dist
from .checkpoints import atomic_save, load_checkpoint
from .experiment_log import ExperimentLogger
from .metrics import Metric, build_metrics, compute_all
from .step import TrainStep
from .params import LOSSES, TrainingParams, TrainingParamsError, optimizer_class, resolve_training_params
from .schedules import LRSchedule

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


class Trainer:
    """Trains a model with fusetrain's fused step; see ``docs/training_params.md``.

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
        self._dist_state = _dist.SINGLE  # this process's place in a distributed run (set by train)

    # ---- building blocks -----------------------------------------------------------

    @staticmethod
    def _loss_fn(p: TrainingParams) -> Callable[[Tensor, Tensor], Tensor]:
        if callable(p.loss) and not isinstance(p.loss, str):
            return p.loss
        return LOSSES[p.loss](**p.loss_params)

    @staticmethod
    def _build_optimizer(model: nn.Module, p: TrainingParams, device: torch.device):
        cls = optimizer_class(p.optimizer)
        fused = issubclass(cls, FusedOptimizer)
        trainable = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
        if p.zero_weight_decay_on_bias_and_bn:
            decay = [q for _, q in trainable if q.dim() > 1]
            no_decay = [q for _, q in trainable if q.dim() <= 1]
            groups: List[Dict[str, Any]] = [{"params": decay}]
            if no_decay:
                groups.append({"params": no_decay, "weight_decay": 0.0})
        else:
            groups = [{"params": [q for _, q in trainable]}]
        kwargs = dict(p.optimizer_params)
        if fused:
            # NOTE [lr tensor]: a device tensor lr is filled by the schedule each
            # step; no host sync, and no recompilation under torch.compile.
            lr: Any = torch.tensor(p.initial_lr, dtype=torch.float32, device=device)
            kwargs["max_grad_norm"] = p.clip_grad_norm
        else:
            lr = p.initial_lr
        return cls(groups, lr=lr, **kwargs), fused

    def _build_step(self, model, loss_fn, opt, fused: bool, scaler: LossScaler, precision: Precision, ema,
                    p: TrainingParams) -> TrainStep:
        """The per-batch step (``compile_step``); ``model`` is what it runs:
        the DDP wrapper, or the torch.compile'd model when ``compile_step`` is off."""
        options = dict(p.torch_compile_options, mode=p.torch_compile_mode)
        return TrainStep(model, loss_fn, opt, scaler, precision, mode=p.compile_step, accumulate=p.batch_accumulate,
                         ema=ema, compile_options=options, channels_last=p.channels_last,
                         clip_grad_norm=None if fused else p.clip_grad_norm)

    def _set_lr(self, opt, value: float, fused: bool) -> None:
        seen = set()
        for g in opt.param_groups:
            lr = g["lr"]
            if isinstance(lr, Tensor):
                if id(lr) not in seen:
                    seen.add(id(lr))
                    lr.fill_(value)
            else:
                g["lr"] = value

    # ---- public API ------------------------------------------------------------------

    def train(self, model: nn.Module, training_params: Optional[Dict[str, Any]] = None, train_loader=None,
              valid_loader=None) -> Dict[str, Any]:
        """Train ``model``; returns ``{"final": last epoch's metrics, "best": {"metric", "value", "epoch"},
        "experiment_dir": path}``."""
        p = resolve_training_params(training_params)
        self.params = p
        if not isinstance(model, nn.Module):
            raise TypeError(f"Trainer.train: model must be an nn.Module, got {type(model).__name__}")
        if train_loader is None:
            raise ValueError("Trainer.train: train_loader is required")
        resume_path = None
        if p.resume or p.resume_path:
            resume_path = p.resume_path or os.path.join(self.experiment_dir, "ckpt_latest.pth")
            if not os.path.isfile(resume_path):
                raise FileNotFoundError(f"training_params.resume: no checkpoint at {resume_path}")
        n_workers = _dist.workers_to_launch(p)
        if n_workers > 1:  # multi_gpu 'ddp' outside a launcher: start the workers, each runs this method
            return _dist.launch_training(self, model, p, train_loader, valid_loader, n_workers)
        dist_state, device = _dist.setup(p)
        self._dist_state = dist_state
        failed = True
        try:
            result = self._train_in_process(model, p, train_loader, valid_loader, resume_path, dist_state, device)
            failed = False
            return result
        except BaseException as exc:
            other_rank_failed = _dist.on_failure(dist_state, exc, "during training")
            if other_rank_failed is not None:
                raise other_rank_failed from exc
            raise
        finally:
            _dist.teardown(dist_state, failed)
            self._dist_state = _dist.SINGLE

    def _train_in_process(self, model: nn.Module, p: TrainingParams, train_loader, valid_loader,
                          resume_path: Optional[str], dist_state: "_dist.DistState",
                          device: torch.device) -> Dict[str, Any]:
        if p.compile_step == "cuda_graph" and (device.type != "cuda" or dist_state.enabled):
            raise TrainingParamsError([f"training_params.compile_step: got 'cuda_graph' "
                             + (f"but the device is {device}; CUDA graphs need a GPU" if device.type != "cuda" else
                                "in a distributed run") + "; allowed here: 'off' or 'compile'"])
        # Reproducibility and speed switches.
        torch.manual_seed(p.seed)
        random.seed(p.seed)
        np.random.seed(p.seed % 2**32)
        torch.backends.cudnn.benchmark = bool(p.cudnn_benchmark)
        torch.autograd.set_detect_anomaly(False)
        if torch.autograd._profiler_enabled():
            warnings.warn("Trainer: the autograd profiler is active and slows every step", stacklevel=2)

        model = model.to(device)
        if p.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if p.sync_bn:
            if dist_state.enabled:
                model = _dist.convert_sync_batchnorm(model)
            else:
                warnings.warn("training_params.sync_bn: not a distributed run, BatchNorm stays local", stacklevel=2)
        # DDP broadcasts rank 0's weights: built before the optimizer (master weights) and the EMA copy them.
        ddp_model = (_dist.wrap_model(model, dist_state, device, p.find_unused_parameters) if dist_state.enabled
                     else model)
        train_loader = _dist.shard_train_loader(train_loader, dist_state, p.seed)
        valid_loader = _dist.shard_valid_loader(valid_loader, dist_state)
        precision = resolve_precision(p.mixed_precision, device)
        scaler = precision.make_scaler(**p.scaler_params)
        opt, fused = self._build_optimizer(model, p, device)
        steps_per_epoch = self._steps_per_epoch(train_loader, p)
        schedule = LRSchedule(p, steps_per_epoch)
        ema = None
        if p.ema:
            ema_kwargs = dict(p.ema_params)
            ema_kwargs.setdefault("total_steps", p.max_epochs * steps_per_epoch)
            ema = ModelEMA(model, **ema_kwargs)
        loss_fn = self._loss_fn(p)
        if isinstance(loss_fn, nn.Module):
            loss_fn = loss_fn.to(device)

        start_epoch, global_step = 0, 0
        # Steps skipped by the loss scaler in earlier sessions of a resumed run
        # (the scaler's own counter starts at 0 in each process).
        self._skipped_before = 0.0
        best = {"metric": p.metric_to_watch, "value": None, "epoch": None}
        stale_epochs = 0
        logger = ExperimentLogger(self.experiment_dir) if dist_state.is_main else _dist.NullLogger()
        if resume_path is not None:
            ck = load_checkpoint(resume_path)
            unwrap_model(model).load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            if fused:  # keep one device lr tensor per optimizer (NOTE [lr tensor])
                lr_t = torch.tensor(p.initial_lr, dtype=torch.float32, device=device)
                for g in opt.param_groups:
                    g["lr"] = lr_t
            scaler.load_state_dict(ck["scaler"]) if ck.get("scaler") else None
            if ema is not None and ck.get("ema") is not None:
                ema.load_state_dict(ck["ema"])
            start_epoch, global_step = int(ck["epoch"]), int(ck["global_step"])
            best = ck.get("best", best)
            stale_epochs = int(ck.get("stale_epochs", 0))
            self._skipped_before = float(ck.get("skipped_steps", 0.0))
            self._set_rng(ck["rng"], train_loader)
            logger.load_existing(start_epoch)
        if ema is not None and fused:
            ema.attach(opt)

        # Distributed: the DDP-wrapped module is compiled, so Dynamo's DDPOptimizer can split the graph at the
        # gradient buckets and overlap the all-reduces with the backward (docs/design.md).
        train_model = ddp_model
        if p.torch_compile:
            train_model = torch.compile(ddp_model, mode=p.torch_compile_mode, **p.torch_compile_options)
        eval_model = ema.module if ema is not None else train_model
        if ema is None and ddp_model is not model:  # validate without DDP: no collectives, shards may differ
            eval_model = (torch.compile(model, mode=p.torch_compile_mode, **p.torch_compile_options)
                          if p.torch_compile else model)
        if p.torch_compile and ema is not None:
            eval_model = torch.compile(ema.module, mode=p.torch_compile_mode, **p.torch_compile_options)
        # Built after a resume has loaded the state (a captured step reads it at fixed addresses).
        train_step = self._build_step(ddp_model if p.compile_step != "off" else train_model, loss_fn, opt, fused,
                                      scaler, precision, ema, p)

        train_metrics = build_metrics(p.train_metrics, device)
        valid_metrics = build_metrics(p.valid_metrics, device)
        running_loss = torch.zeros((), dtype=torch.float64, device=device)
        last: Dict[str, Any] = {}
        try:
            for epoch in range(start_epoch, p.max_epochs):
                if dist_state.enabled:  # per rank and epoch, so a resumed run re-derives it
                    _dist.seed_everything(_dist.epoch_seed(p.seed, dist_state.rank, epoch))
                _dist.set_epoch(train_loader, epoch)
                row, global_step = self._train_epoch(epoch, p, train_step, model, opt, fused, scaler, ema, loss_fn,
                                                     precision, schedule, train_loader, train_metrics, running_loss,
                                                     device, global_step, steps_per_epoch)
                _dist.broadcast_buffers(dist_state, [model, ema.module if ema is not None else None])
                if valid_loader is not None and ((epoch + 1) % p.run_validation_freq == 0 or
                                                 epoch + 1 == p.max_epochs):
                    row.update({f"valid_{k}": v for k, v in self._evaluate(
                        eval_model, valid_loader, loss_fn, precision, valid_metrics, device,
                        p.max_valid_batches, p.channels_last, dist_state=dist_state).items()})
                row.update(_memory_mb(device))
                improved = self._update_best(best, row, p, epoch)
                stale_epochs = 0 if improved else stale_epochs + (1 if f"valid_{p.metric_to_watch}" in row else 0)
                logger.log_epoch(row)
                if dist_state.is_main:
                    self._print_epoch(row)
                last = row
                if dist_state.is_main:  # logs and checkpoints on rank 0; the others wait at the barrier
                    state = self._checkpoint(model, opt, scaler, ema, epoch + 1, global_step, best, stale_epochs,
                                             p, train_loader)
                    atomic_save(state, os.path.join(self.experiment_dir, "ckpt_latest.pth"))
                    if improved:
                        atomic_save(state, os.path.join(self.experiment_dir, "ckpt_best.pth"))
                    if epoch + 1 in p.save_ckpt_epoch_list:
                        atomic_save(state, os.path.join(self.experiment_dir, f"ckpt_epoch_{epoch + 1}.pth"))
                _dist.barrier(dist_state)
                if p.early_stopping and stale_epochs >= p.early_stopping["patience"]:
                    if dist_state.is_main:
                        print(f"Early stopping after epoch {epoch + 1}: no improvement of {p.metric_to_watch} "
                              f"for {stale_epochs} validation(s)")
                    break
        finally:
            if ema is not None:
                ema.detach()
            if logger.rows:
                try:
                    logger.plot()
                except Exception as e:  # the plot is a convenience, never a failure
                    warnings.warn(f"could not write the metrics plot: {e}", stacklevel=2)
            logger.close()
        return {"final": last, "best": best, "experiment_dir": self.experiment_dir}

    def test(self, model: nn.Module, test_loader, metrics: Optional[List[str]] = None,
             training_params: Optional[Dict[str, Any]] = None) -> Dict[str, float]:
        """Evaluate ``model`` on ``test_loader`` (precision/loss/device from
        ``training_params``, default those of the last ``train``)."""
        p = resolve_training_params(training_params) if training_params is not None else (
            self.params or resolve_training_params({}))
        device = _dist._single_device(p.device)
        model = model.to(device)
        precision = resolve_precision(p.mixed_precision, device)
        ms = build_metrics(metrics or list(p.valid_metrics), device)
        loss_fn = self._loss_fn(p)
        if isinstance(loss_fn, nn.Module):
            loss_fn = loss_fn.to(device)
        return self._evaluate(model, test_loader, loss_fn, precision, ms, device, None, p.channels_last)

    # ---- loop pieces -------------------------------------------------------------------

    @staticmethod
    def _steps_per_epoch(loader, p: TrainingParams) -> int:
        try:
            n = len(loader)
        except TypeError:
            n = p.max_train_batches or 1
        if p.max_train_batches:
            n = min(n, p.max_train_batches)
        return max(1, -(-n // p.batch_accumulate))

    def _train_epoch(self, epoch, p, train_step: TrainStep, model, opt, fused, scaler: LossScaler, ema, loss_fn,
                     precision: Precision, schedule, loader, metrics: List[Metric], running_loss: Tensor,
                     device, global_step: int, steps_per_epoch: int):
        model.train()
        for m in metrics:
            m.reset()
        running_loss.zero_()
        n_batches = len(loader) if hasattr(loader, "__len__") else None
        if p.max_train_batches:
            n_batches = min(n_batches or p.max_train_batches, p.max_train_batches)
        progress = _Progress(p.progress_bar and self._dist_state.is_main, n_batches or 0,
                             f"epoch {epoch + 1}/{p.max_epochs}")
        samples = 0
        t0 = time.perf_counter()
        warmup_time = None
        for i, (x, y) in enumerate(loader):
            if p.max_train_batches and i >= p.max_train_batches:
                break
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            # The step (channels_last conversion, forward, loss, backward and, on
            # the last micro-batch of a group, the optimizer tail: TrainStep).
            last_micro = n_batches is not None and i + 1 == n_batches
            do_step = train_step.will_step(last_micro)
            if do_step:
                self._set_lr(opt, schedule(global_step), fused)
            with _dist.grad_sync(train_step.model, do_step):  # DDP: all-reduce only on the micro-batch that steps
                out_d, loss_d = train_step(x, y, last=last_micro)
            if do_step:
                global_step += 1
            running_loss += loss_d.double() * x.shape[0]
            for m in metrics:
                m.update(out_d.float(), y, loss_d)
            samples += x.shape[0]
            if warmup_time is None:
                warmup_time = time.perf_counter() - t0
                t_steady = time.perf_counter()
                progress.first_step_done()
            elif p.log_interval and progress.bar is not None and (i + 1) % p.log_interval == 0:
                # One host read per log interval, not per step.
                progress.update(loss=f"{running_loss.item() / samples:.4f}")
            else:
                progress.update()
        progress.close()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        steady = time.perf_counter() - t_steady if warmup_time is not None else 0.0
        first_batch = x.shape[0] * self._dist_state.world_size if samples else 0
        samples = int(_dist.reduce_epoch(self._dist_state, running_loss, metrics, samples))  # all ranks' sums
        row: Dict[str, Any] = {"epoch": epoch + 1}
        row["train_loss"] = running_loss.item() / max(1, samples)
        row.update({f"train_{k}": v for k, v in compute_all(metrics).items() if k != "loss"})
        row["lr"] = schedule(max(0, global_step - 1))
        row["epoch_time_s"] = elapsed
        row["warmup_time_s"] = warmup_time or 0.0
        row["samples_per_s"] = (samples - first_batch) / steady if steady > 0 else 0.0
        if scaler.is_enabled() and scaler.skipped_steps is not None:
            row["skipped_steps"] = self._skipped_before + float(scaler.skipped_steps.item())
            row["loss_scale"] = scaler.get_scale()
        return row, global_step

    @staticmethod
    def _evaluate(model, loader, loss_fn, precision: Precision, metrics: List[Metric], device, max_batches,
                  channels_last: bool, dist_state: Optional["_dist.DistState"] = None) -> Dict[str, float]:
        was_training = model.training
        model.eval()
        for m in metrics:
            m.reset()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        n = 0
        with torch.inference_mode(), precision.autocast():
            for i, (x, y) in enumerate(loader):
                if max_batches and i >= max_batches:
                    break
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                if channels_last and x.dim() == 4:
                    x = x.contiguous(memory_format=torch.channels_last)
                out = model(x)
                loss = loss_fn(out, y)
                loss_sum += loss.double() * x.shape[0]
                n += x.shape[0]
                for m in metrics:
                    m.update(out.float(), y, loss)
        model.train(was_training)
        if dist_state is not None and dist_state.enabled:  # each rank validated its shard
            n = _dist.reduce_epoch(dist_state, loss_sum, metrics, n)
        res = {"loss": loss_sum.item() / max(1, n)}
        res.update({k: v for k, v in compute_all(metrics).items() if k != "loss"})
        return res

    @staticmethod
    def _update_best(best: Dict[str, Any], row: Dict[str, Any], p: TrainingParams, epoch: int) -> bool:
        key = f"valid_{p.metric_to_watch}"
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

    # ---- checkpoints and RNG -------------------------------------------------------------

    @staticmethod
    def _rng_state(loader) -> Dict[str, Any]:
        gen = getattr(loader, "generator", None)
        return {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "numpy": np.random.get_state(), "python": random.getstate(),
                "loader": gen.get_state() if isinstance(gen, torch.Generator) else None}

    @staticmethod
    def _set_rng(state: Dict[str, Any], loader) -> None:
        torch.set_rng_state(state["torch"])
        if state.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        gen = getattr(loader, "generator", None)
        if state.get("loader") is not None and isinstance(gen, torch.Generator):
            gen.set_state(state["loader"])

    def _checkpoint(self, model, opt, scaler, ema, epoch, global_step, best, stale_epochs, p, loader):
        return {"model": unwrap_model(model).state_dict(), "optimizer": opt.state_dict(),
                "scaler": scaler.state_dict(), "ema": ema.state_dict() if ema is not None else None,
                "epoch": epoch, "global_step": global_step, "best": dict(best), "stale_epochs": stale_epochs,
                "rng": self._rng_state(loader), "training_params": p.to_dict(json_safe=True),
                "world_size": self._dist_state.world_size,
                "skipped_steps": self._skipped_before + (float(scaler.skipped_steps.item()) if scaler.is_enabled()
                                                         and scaler.skipped_steps is not None else 0.0)}
