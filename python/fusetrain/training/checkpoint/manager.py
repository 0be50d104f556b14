"""The one owner of a run's checkpoints: what a checkpoint holds, where and
when its files are written, how a resume restores it, the position inside an
epoch, and the average of the best models.

The helpers it drives: :mod:`.checkpoints` (atomic writes, reading as data),
:mod:`.sharded_checkpoints` (``multi_gpu: fsdp``), :mod:`.resume` (what a
resume takes from the checkpoint and what from the new training_params),
:mod:`.position` (random states and the iterator that continues an epoch)
and :mod:`.model_average`. The Trainer calls only this class.

NOTE [checkpoint schema]: a checkpoint file is a dict of data (NOTE
[checkpoints are data]): ``model`` and ``optimizer`` (state dicts; None when
``shards`` names the folder of a sharded run's tensors), ``scaler``,
``ema`` (None without ``ema``; in a sharded run without its ``module`` and
``remainders``, which are in the shards, and with ``sharded_remainders``,
the names of the remainders saved there), ``epoch`` (epochs done), ``global_step``
(optimizer steps done), ``best`` (``{"metric", "value", "epoch"[,
"step"]}``), ``stale_epochs``, ``rng`` (this process's random states),
``training_params`` (JSON-safe), ``world_size``, ``data_order`` (NOTE
[resume on another process count]), ``skipped_steps``, ``schedule``; a
mid-epoch checkpoint adds ``position`` (NOTE [mid-epoch resume]); with
``average_best_models``, ``averaging`` lists the epochs and values of the
models averaged so far.

NOTE [asynchronous checkpoints]: with ``async_checkpoints`` a checkpoint's
state is copied to host memory (the snapshot, queued by the training thread:
later steps cannot change it; NOTE [pinned snapshot]), and its files are
written, linked and pruned by one background thread, each file still
atomically. The next checkpoint, the end of the run (also a failed or
interrupted one: ``close``) wait for the write in flight; its
``on_checkpoint_saved`` callbacks then run on the training thread with the
progress of the step it saved, and a failed write raises there. At most one write is in flight, so host memory holds at most one
extra copy of a checkpoint. A sharded run (``multi_gpu: fsdp``) writes in
the foreground: each checkpoint file prunes the shard folders it does not
name, which must not overlap the next save's shards.
"""

from __future__ import annotations

import copy
import os
import re
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ...ema import unwrap_model
from . import resume_plan as elastic_resume
from . import resume
from . import sharded as sharded_checkpoints
from ..task.callbacks import CallbackList, TrainerState
from .files import atomic_copy, atomic_save, load_checkpoint
from .average import BestModels
from ..params import TrainingParams
from .position import resume_iterator, rng_state, set_rng_state

__all__ = ["CheckpointManager", "LATEST", "BEST", "AVERAGE", "AVERAGE_SNAPSHOTS"]

LATEST, BEST = "ckpt_latest.pth", "ckpt_best.pth"
AVERAGE, AVERAGE_SNAPSHOTS = "average_model.pth", "average_model_snapshots.pth"
_STEP_FILE = re.compile(r"ckpt_step_(\d+)\.pth")
#: The background writer's thread name: this, the experiment's folder name, "_0" (async_checkpoints).
WRITER_THREAD = "fusetrain-checkpoint:"


class HostSnapshot:
    """NOTE [pinned snapshot]: the host copy of an asynchronous checkpoint. A
    dense CUDA tensor goes to a page-locked buffer kept for the same place of
    the next checkpoint, by a copy queued on its device's current stream: the
    training thread does not wait for it (a copy to pageable memory waits for
    the GPU and runs at a fraction of the bus's speed), and the next steps'
    kernels, queued behind it, cannot change what it reads. ``ready()`` (on
    the writer thread) waits for the copies before the state is written. The
    buffers are reused only after the write that read them (one write in
    flight, NOTE [asynchronous checkpoints]). Other tensors are copied
    synchronously."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[Any, ...], torch.Tensor] = {}
        self._events: List[Any] = []

    def take(self, obj: Any) -> Any:
        """``obj`` with its tensors copied (or being copied) to host memory."""
        buffers, self._buffers = self._buffers, {}
        devices: Dict[torch.device, None] = {}
        out = self._copy(obj, (), buffers, devices)
        self._events = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events.append(event)
        return out

    def ready(self) -> None:
        """Wait until the last ``take``'s copies have landed."""
        for event in self._events:
            event.synchronize()

    def _copy(self, obj: Any, key: Tuple[Any, ...], buffers: Dict[Tuple[Any, ...], torch.Tensor],
              devices: Dict[torch.device, None]) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if not (t.is_cuda and t.layout == torch.strided and type(t) in (torch.Tensor, nn.Parameter)):
                return t.to("cpu", copy=True)
            buf = buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._buffers[key] = buf
            devices[t.device] = None
            return buf.copy_(t, non_blocking=True)
        if isinstance(obj, dict):
            out = obj.copy()  # keeps OrderedDict and the like
            for k, v in obj.items():
                out[k] = self._copy(v, key + (k,), buffers, devices)
            return out
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, key + (i,), buffers, devices) for i, v in enumerate(obj)]
            if isinstance(obj, list):
                return items
            return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
        return obj


