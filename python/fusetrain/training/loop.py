"""One training run (one process of it): the parts the Trainer built and the
phases of its loop, as methods. Its progress (epoch, step, best metric,
early-stopping count, the epoch's row) lives in ``state``, the
:class:`~fusetrain.training.task.callbacks.TrainerState` that callbacks read; its
checkpoints belong to ``checkpoints``, the
:class:`~fusetrain.training.checkpoint.manager.CheckpointManager`."""

from __future__ import annotations

import copy
import itertools
import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from .._warnings import warn
from ..amp import SCALE_FLOOR, Precision
from . import distributed as _dist
from . import after_training, preflight
from .distributed import preemption
from .task.batches import call_model, count_samples, split_batch, to_device
from .task.callbacks import CallbackList, TrainerState
from ..ema import unwrap_model
from .checkpoint.manager import CheckpointManager
from .checkpoint.position import EpochPosition
from .distributed.sharding import set_epoch
from .distributed.context import DistContext
from .task.evaluation import LossSums, batch_rules, evaluate, prefixed
from .task.metrics import MetricSet
from .logging.console import RunReport
from .logging.progress_bar import Progress
from .params import TrainingParams
from .schedules.lr import LRSchedule, run_epochs, set_lr
from .schedules.settings import SettingSchedule
from .step.train_step import TrainStep
from .distributed.preemption import TrainingInterrupted
from .schedules.triggers import StepTriggers

__all__ = ["Run"]


