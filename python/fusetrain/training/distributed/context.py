"""The distributed context of a training run (``torch.distributed``).

:func:`.devices.setup` joins or creates the process group and returns a
:class:`DistContext`, the one object the Trainer asks about the run's
processes: wrap the model (DDP), suppress the gradient all-reduce on
accumulation micro-batches, sum the epoch's device tensors over ranks,
broadcast buffers, meet at a barrier, record and report a failed rank, and
tear the group down. Outside a distributed run the context is
:data:`SINGLE`, whose methods do nothing. Starting worker processes lives in
:mod:`.launcher`, sharding loaders in :mod:`.sharding`; this module
knows nothing of the Trainer.

Two ways in:

* **A launcher starts the processes** (``torchrun --nproc_per_node=N -m
  fusetrain.train_from_recipe ...``, one node or several). Each process finds
  ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` in its environment; the context
  initialises the process group (NCCL for CUDA devices on
  ``cuda:LOCAL_RANK``, gloo for the CPU) with ``dist_timeout_s`` as the
  collective timeout, and destroys it at the end. A process group the caller
  initialised is used as it is and left alone.
* **The Trainer starts them** (``multi_gpu: ddp`` with ``num_gpus`` /
  ``num_processes``): :func:`.devices.workers_to_launch` says how many, and
  :func:`fusetrain.training.distributed.launcher.launch` starts them.

See docs/design.md, "Distributed training", for what runs in each process.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..._warnings import warn

__all__ = ["DistContext", "DistributedTrainingError", "SINGLE", "env_world", "launched_by_launcher", "find_ddp"]

_FAILED_KEY = "fusetrain/failed_rank"


class DistributedTrainingError(RuntimeError):
    """A distributed run failed; the message names the rank that failed first."""

    def __init__(self, message: str, rank: Optional[int] = None) -> None:
        super().__init__(message)
        self.rank = rank


# ---- the environment ---------------------------------------------------------------------------------------------


def _env_int(name: str) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from exc


def env_world() -> Tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` of this process: from the initialised
    default process group if there is one, else from the launcher's environment
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), else ``(0, 1, 0)``."""
    import torch.distributed as dist

    local = _env_int("LOCAL_RANK")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), local if local is not None else 0
    world = _env_int("WORLD_SIZE")
    rank = _env_int("RANK")
    if world is None or world <= 1:
        return 0, 1, 0
    if rank is None:
        raise ValueError(f"WORLD_SIZE={world} is set but RANK is not: start the processes with torchrun (or set "
                         f"RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in each)")
    return rank, world, local if local is not None else rank


def launched_by_launcher() -> bool:
    """Whether this process is one of several started by a launcher (or the
    caller initialised a process group of more than one process)."""
    return env_world()[1] > 1