def _progress_of(state: TrainerState) -> TrainerState:
    """A copy of ``state`` whose progress (step, epoch, best, metrics) stays as it is now."""
    out = copy.copy(state)
    out.best = copy.copy(state.best)
    out.metrics = copy.copy(state.metrics)
    return out


class CheckpointManager:
    """Writes and restores the checkpoints of one run (one process of it; rank 0 writes the files)."""

    def __init__(self, experiment_dir: str, p: TrainingParams, ctx: Any, state: TrainerState, model: nn.Module,
                 opt: torch.optim.Optimizer, scaler: Any, ema: Any, schedule: Any, train_loader: Any,
                 callbacks: CallbackList) -> None:
        self.dir, self.p, self.ctx, self.state = experiment_dir, p, ctx, state
        self.model, self.opt, self.scaler, self.ema = model, opt, scaler, ema
        self.schedule, self.train_loader, self.callbacks = schedule, train_loader, callbacks
        self.skipped_before = 0.0  # steps the loss scaler skipped in earlier sessions of a resumed run
        self.skipped_seen = 0.0  # the skipped-step count at the end of the previous epoch (host value)
        self.position: Optional[Dict[str, Any]] = None  # this rank's part of a resumed mid-epoch position
        self._writer: Optional[ThreadPoolExecutor] = None  # NOTE [asynchronous checkpoints]
        self._pending: Optional[Tuple[Future, TrainerState]] = None  # the write in flight, the state it saved
        self._host = HostSnapshot()  # NOTE [pinned snapshot]
        self.epoch_start: Dict[str, Any] = {}  # the epoch's random states before its iterator, its first step
        self.best_models = (BestModels(p.number_of_models_to_average, p.greater_metric_to_watch_is_better)
                            if p.average_best_models and ctx.is_main else None)

    @property
    def latest_path(self) -> str:
        return os.path.join(self.dir, LATEST)

    # ---- reading ---------------------------------------------------------------------------------------------

    @staticmethod
    def resume_file(experiment_dir: str, p: TrainingParams) -> Optional[str]:
        """The checkpoint a resume reads (checked to exist), or None for a fresh run (``resume: auto`` without
        a checkpoint, too)."""
        if not (p.resume or p.resume_path):
            return None
        path = p.resume_path or os.path.join(experiment_dir, LATEST)
        if p.resume == "auto" and not os.path.isfile(path):
            return None
        if not os.path.isfile(path):
            raise FileNotFoundError(f"training_params.resume: no checkpoint at {path}")
        return path

    @staticmethod
    def read(path: str, p: TrainingParams) -> Dict[str, Any]:
        """The checkpoint to resume from, read as data unless ``resume_trusted`` (before anything is written)."""
        return load_checkpoint(path, trusted=p.resume_trusted, trust="training_params.resume_trusted: true")

    @staticmethod
    def load_final_weights(experiment_dir: str, model: nn.Module) -> None:
        """The weights of the run's last checkpoint (sharded or not) into ``model``, if there is one."""
        path = os.path.join(experiment_dir, LATEST)
        if os.path.isfile(path):
            unwrap_model(model).load_state_dict(sharded_checkpoints.full_state_dict(path))

    # ---- restore ---------------------------------------------------------------------------------------------

    def restore(self, ck: Dict[str, Any], path: str, kept: Tuple[str, ...] = ()) -> None:
        """Load a checkpoint into the freshly built run (NOTE [resume hyperparameters]), its progress into the
        state, and this rank's mid-epoch position (``kept``: keys set to keep the global batch)."""
        self.schedule.load_state_dict(ck.get("schedule"))
        resume.check_changes(ck.get("training_params"), self.p, path, kept)
        # The fresh param groups' settings (lr_scale, the lr tensors of NOTE [lr tensor]) are re-applied.
        resume.restore(ck, path, self.model, self.opt, self.scaler, self.ema)
        st = self.state
        st.epoch, st.global_step = int(ck["epoch"]), int(ck["global_step"])
        st.best = ck.get("best", st.best)
        st.stale_epochs = int(ck.get("stale_epochs", 0))
        self.skipped_before = float(ck.get("skipped_steps", 0.0))
        set_rng_state(ck["rng"], self.train_loader)
        self.position = elastic_resume.rank_position(ck, self.ctx, path, getattr(self.train_loader, "batch_size",
                                                                                 None))
        self.skipped_seen = self.position["skipped_seen"] if self.position else self.skipped_before
        if self.best_models is not None:
            self._restore_best_models(ck.get("averaging"))

    def _restore_best_models(self, listed: Optional[List[Dict[str, Any]]]) -> None:
        path = os.path.join(self.dir, AVERAGE_SNAPSHOTS)
        saved = load_checkpoint(path) if listed and os.path.isfile(path) else {}
        missing = self.best_models.load_state_dict(saved, listed)
        if missing:
            warnings.warn(f"average_best_models: {path} lacks the models of epoch(s) {missing} that the checkpoint "
                          f"lists; the average goes on without them", stacklevel=5)

    # ---- the position inside an epoch -----------------------------------------------------------------------

    def begin_epoch(self, loader: Any, sums: Any, train_metrics: Any) -> Tuple[Any, int, int]:
        """The epoch's batch iterator, batches and samples already trained on (NOTE [mid-epoch resume]): the
        random states before the iterator is made go into mid-epoch checkpoints; a resume into this epoch makes
        the iterator from them and continues after its position."""
        at, self.position = self.position, None
        if at is not None and at["rng_start"] is not None:  # None: another number of processes (their states
            set_rng_state(at["rng_start"], loader)           # belong to the old ranks' shards)
        self.epoch_start = {"rng_start": rng_state(loader), "step0": self.state.global_step}
        if at is None:
            return loader, 0, 0
        batch_iter = resume_iterator(loader, at["batches"], self.p.resume_skip)
        self.epoch_start["step0"] = at["step0"]
        if at["sums"] is not None:  # on another number of processes, rank 0 holds the old ranks' sums
            sums.load_state_dict(at["sums"])
            train_metrics.load_state_dict(at["train_metrics"])
        if at["rng"] is not None:
            set_rng_state(at["rng"], loader)
        return batch_iter, at["batches"], at["samples"]

    # ---- writing ---------------------------------------------------------------------------------------------

    def save_epoch_end(self, epoch: int, improved: bool, row: Dict[str, Any], watch_key: str) -> None:
        """After epoch ``epoch`` (0-based): ``ckpt_latest.pth``, ``ckpt_best.pth`` when the watched metric
        improved, the epoch's file of ``save_ckpt_epoch_list``, the average of the best models."""
        shards = self._save_shards()
        if self.ctx.is_main:  # logs and checkpoints on rank 0; the others wait at the barrier
            if self.best_models is not None and watch_key in row:
                self._offer_best_model(epoch + 1, row[watch_key])
            self._write(self.state_dict(epoch + 1, shards), latest=True, best=improved,
                        epoch_file=epoch + 1 if epoch + 1 in self.p.save_ckpt_epoch_list else None)

    def save_mid_epoch(self, epoch: int, batches: int, samples: int, sums: Any, train_metrics: Any,
                       latest: bool, best: bool) -> None:
        """A checkpoint with the position in the epoch (NOTE [mid-epoch resume]); every rank sends its part."""
        mine = {"rng_start": self.epoch_start["rng_start"], "rng": rng_state(self.train_loader),
                "sums": sums.state_dict(), "train_metrics": train_metrics.state_dict(), "samples": samples}
        ranks = self.ctx.gather_object(mine)
        shards = self._save_shards()
        if self.ctx.is_main:
            state = self.state_dict(epoch, shards)
            state["position"] = {"epoch": epoch, "batches": batches, "step0": self.epoch_start["step0"],
                                 "skipped_seen": self.skipped_seen, "ranks": ranks}
            self._write(state, latest=latest, best=best)

    def _save_shards(self) -> Optional[str]:
        """fsdp: every rank writes its shards (NOTE [sharded checkpoints]); returns their folder's name."""
        if not self.ctx.fsdp:
            return None
        name = sharded_checkpoints.new_name(self.state.global_step)
        sharded_checkpoints.save(self.dir, name, self.model, self.opt,
                                 self.ema.module if self.ema is not None else None,
                                 self.ema.remainder_tensors() if self.ema is not None else None)
        return name

    def skipped_steps(self) -> float:
        """Steps skipped by the loss scaler over the whole run (one host read)."""
        scaler = self.scaler
        skipped = (float(scaler.skipped_steps.item()) if scaler.is_enabled() and scaler.skipped_steps is not None
                   else 0.0)
        return self.skipped_before + skipped

    def state_dict(self, epoch: int, shards: Optional[str] = None) -> Dict[str, Any]:
        """The checkpoint's contents (NOTE [checkpoint schema]); with ``shards`` the tensors that are sharded
        live in that folder."""
        ema_state = self.ema.state_dict() if self.ema is not None else None
        if shards is not None and ema_state is not None:  # in the shards; the file names the remainders there
            del ema_state["module"]
            ema_state["sharded_remainders"] = sorted(ema_state.pop("remainders"))
        st = self.state
        out = {"model": unwrap_model(self.model).state_dict() if shards is None else None,
               "optimizer": self.opt.state_dict() if shards is None else None, "shards": shards,
               "scaler": self.scaler.state_dict(), "ema": ema_state,
               "epoch": epoch, "global_step": st.global_step, "best": dict(st.best),
               "stale_epochs": st.stale_epochs, "rng": rng_state(self.train_loader),
               "training_params": self.p.to_dict(json_safe=True), "world_size": self.ctx.world_size,
               "data_order": elastic_resume.data_order_record(self.train_loader, self.p, self.ctx.world_size),
               "skipped_steps": self.skipped_steps(), "schedule": self.schedule.state_dict()}
        if self.best_models is not None:
            out["averaging"] = self.best_models.summary()
        return out

    def _write(self, state: Dict[str, Any], latest: bool, best: bool, epoch_file: Optional[int] = None) -> None:
        """Write ``state`` (atomically) as ``ckpt_latest.pth`` and/or ``ckpt_best.pth``, the epoch's file of
        ``save_ckpt_epoch_list`` and, with ``keep_last_ckpts``, ``ckpt_step_<N>.pth`` (the files after the first
        are links to it, or copies where the file system has no links). With ``async_checkpoints`` the files are
        written in the background (NOTE [asynchronous checkpoints])."""
        keep = self.p.keep_last_ckpts
        names = ([LATEST] if latest else []) + ([BEST] if best else [])
        names += [f"ckpt_epoch_{epoch_file}.pth"] if epoch_file is not None else []
        names += [f"ckpt_step_{self.state.global_step}.pth"] if latest and keep else []
        paths = [os.path.join(self.dir, n) for n in names]
        prune = bool(latest and keep)
        if not self.p.async_checkpoints or self.ctx.fsdp:  # sharded: written with the shards, in the foreground
            self._write_files(state, paths, prune, lambda path: self.callbacks("on_checkpoint_saved", self.state,
                                                                                path))
            return
        self.wait()
        snapshot = self._host.take(state)
        if self._writer is None:
            name = WRITER_THREAD + os.path.basename(self.dir)
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending = (self._writer.submit(self._write_files, snapshot, paths, prune, None, self._host.ready),
                         _progress_of(self.state))

    def _write_files(self, state: Dict[str, Any], paths: List[str], prune: bool,
                     saved: Optional[Callable[[str], None]], ready: Callable[[], None] = lambda: None) -> List[str]:
        """The files of one checkpoint, in order, once ``ready()`` returns; ``saved(path)`` after each. Returns
        the paths written."""
        ready()
        for k, path in enumerate(paths):
            if k == 0:
                atomic_save(state, path)
            else:
                atomic_copy(paths[0], path)
            if saved is not None:
                saved(path)
        if prune:
            found = sorted((int(m.group(1)), n) for n in os.listdir(self.dir) if (m := _STEP_FILE.fullmatch(n)))
            for _, name in found[:-self.p.keep_last_ckpts]:
                os.remove(os.path.join(self.dir, name))
        sharded_checkpoints.collect_garbage(self.dir)  # also after a sharded run resumed unsharded
        return paths

    def wait(self) -> None:
        """Wait for the checkpoint written in the background (``async_checkpoints``), then run its
        ``on_checkpoint_saved`` callbacks here; a failed write raises its error."""
        if self._pending is None:
            return
        future, state = self._pending
        self._pending = None
        for path in future.result():
            self.callbacks("on_checkpoint_saved", state, path)

    def close(self) -> None:
        """The end of the run: wait for a checkpoint in flight and stop the writer thread."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None

    # ---- the average of the best models ----------------------------------------------------------------------

    def _offer_best_model(self, epoch: int, value: float) -> None:
        """NOTE [average of the best models]: the watched weights join the k best if they are among them; then
        ``average_model.pth`` is written (after each epoch-end validation, as the kept models stand)."""
        weights = self.ema.module if self.ema is not None else self.model
        if self.best_models.offer(epoch, value, unwrap_model(weights).state_dict()):
            atomic_save(self.best_models.state_dict(), os.path.join(self.dir, AVERAGE_SNAPSHOTS))
        if self.best_models.kept:
            atomic_save({"model": self.best_models.average(), "averaged": self.best_models.summary(),
                         "metric": self.p.metric_to_watch, "epoch": epoch}, os.path.join(self.dir, AVERAGE))

    def average_model(self) -> Optional[Dict[str, torch.Tensor]]:
        """The current average of the best models (rank 0 with ``average_best_models``), or None."""
        if self.best_models is None or not self.best_models.kept:
            return None
        return self.best_models.average()
