"""The one owner of a run's checkpoints: :class:`CheckpointManager`.

It owns the checkpoint's schema (NOTE [checkpoint schema]), its writing
(atomic files, links, pruning, in the background, a sharded run's tensors
through ``torch.distributed.checkpoint``), its reading (as data, older
versions converted) and the resume decision (:meth:`CheckpointManager.plan`).
What it saves comes from components that take part through torch's
``Stateful`` protocol: each is registered under a name
(:meth:`~CheckpointManager.register`) and gives ``state_dict()`` /
``load_state_dict()``; the manager never looks inside them. It records
itself what says where the run is: the epoch and optimizer step at which a
checkpoint is written, the data order, the position inside an epoch, the
process count and the training_params.

NOTE [asynchronous checkpoints]: with ``async_checkpoints`` (the default) a
checkpoint's state is copied to host memory (the snapshot, queued by the
training thread: later steps cannot change it; NOTE [pinned snapshot]), and
its files are written, linked and pruned by one background thread, each
file still atomically. The next checkpoint and the end of the run (also a
failed or interrupted one: ``close``) wait for the write in flight; its
``saved`` callback then runs on the training thread, and a failed write
raises there. At most one write is in flight, so host memory holds at most
one extra copy of a checkpoint. A sharded run (``multi_gpu: fsdp``) writes
in the foreground: each checkpoint file prunes the shard folders it does not
name, which must not overlap the next save's shards.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..._warnings import warn
from ...ema import unwrap_model
from ..distributed.context import SINGLE
from . import elastic, sharded
from .average import BestModels
from .files import atomic_copy, atomic_save, load_checkpoint
from .resume import ResumePlan, plan_resume
from .run_folder import LATEST
from .schema import SCHEMA_VERSION
from .snapshot import HostSnapshot

__all__ = ["CheckpointManager", "CheckpointSettings", "LATEST", "BEST", "AVERAGE", "AVERAGE_SNAPSHOTS"]

BEST = "ckpt_best.pth"
AVERAGE, AVERAGE_SNAPSHOTS = "average_model.pth", "average_model_snapshots.pth"
_STEP_FILE = re.compile(r"ckpt_step_(\d+)\.pth")
#: The background writer's thread name: this, the run folder's name, "_0" (async_checkpoints).
WRITER_THREAD = "fusetrain-checkpoint:"


@dataclass(frozen=True)
class CheckpointSettings:
    """What the manager needs to know of a run: how to write (``async_write``, ``keep_last`` step files, the
    ``epoch_files`` to keep, ``average_best`` models and which way the watched metric is better) and the run's
    record (``training_params`` as data, ``data_order``)."""

    training_params: Dict[str, Any]
    data_order: Optional[Dict[str, Any]] = None
    async_write: bool = True
    keep_last: int = 0
    epoch_files: Tuple[int, ...] = ()
    average_best: int = 0
    greater_is_better: bool = True
    metric: str = ""

    @classmethod
    def of(cls, p: Any, data_order: Optional[Dict[str, Any]] = None) -> "CheckpointSettings":
        """The settings of training params ``p``."""
        return cls(training_params=p.to_dict(json_safe=True), data_order=data_order,
                   async_write=p.async_checkpoints, keep_last=p.keep_last_ckpts,
                   epoch_files=tuple(p.save_ckpt_epoch_list),
                   average_best=p.number_of_models_to_average if p.average_best_models else 0,
                   greater_is_better=p.greater_metric_to_watch_is_better, metric=p.metric_to_watch)


class CheckpointManager:
    """Writes and restores the checkpoints of one run (one process of it; rank 0 writes the files) in
    ``run_dir``."""

    def __init__(self, run_dir: str, settings: CheckpointSettings, ctx: Any = SINGLE) -> None:
        self.dir, self.settings, self.ctx = run_dir, settings, ctx
        self._components: Dict[str, Any] = {}
        self._sharded: Optional[sharded.ShardedState] = None
        self._write_shards = False
        self._writer: Optional[ThreadPoolExecutor] = None  # NOTE [asynchronous checkpoints]
        self._pending: Optional[Tuple[Future, Callable[[str], None]]] = None  # the write in flight, its callback
        self._host = HostSnapshot()  # NOTE [pinned snapshot]
        self._best = BestModels(settings.average_best, settings.greater_is_better) \
            if settings.average_best and ctx.is_main else None

    @property
    def latest_path(self) -> str:
        return os.path.join(self.dir, LATEST)

    # ---- components ------------------------------------------------------------------------------------------

    def register(self, name: str, component: Any) -> None:
        """Checkpoint ``component`` (``state_dict()`` / ``load_state_dict()``) under ``name``; restored in the
        order of registration."""
        if not (callable(getattr(component, "state_dict", None))
                and callable(getattr(component, "load_state_dict", None))):
            raise TypeError(f"CheckpointManager.register({name!r}): got {type(component).__name__}; allowed: an "
                            f"object with state_dict() and load_state_dict() (torch's Stateful protocol)")
        if name in self._components or name in _RECORD:
            raise ValueError(f"CheckpointManager.register: {name!r} is taken; allowed: a name other than "
                             f"{sorted(set(self._components) | set(_RECORD))}")
        self._components[name] = component

    def register_sharded(self, state: sharded.ShardedState, write: bool) -> None:
        """The tensors a sharded checkpoint keeps in its shards (NOTE [sharded checkpoints]): loaded from a
        checkpoint that names shards (into any number of processes, sharded or not), and with ``write`` (a
        ``multi_gpu: fsdp`` run) written by every rank beside each checkpoint file, which then holds None for
        ``model`` and ``optimizer``."""
        self._sharded, self._write_shards = state, write

    # ---- the resume decision ---------------------------------------------------------------------------------

    @staticmethod
    def plan(experiment_dir: str, p: Any, train_loader: Any, world: int) -> ResumePlan:
        """What a run continues, decided before anything is written (:func:`.resume.plan_resume`)."""
        return plan_resume(experiment_dir, p, train_loader, world)

    def restore(self, plan: ResumePlan, batch_size: Optional[int] = None) -> Dict[str, Any]:
        """Load the plan's checkpoint into the registered components (the sharded tensors first); returns where
        the run continues: ``{"epoch", "global_step", "position"}`` (this rank's part of a mid-epoch position,
        for a rank of ``batch_size`` samples per batch, or None)."""
        ck, path = plan.checkpoint, plan.path
        try:
            if ck.get("shards") is not None:
                if self._sharded is None:
                    raise ValueError("it names sharded state, and this run registered nothing to load it into")
                self._sharded.load(sharded.folder(path, ck["shards"]), path)
            for name, component in self._components.items():
                if ck.get(name) is not None:  # None: not in this checkpoint, or in its shards
                    component.load_state_dict(ck[name])
        except ValueError as e:
            raise ValueError(f"resume from {path}: {e}") from e
        if self._best is not None:
            self._restore_best_models(ck.get("averaging"))
        return {"epoch": int(ck["epoch"]), "global_step": int(ck["global_step"]),
                "position": elastic.rank_position(ck, self.ctx, path, batch_size)}

    def _restore_best_models(self, listed: Optional[List[Dict[str, Any]]]) -> None:
        path = os.path.join(self.dir, AVERAGE_SNAPSHOTS)
        saved = load_checkpoint(path) if listed and os.path.isfile(path) else {}
        missing = self._best.load_state_dict(saved, listed)
        if missing:
            warn(f"average_best_models: {path} lacks the models of epoch(s) {missing} that the checkpoint "
                 f"lists; the average goes on without them")

    @staticmethod
    def load_final_weights(run_dir: str, model: Any) -> None:
        """The weights of a run's last checkpoint (sharded or not) into ``model``, if there is one."""
        path = os.path.join(run_dir, LATEST)
        if os.path.isfile(path):
            unwrap_model(model).load_state_dict(sharded.full_state_dict(path))

    # ---- writing ---------------------------------------------------------------------------------------------

    def save(self, epoch: int, global_step: int, *, latest: bool = True, best: bool = False,
             epoch_file: Optional[int] = None, position: Optional[Dict[str, Any]] = None,
             saved: Optional[Callable[[str], None]] = None) -> None:
        """A checkpoint written at ``epoch`` (epochs done; with a mid-epoch ``position``, the epoch in progress)
        after optimizer step ``global_step``, as ``ckpt_latest.pth`` (``latest``), ``ckpt_best.pth`` (``best``),
        ``ckpt_epoch_<epoch_file>.pth`` and, with ``keep_last_ckpts``, ``ckpt_step_<global_step>.pth``.
        ``position``: this rank's place in the epoch (``epoch``, ``batches``, ``step0``, ``skipped_seen`` and
        ``rank``, its own entry; gathered from every rank). ``saved(path)`` runs on this thread for each file
        once it is written. Every rank calls it; rank 0 writes the files."""
        ranks = self.ctx.gather_object(position["rank"]) if position is not None else None
        shards = self._save_shards(global_step)
        if not self.ctx.is_main:
            return
        state = self._state(epoch, global_step, shards)
        if position is not None:
            state["position"] = {**{k: v for k, v in position.items() if k != "rank"}, "ranks": ranks}
        keep = self.settings.keep_last
        names = ([LATEST] if latest else []) + ([BEST] if best else [])
        names += [f"ckpt_epoch_{epoch_file}.pth"] if epoch_file is not None else []
        names += [f"ckpt_step_{global_step}.pth"] if latest and keep else []
        paths = [os.path.join(self.dir, n) for n in names]
        prune = bool(latest and keep)
        saved = saved or (lambda path: None)
        if not self.settings.async_write or self._write_shards:  # sharded: with its shards, in the foreground
            for path in self._write_files(state, paths, prune):
                saved(path)
            return
        self.wait()
        snapshot = self._host.take(state)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1,
                                              thread_name_prefix=WRITER_THREAD + os.path.basename(self.dir))
        self._pending = (self._writer.submit(self._write_files, snapshot, paths, prune, self._host.ready), saved)

    def _state(self, epoch: int, global_step: int, shards: Optional[str]) -> Dict[str, Any]:
        """The checkpoint's contents (NOTE [checkpoint schema])."""
        out: Dict[str, Any] = {"schema_version": SCHEMA_VERSION, "training_params": self.settings.training_params,
                               "data_order": self.settings.data_order, "world_size": self.ctx.world_size,
                               "epoch": epoch, "global_step": global_step, "shards": shards}
        for name, component in self._components.items():
            out[name] = None if shards is not None and name in ("model", "optimizer") else component.state_dict()
        if self._best is not None:
            out["averaging"] = self._best.summary()
        return out

    def _save_shards(self, global_step: int) -> Optional[str]:
        """fsdp: every rank writes its shards (NOTE [sharded checkpoints]); returns their folder's name."""
        if not self._write_shards:
            return None
        name = sharded.new_name(global_step)
        self._sharded.save(os.path.join(self.dir, sharded.SHARDS, name))
        return name

    def _write_files(self, state: Dict[str, Any], paths: List[str], prune: bool,
                     ready: Callable[[], None] = lambda: None) -> List[str]:
        """The files of one checkpoint, in order (the files after the first are links to it, or copies where
        the file system has no links), once ``ready()`` returns; returns the paths written."""
        ready()
        for k, path in enumerate(paths):
            if k == 0:
                atomic_save(state, path)
            else:
                atomic_copy(paths[0], path)
        if prune:
            found = sorted((int(m.group(1)), n) for n in os.listdir(self.dir) if (m := _STEP_FILE.fullmatch(n)))
            for _, name in found[:-self.settings.keep_last]:
                os.remove(os.path.join(self.dir, name))
        sharded.collect_garbage(self.dir)  # also after a sharded run resumed unsharded
        return paths

    def wait(self) -> None:
        """Wait for the checkpoint written in the background, then run its ``saved`` callback here; a failed
        write raises its error."""
        if self._pending is None:
            return
        future, saved = self._pending
        self._pending = None
        for path in future.result():
            saved(path)

    def close(self) -> None:
        """The end of the run: wait for a checkpoint in flight and stop the writer thread."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None

    # ---- the average of the best models ----------------------------------------------------------------------

    def offer_best_model(self, epoch: int, value: Optional[float], weights: Dict[str, Any]) -> None:
        """NOTE [average of the best models]: the watched weights join the k best if they are among them; then
        ``average_model.pth`` is written (after each epoch-end validation, as the kept models stand). Rank 0."""
        if self._best is None:
            return
        if self._best.offer(epoch, value, weights):
            atomic_save(self._best.state_dict(), os.path.join(self.dir, AVERAGE_SNAPSHOTS))
        if self._best.kept:
            atomic_save({"model": self._best.average(), "averaged": self._best.summary(),
                         "metric": self.settings.metric, "epoch": epoch}, os.path.join(self.dir, AVERAGE))

    def average_model(self) -> Optional[Dict[str, Any]]:
        """The current average of the best models (rank 0 with ``average_best_models``), or None."""
        if self._best is None or not self._best.kept:
            return None
        return self._best.average()

    def averaged(self) -> List[Dict[str, Any]]:
        """``[{"epoch", "value"}]`` of the models in the average."""
        return self._best.summary() if self._best is not None else []


#: The keys of the run's record (NOTE [checkpoint schema]), which no component may take.
_RECORD = ("schema_version", "training_params", "data_order", "world_size", "epoch", "global_step", "shards",
           "position", "averaging")