@dataclass(frozen=True)
class DistContext:
    """Where this process stands in the run, and the collectives the Trainer
    uses. ``world_size == 1``: not distributed (every method is a no-op)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: Optional[str] = None
    owns_group: bool = False
    timeout_s: float = 300.0
    fsdp: bool = False  # multi_gpu 'fsdp': the model is sharded (fusetrain.training.distributed.fsdp), not DDP-wrapped

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return f"rank {self.rank} (local rank {self.local_rank}) of {self.world_size}"

    # ---- the model ---------------------------------------------------------------------------------------------

    def wrap(self, model: nn.Module, device: torch.device, find_unused_parameters: bool) -> nn.Module:
        """``DistributedDataParallel(model)`` (broadcasts rank 0's parameters and
        buffers; the model must already be on ``device``); ``model`` itself
        outside a distributed run."""
        if not self.enabled:
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        kwargs: Dict[str, Any] = {"find_unused_parameters": find_unused_parameters}
        if device.type == "cuda":
            kwargs.update(device_ids=[device.index], output_device=device.index)
        return DDP(model, **kwargs)

    @staticmethod
    def convert_sync_batchnorm(model: nn.Module) -> nn.Module:
        """BatchNorm layers to synchronised ones: ``fusetrain.nn`` when present
        (it also runs on the CPU), else ``torch.nn.SyncBatchNorm`` (CUDA only)."""
        try:
            from ...nn import convert_sync_batchnorm as convert  # type: ignore[attr-defined]
        except ImportError:
            convert = None
        if convert is not None:
            return convert(model)
        dev = next((t.device for t in model.parameters()), torch.device("cpu"))
        if dev.type == "cpu" and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            raise ValueError("training_params.sync_bn: torch.nn.SyncBatchNorm runs only on GPUs and fusetrain.nn's "
                             "SyncBatchNorm is not available in this build; allowed on the CPU: sync_bn false")
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)

    @staticmethod
    def grad_sync(model: nn.Module, sync: bool):
        """Context for one micro-batch's forward and backward: ``no_sync()`` when
        the gradients must not be all-reduced yet (an accumulation micro-step);
        FSDP2's equivalent for a sharded model."""
        if sync:
            return contextlib.nullcontext()
        ddp = find_ddp(model)
        if ddp is not None:
            return ddp.no_sync()
        from . import fsdp
        return fsdp.grad_sync(model, sync)

    def lockstep(self, batches: Any, device: torch.device, what: str) -> Any:
        """``(batch, real)`` pairs of ``batches``; with a sharded model, as many on every rank as the rank with
        the most (its forward is a collective: :func:`.fsdp.lockstep`)."""
        if not self.fsdp:
            return ((b, True) for b in batches)
        from . import fsdp

        return fsdp.lockstep(batches, device, what)

    @torch.no_grad()
    def broadcast_module(self, model: nn.Module) -> None:
        """Give every rank rank 0's parameters and buffers (what DDP does when it
        wraps a model; before sharding, every rank must cut the same tensors)."""
        if not self.enabled:
            return
        import torch.distributed as dist

        for t in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(t.data, src=0)

    @torch.no_grad()
    def broadcast_buffers(self, modules: Sequence[Optional[nn.Module]], extra: Sequence[Tensor] = ()) -> None:
        """Give every rank rank 0's buffers (BatchNorm running stats differ per rank
        without sync_bn) and the ``extra`` tensors (the EMA's remainders of its
        buffers) so validation and the EMA agree everywhere."""
        if not self.enabled:
            return
        import torch.distributed as dist

        for m in modules:
            if m is None:
                continue
            for b in m.buffers():
                dist.broadcast(b, src=0)
        for t in extra:  # as bytes: neither gloo nor NCCL broadcasts int16
            flat = t.contiguous().view(-1)
            dist.broadcast(flat.view(torch.uint8), src=0)
            if flat.data_ptr() != t.data_ptr():
                t.copy_(flat.view_as(t))

    # ---- reductions and barriers ---------------------------------------------------------------------------

    @torch.no_grad()
    def sum_(self, tensors: Sequence[Tensor], counts: Sequence[float] = ()) -> List[float]:
        """Sum ``tensors`` (any shapes, one device) in place across ranks with one
        float64 all-reduce, together with the host numbers ``counts``; returns
        the summed counts. A no-op outside a distributed run."""
        if not self.enabled:
            return [float(c) for c in counts]
        import torch.distributed as dist

        if not tensors:
            raise ValueError("DistContext.sum_: needs at least one tensor")
        device = tensors[0].device
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]
                         + [torch.tensor([float(c) for c in counts], dtype=torch.float64, device=device)])
        dist.all_reduce(flat)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n
        return [float(v) for v in flat[offset:].tolist()]

    def gather_object(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's picklable ``obj``, in rank order, on rank 0 (None on the
        other ranks); ``[obj]`` outside a distributed run."""
        if not self.enabled:
            return [obj]
        import torch.distributed as dist

        out: Optional[List[Any]] = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's picklable ``obj`` on every rank (``obj`` itself outside a distributed run)."""
        if not self.enabled:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank. On gloo a monitored barrier, which names the ranks
        that did not arrive within ``dist_timeout_s``."""
        if not self.enabled:
            return
        import torch.distributed as dist

        if self.backend == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=self.timeout_s), wait_all_ranks=True)
        elif self.backend == "nccl" and torch.cuda.is_available():
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()

    # ---- the end ------------------------------------------------------------------------------------------------

    def teardown(self, failed: bool) -> None:
        """Destroy the process group if this context created it. After a failure a
        NCCL group is aborted (destroying it could wait on a dead peer). After a
        success every rank first passes a barrier, which also makes it the last
        collective: a gloo thread that releases an earlier collective's tensors
        (made in Python: FSDP2's, the step's norm) while the interpreter
        finalizes aborts the process ("terminate called without an active
        exception"; NOTE [exit after success] in tests/python/_dist_helpers.py)."""
        import torch.distributed as dist

        if not (self.owns_group and dist.is_available() and dist.is_initialized()):
            return
        try:
            if failed and self.backend == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
                dist.distributed_c10d._abort_process_group()
            else:
                if not failed:
                    self.barrier()
                dist.destroy_process_group()
        except Exception as exc:  # teardown must not hide the training error
            warn(f"could not tear down the process group: {exc}")

    def on_failure(self, exc: BaseException, where: str) -> Optional[BaseException]:
        """Called on a rank whose training raised ``exc``. If another rank failed
        first (this rank's collective broke because that peer went away), returns a
        :class:`DistributedTrainingError` naming that rank to raise instead;
        otherwise records this rank as the one that failed and returns None (the
        original exception propagates). Prints one line to stderr either way."""
        if not self.enabled:
            return None
        store = _store()
        text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]
        first = None
        if store is not None:
            # A communication error usually means a peer died: give its record a moment to land.
            first = _read_failure(store, 2.0 if _is_comm_error(exc) else 0.0)
            if first is None:
                try:
                    store.compare_set(_FAILED_KEY, "", f"{self.rank}|{where}: {text}")
                except Exception:
                    pass
                first = _read_failure(store, 0.0)
        if first is not None:
            rank_s, _, msg = first.partition("|")
            if rank_s != str(self.rank):
                err = DistributedTrainingError(
                    f"{self.describe()} stopped because rank {rank_s} failed first ({msg}); this rank's own error: "
                    f"{text}", rank=int(rank_s) if rank_s.isdigit() else None)
                print(f"fusetrain: {err}", file=sys.stderr, flush=True)
                return err
        print(f"fusetrain: {self.describe()} failed {where}: {text}", file=sys.stderr, flush=True)
        return None


SINGLE = DistContext()


# ---- failures ----------------------------------------------------------------------------------------------------


def _store():
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def _read_failure(store, wait_s: float) -> Optional[str]:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if store.check([_FAILED_KEY]):
                return store.get(_FAILED_KEY).decode("utf-8", "replace")
        except Exception:
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _is_comm_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(s in text for s in ("connection closed", "connection reset", "gloo", "nccl", "timed out",
                                   "broken pipe", "socket"))

def find_ddp(model: nn.Module):
    """The DistributedDataParallel module in ``model``'s wrappers (compiled or not), or None."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    while True:
        if isinstance(model, DDP):
            return model
        inner = getattr(model, "_orig_mod", None)
        if inner is None:
            return None
        model = inner