def _memory_mb(device: torch.device) -> Dict[str, float]:
    if device.type == "cuda":
        return {"reserved_memory_mb": torch.cuda.memory_reserved(device) / 2**20,
                "peak_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20}
    # CPU: the process's peak resident set size (ru_maxrss is in KiB on Linux).
    return {"peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}



@dataclass
class Run:
    """One training run (one process of it). Built by ``Trainer._setup``."""

    p: TrainingParams
    ctx: DistContext
    device: torch.device
    model: nn.Module  # the plain module on the device (what checkpoints store)
    train_step: TrainStep
    eval_model: nn.Module  # the EMA module or the model, compiled with torch_compile
    opt: torch.optim.Optimizer
    fused: bool
    scaler: Any
    precision: Precision
    ema: Any
    loss_fn: Optional[Callable[..., Any]]  # None: the model computes its own loss
    schedule: LRSchedule
    steps_per_epoch: int
    train_loader: Any
    valid_loaders: Dict[str, Any]  # name -> loader; the name "" for a single loader
    test_loaders: Dict[str, Any]
    train_metrics: MetricSet
    valid_metrics: Dict[str, MetricSet]
    callbacks: CallbackList
    state: TrainerState  # the run's progress (epoch, step, best, ...), read by callbacks
    checkpoints: CheckpointManager
    position: EpochPosition  # this rank's place in the epoch (mid-epoch checkpoints and resumes)
    logger: Any
    watch_key: str  # the row key of metric_to_watch
    run_dir: str
    triggers: StepTriggers  # validation, checkpoints and a graceful stop inside epochs
    step_log: Any  # StepLog: per-step scalars to training_params.loggers
    split_fn: Optional[Callable[[Any], Any]] = None
    model_input: Any = "auto"
    start_epoch: int = 0
    frozen_bn: List[nn.Module] = field(default_factory=list)  # kept in eval mode (freeze_bn_stats)
    sums: Optional[LossSums] = None
    settings: Optional[SettingSchedule] = None  # momentum_schedule / weight_decay_schedule
    skipped_seen: float = 0.0  # the skipped-step count at the end of the previous epoch (NOTE [divergence])

    @property
    def batch_rules(self) -> Dict[str, Any]:
        return batch_rules(self.p)

    def __post_init__(self) -> None:
        self.sums = LossSums(self.device)
        self.start_epoch = self.state.epoch

    # ---- the loop ------------------------------------------------------------------------------------------

    def loop(self) -> Dict[str, Any]:
        state, cbs = self.state, self.callbacks
        # A resumed run that has nothing left to do reports the checkpoint's last epoch.
        last: Dict[str, Any] = dict(self.logger.rows[-1]) if self.logger.rows else {}
        test: Dict[str, float] = {}
        completed = False
        report, t_start = RunReport(self), time.perf_counter()
        if self.ctx.is_main:
            print("\n".join(report.header()), flush=True)
        cbs("on_train_start", state)
        try:
            with self.triggers.stop:  # NOTE [graceful stop]
                last = self.epochs(last)
            completed = True
        finally:
            write_error: Optional[BaseException] = None
            try:
                self.checkpoints.close()  # NOTE [asynchronous checkpoints]
            except Exception as e:
                write_error = e
            if self.ema is not None:
                self.ema.detach()
            self.logger.plot_in_background()  # NOTE [metrics plot]
            self.logger.close()
            self.step_log.close()
            cbs("on_train_end", state)
            if write_error is not None:
                if completed:
                    raise write_error
                warn(f"a checkpoint written in the background failed as well: {write_error!r}")
        if completed and self.test_loaders:
            test = after_training.run_tests(self)
        result = {"final": last, "best": state.best, "test": test, "run_dir": self.run_dir,
                  "experiment_dir": os.path.dirname(self.run_dir)}
        if completed and self.p.average_best_models and self.ctx.is_main:
            result["average_model"] = after_training.validate_average(self)
        if completed and self.ctx.is_main:
            print("\n".join(report.summary(last, time.perf_counter() - t_start)), flush=True)
        return result

    def epochs(self, last: Dict[str, Any]) -> Dict[str, Any]:
        """The epochs from ``start_epoch``; returns the last epoch's row."""
        p, ctx, state, cbs = self.p, self.ctx, self.state, self.callbacks
        n_epochs = run_epochs(p, self.steps_per_epoch)
        # With max_steps the epochs go on until the step count is reached (a loader without a length may
        # give fewer steps per epoch than counted).
        epochs = itertools.count(self.start_epoch) if p.max_steps else range(self.start_epoch, n_epochs)
        for epoch in epochs:
            if self.steps_done():
                break
            state.epoch = epoch
            if ctx.enabled:  # per rank and epoch, so a resumed run re-derives it
                _dist.seed_everything(_dist.epoch_seed(p.seed, ctx.rank, epoch))
            set_epoch(self.train_loader, epoch)
            cbs("on_epoch_start", state)
            row = self.train_epoch(epoch)
            ema = self.ema
            ctx.broadcast_buffers([self.model, ema.module if ema is not None else None],
                                  ema.buffer_remainders() if ema is not None else ())
            if (epoch + 1) % p.run_validation_freq == 0 or epoch + 1 == n_epochs or self.steps_done():
                self.validate(row)
                self.schedule.observe(row.get(self.watch_key), p.greater_metric_to_watch_is_better)
            row.update(_memory_mb(self.device))
            cbs("on_epoch_end", state)
            self.end_epoch(epoch, row)
            last = row
            if self.triggers.stop_at_epoch_end():
                raise self.interrupted()
            stop = self.stop_message(epoch)
            if stop:
                if ctx.is_main:
                    print(stop, flush=True)
                break
        return last

    def interrupted(self) -> TrainingInterrupted:
        """The error of a stop by a signal, its checkpoint written; under Slurm with auto_requeue rank 0
        requeues the job first (NOTE [preemption])."""
        if self.p.auto_requeue and self.ctx.is_main and preemption.requeues(self.triggers.stop.signal):
            preemption.requeue()
        return TrainingInterrupted(
            f"training stopped on {self.triggers.stop.signal} after optimizer step {self.state.global_step}; "
            f"{self.checkpoints.latest_path} continues it with resume=True (or the same command with resume: "
            f"auto); exit status {TrainingInterrupted.exit_status} says so")

    def steps_done(self) -> bool:
        return bool(self.p.max_steps) and self.state.global_step >= self.p.max_steps

    def stop_message(self, epoch: int) -> str:
        p, state = self.p, self.state
        if p.early_stopping and state.stale_epochs >= p.early_stopping["patience"]:
            return (f"Early stopping after epoch {epoch + 1}: no improvement of {p.metric_to_watch} for "
                    f"{state.stale_epochs} validation(s)")
        return f"Stopping after epoch {epoch + 1}: {state.stop_reason}" if state.stop_training else ""

    # ---- one epoch of training -----------------------------------------------------------------------------

    def train_epoch(self, epoch: int) -> Dict[str, Any]:
        p, train_step, state, cbs, sums = self.p, self.train_step, self.state, self.callbacks, self.sums
        batch_hooks, step_hooks = cbs.has("on_train_batch_end"), cbs.has("on_step_end")
        self.train_mode()
        self.train_metrics.reset()
        sums.reset()
        loader = self.train_loader
        has_len = (n_batches := preflight.loader_length(loader)) is not None
        if p.max_train_batches:
            n_batches = min(n_batches or p.max_train_batches, p.max_train_batches)
        batch_iter, batches, resumed_samples = self.position.begin(state.global_step, sums, self.train_metrics)
        step0, samples, first_batch = self.position.step0, resumed_samples, 0
        progress = Progress(p.progress_bar and self.ctx.is_main, n_batches or 0,
                            f"epoch {epoch + 1}/{run_epochs(p, self.steps_per_epoch)}")
        t0 = time.perf_counter()
        warmup_time = None
        for i, batch in enumerate(batch_iter, batches):
            if p.max_train_batches and i >= p.max_train_batches:
                break
            batch = to_device(batch, self.device)
            x, y, extras = split_batch(batch, self.split_fn)
            batches += 1
            # Once per session, with a cross-entropy loss: one read of the targets' range.
            first = warmup_time is None and epoch == self.start_epoch and preflight.class_loss(p)
            # The step (channels_last conversion, forward, loss, backward and, on
            # the last micro-batch of a group, the optimizer tail: TrainStep).
            last_micro = n_batches is not None and i + 1 == n_batches
            do_step = train_step.will_step(last_micro)
            if do_step:
                set_lr(self.opt, self.schedule(state.global_step))
                if self.settings is not None:
                    self.settings.apply(self.opt, state.global_step)
            rng = preflight.target_range(y) if first else None
            try:
                with self.ctx.grad_sync(train_step.model, do_step):  # DDP: all-reduce only on the stepping batch
                    out_d, loss_d = train_step(x, y, last=last_micro)
            except Exception as e:
                if not self.ctx.fsdp:  # its forward would be a collective the other ranks never join
                    self.explain_failure(e, x, y, rng)
                raise
            if first:
                cause = preflight.targets_out_of_range(out_d, y, rng, p.loss_params.get("ignore_index", -100))
                if cause:
                    raise ValueError(f"Trainer.train: {cause}")
            if do_step:
                state.global_step += 1
                self.log_step(loss_d)
            n = count_samples(x, self.model_input)
            sums.add(loss_d, train_step.components, n)
            self.train_metrics.update(out_d, y, loss_d)
            samples += n
            if batch_hooks or step_hooks:
                state.batch_idx, state.batch = i, (x, y, extras)
                state.outputs, state.loss, state.loss_components = out_d, loss_d, train_step.components
                cbs("on_train_batch_end", state)
                if do_step:
                    cbs("on_step_end", state)
            if warmup_time is None:
                warmup_time = time.perf_counter() - t0
                t_steady = time.perf_counter()
                first_batch = n
                progress.first_step_done()
                if (p.torch_compile or p.compile_step != "off") and epoch == self.start_epoch and self.ctx.is_main:
                    progress.note(f"first step: {warmup_time:.1f} s (compiling; the next steps run the compiled "
                                  f"code)")
            elif p.log_interval and progress.bar is not None and (i + 1) % p.log_interval == 0:
                # One host read per log interval, not per step.
                progress.update(loss=f"{self.interval_read(samples):.4f}")
            else:
                progress.update()
                progress.running_loss(sums.loss, samples)  # NOTE [loss in the progress bar]
            if do_step and self.steps_done():  # max_steps: the run ends at this step
                break
            if do_step and not last_micro:
                self.between_steps(epoch, i + 1, samples)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        steady = time.perf_counter() - t_steady if warmup_time is not None else 0.0
        world = self.ctx.world_size
        # first_batch also leaves out the samples trained on before a mid-epoch resume (from the throughput).
        first_batch = world * first_batch + world * resumed_samples
        samples = int(self.ctx.sum_(sums.tensors() + self.train_metrics.state_tensors(), [samples])[0])
        if samples == 0:
            raise ValueError(f"Trainer.train: the train loader yielded no batches in epoch {epoch + 1}; it must "
                             f"yield at least one per epoch")
        if not has_len and batches < n_batches:
            warn(f"the train loader (no length) ended after {batches} batches, before max_train_batches="
                 f"{n_batches}, which the lr schedule and the EMA count as one epoch; set max_train_batches "
                 f"to the batches of an epoch")
        row: Dict[str, Any] = {"epoch": epoch + 1}
        row.update(prefixed("train", "", sums.means(samples)))
        progress.close(row.get("train_loss"))
        row.update({k: v for k, v in prefixed("train", "", self.train_metrics.compute()).items() if k not in row})
        row["lr"] = self.schedule(max(0, state.global_step - 1))
        row["epoch_time_s"] = elapsed
        row["warmup_time_s"] = warmup_time or 0.0
        row["samples_per_s"] = (samples - first_batch) / steady if steady > 0 else 0.0
        stalled = self.opt.stalled_updates if self.fused else None
        if stalled is not None:  # NOTE [stalled updates]: counted on the device, read once an epoch
            row["stalled_updates"] = int(stalled.item())
            stalled.zero_()
        if self.scaler.is_enabled() and self.scaler.skipped_steps is not None:
            row["skipped_steps"] = state.skipped_steps()
            row["loss_scale"] = self.scaler.get_scale()
            self.check_divergence(epoch, row, state.global_step - step0)
        state.metrics = row
        cbs("on_train_epoch_end", state)
        return row

    def train_mode(self) -> None:
        self.model.train()
        for m in self.frozen_bn:  # freeze_bn_stats: pretrained running statistics stay
            m.eval()

    def log_step(self, loss: torch.Tensor) -> None:
        """The step's scalars into the step log (device copies; NOTE [step log without syncs])."""
        if not self.step_log.loggers:
            return
        scale = self.scaler.get_scale_tensor() if self.scaler.is_enabled() else None
        norm = self.opt.last_grad_norm if self.fused else None
        step = self.state.global_step - 1
        self.step_log.record(step, self.schedule(step), loss, scale, norm)

    def interval_read(self, samples: int) -> float:
        """The running loss (for the progress bar), read with the loss scale at
        no extra sync: a scale at its floor is reported at once."""
        scale = self.scaler.get_scale_tensor() if self.scaler.is_enabled() else None
        if scale is None:
            return self.sums.loss.item() / samples
        loss, scale_v = torch.stack([self.sums.loss, scale.double()]).tolist()
        if scale_v <= SCALE_FLOOR and not self.state.stop_training:
            warn(f"the run diverged at step {self.state.global_step}: the loss scale is at its floor "
                 f"2**-126 (every recent step had non-finite gradients); training stops at the end of this "
                 f"epoch", RuntimeWarning)
            self.state.request_stop("the run diverged (loss scale at its floor)")
        return loss / samples

    def check_divergence(self, epoch: int, row: Dict[str, Any], steps: int) -> None:
        """NOTE [divergence]: read from the epoch's row (no extra sync). A scale
        at its floor means every recent step had non-finite gradients: the run
        stops, saying so. A fully skipped epoch above the floor only warns (the
        scale may still be settling)."""
        skipped = row["skipped_steps"] - self.skipped_seen
        self.skipped_seen = row["skipped_steps"]
        if row["loss_scale"] <= SCALE_FLOOR:
            msg = (f"the run diverged: the loss scale reached its floor 2**-126 in epoch {epoch + 1} ({skipped:.0f} of "
                   f"its {steps} steps skipped for non-finite gradients; a skipped step leaves the weights as they "
                   f"were); stopping. Lower initial_lr, set clip_grad_norm or check the data for inf/NaN, and start "
                   f"again from an earlier checkpoint")
            warn(msg, RuntimeWarning)
            self.state.request_stop(msg)
        elif steps and skipped >= steps:
            warn(f"every optimizer step of epoch {epoch + 1} ({steps}) was skipped for non-finite gradients; "
                 f"the optimizer did not change the weights in this epoch (loss scale now "
                 f"{row['loss_scale']:g})", RuntimeWarning)

    def explain_failure(self, exc: Exception, x, y, rng) -> None:
        """Raise a ValueError naming the cause of a failed step when it is a usual one."""
        def forward(inputs):
            with self.precision.autocast():
                return call_model(self.model, inputs, self.model_input)

        rng = rng if rng is not None else preflight.target_range(y)
        cause = preflight.explain_batch_error(self.model, x, y, rng, self.p.loss_params.get("ignore_index", -100),
                                              forward)
        if cause:
            raise ValueError(f"Trainer.train: the training step failed: {cause}") from exc

    # ---- validation, the epoch's end -----------------------------------------------------------------------

    def validate(self, row: Dict[str, Any], model: Optional[nn.Module] = None) -> None:
        for name, loader in self.valid_loaders.items():
            res = evaluate(model or self.eval_model, loader, self.loss_fn, self.precision, self.valid_metrics[name],
                           self.device, max_batches=self.p.max_valid_batches, ctx=self.ctx, **self.batch_rules,
                           what=f"valid_loader[{name!r}]" if name else "valid_loader")
            row.update(prefixed("valid", name, res))
            if model is None:
                self.callbacks("on_validation_end", self.state, name, res)

    def end_epoch(self, epoch: int, row: Dict[str, Any]) -> None:
        """Best metric and early-stopping count, the epoch's log line and files, checkpoints."""
        improved = self.update_best(row, epoch)
        state = self.state
        state.stale_epochs = 0 if improved else state.stale_epochs + (1 if self.watch_key in row else 0)
        self.logger.log_epoch(row)
        self.step_log.flush()
        if self.p.average_best_models and self.ctx.is_main and self.watch_key in row:  # NOTE [average of the best
            # models]
            self.checkpoints.offer_best_model(epoch + 1, row[self.watch_key], self.watched_weights())
        epoch_file = epoch + 1 if epoch + 1 in self.p.save_ckpt_epoch_list else None
        self.checkpoints.save(epoch + 1, state.global_step, best=improved, epoch_file=epoch_file,
                              saved=self.saved_hook())
        if self.ctx.is_main:
            files = ["ckpt_latest.pth"] + ["ckpt_best.pth"] * improved + [f"ckpt_epoch_{epoch_file}.pth"] * bool(
                epoch_file)
            print(RunReport(self).epoch_line(row, run_epochs(self.p, self.steps_per_epoch), improved, files),
                  flush=True)
        self.triggers.checkpoint_written()
        self.ctx.barrier()

    def watched_weights(self) -> Dict[str, Any]:
        """The state dict of the weights that are validated (the EMA's with ``ema``)."""
        return unwrap_model(self.ema.module if self.ema is not None else self.model).state_dict()

    def saved_hook(self):
        """The ``on_checkpoint_saved`` call of a checkpoint queued now, with the run's progress as it is now (the
        files may be written in the background: NOTE [asynchronous checkpoints])."""
        if not self.callbacks.has("on_checkpoint_saved"):
            return None
        progress = copy.copy(self.state)
        progress.best, progress.metrics = copy.copy(self.state.best), copy.copy(self.state.metrics)
        return lambda path: self.callbacks("on_checkpoint_saved", progress, path)

    def update_best(self, row: Dict[str, Any], epoch: int, step: Optional[int] = None) -> bool:
        p, best, key = self.p, self.state.best, self.watch_key
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

    # ---- between two steps of an epoch ---------------------------------------------------------------------

    def between_steps(self, epoch: int, batches: int, samples: int) -> None:
        """Validation, a checkpoint and a graceful stop after an optimizer step
        inside an epoch, when ``valid_every_n_steps``, ``ckpt_every_n_steps``,
        ``ckpt_every_minutes`` or a signal ask for them (host tests only)."""
        validate, checkpoint, stop = self.triggers.after_step(self.state.global_step)
        improved = self.validate_at_step(epoch) if validate else False
        if checkpoint or improved:
            position = {"epoch": epoch, "batches": batches, "step0": self.position.step0,
                        "skipped_seen": self.skipped_seen,
                        "rank": self.position.here(batches, samples, self.sums, self.train_metrics)}
            self.checkpoints.save(epoch, self.state.global_step, latest=checkpoint, best=improved,
                                  position=position, saved=self.saved_hook())
            if checkpoint:
                self.triggers.checkpoint_written()
            self.ctx.barrier()
        if stop:
            raise self.interrupted()

    def validate_at_step(self, epoch: int) -> bool:
        """``valid_every_n_steps``: validate, report at the step; returns whether the watched metric improved."""
        step = self.state.global_step - 1  # the index of the step just taken, as in the step log
        row: Dict[str, Any] = {"epoch": epoch + 1, "step": step}
        self.validate(row)
        self.train_mode()
        improved = self.update_best(row, epoch, step=self.state.global_step)
        values = {k: v for k, v in row.items() if k.startswith("valid_")}
        self.step_log.write(step, values)
        if self.ctx.is_main:
            print(f"step {self.state.global_step} | " + "  ".join(f"{k} {v:.4f}" for k, v in values.items())
                  + (" (best)" if improved else ""), flush=True)
            self.logger.log_step_validation(row)
        return improved
