"""Distributed data-parallel training for the Trainer (``torch.distributed``).

Two ways in:

* **A launcher starts the processes** (``torchrun --nproc_per_node=N -m
  fusetrain.train_from_recipe ...``, one node or several). Each process finds
  ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` in its environment; the Trainer
  initialises the process group itself (NCCL for CUDA devices on
  ``cuda:LOCAL_RANK``, gloo for the CPU) with ``dist_timeout_s`` as the
  collective timeout, and destroys it at the end. A process group the caller
  initialised is used as it is and left alone.
* **The Trainer starts them** (``multi_gpu: ddp`` with ``num_gpus`` /
  ``num_processes`` from Python or a recipe run with plain ``python``): torch's
  elastic launcher (:func:`torch.distributed.launcher.api.elastic_launch`) starts
  the workers on this node and each one runs the same training. The model,
  loaders and training_params are sent to the workers by pickling (spawned
  processes), so they must be picklable; the recipe path rebuilds them in each
  worker from the recipe instead and is the robust one.

What runs in each process (see docs/design.md, "Distributed training"):

* the model moves to the device, BatchNorm layers become SyncBatchNorm
  (``sync_bn``), then DistributedDataParallel wraps it (broadcasting rank 0's
  parameters and buffers, so every rank starts from the same weights); the
  optimizer and the EMA are built after that on the plain module;
* under ``torch_compile`` the DDP-wrapped module is compiled (so Dynamo's
  DDPOptimizer splits the graph at the gradient-bucket boundaries and the
  all-reduces overlap the backward);
* gradient-accumulation micro-batches run under ``no_sync()``; only the
  micro-batch that steps all-reduces;
* the train loader is re-wrapped with a ``DistributedSampler`` (unless it has
  one), the validation loader with :class:`ShardSampler` (exact: no padding),
  and the running sums of the loss and metrics are all-reduced once per epoch,
  so every rank sees the same row;
* logging and checkpoints happen on rank 0; every rank waits at a barrier after
  the checkpoint;
* a rank that fails records "rank R failed: ..." in the process group's store;
  a rank whose collective then breaks raises an error naming that rank.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["DistState", "DistributedTrainingError", "ShardSampler", "env_world", "launched_by_launcher",
           "launch", "workers_to_launch", "setup", "teardown", "epoch_seed"]

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
class DistState:
    """Where this process stands in the run. ``world_size == 1``: not distributed."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: Optional[str] = None
    owns_group: bool = False
    timeout_s: float = 300.0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return f"rank {self.rank} (local rank {self.local_rank}) of {self.world_size}"


SINGLE = DistState()


# ---- validation of the distributed training_params ---------------------------------------------------------------


def _params_error(message: str) -> Exception:
    from .params import TrainingParamsError

    return TrainingParamsError([message])


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _visible_note() -> str:
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={vis!r})" if vis is not None else ""


def check_gpu_request(p) -> None:
    """``num_gpus`` must not ask for more CUDA devices than are visible."""
    if p.num_gpus is not None:
        n = _cuda_count()
        if p.num_gpus > n:
            raise _params_error(f"training_params.num_gpus: got {p.num_gpus} but only {n} CUDA device(s) are "
                                f"available here{_visible_note()}; allowed: an int in [1, {max(n, 1)}]"
                                + ("" if n else ", on a machine with CUDA devices (use num_processes for CPU "
                                                 "processes)"))


def workers_to_launch(p) -> int:
    """How many worker processes the Trainer must start itself for training
    params ``p`` (1: train in this process). 0 is never returned."""
    check_gpu_request(p)
    if p.multi_gpu == "off" or launched_by_launcher():
        return 1
    if p.multi_gpu == "auto" and (p.num_gpus or 1) <= 1 and (p.num_processes or 1) <= 1:
        return 1
    cuda = _target_is_cuda(p.device)
    if cuda:
        if p.num_processes is not None:
            raise _params_error(f"training_params.num_processes: got {p.num_processes} for a CUDA run; allowed: "
                                f"None here (num_processes counts CPU processes; use num_gpus)")
        return p.num_gpus if p.num_gpus is not None else _cuda_count()
    if p.num_gpus is not None:  # check_gpu_request passed: CUDA exists but device is 'cpu'
        raise _params_error(f"training_params.num_gpus: got {p.num_gpus} but device is {p.device!r}; allowed: "
                            f"None for a CPU run (use num_processes)")
    if p.num_processes is None:
        raise _params_error("training_params.multi_gpu: got 'ddp' on the CPU (no CUDA device available) without "
                            "num_processes; allowed: set num_processes to the number of CPU processes, or use "
                            "multi_gpu 'off'/'auto'")
    return p.num_processes


def _target_is_cuda(device_spec: str) -> bool:
    if device_spec == "auto":
        return torch.cuda.is_available()
    return device_spec.startswith("cuda")


# ---- process group -----------------------------------------------------------------------------------------------


def setup(p) -> Tuple[DistState, torch.device]:
    """Join (or create) the process group for training params ``p``; returns the
    state and this process's training device."""
    import torch.distributed as dist

    rank, world, local_rank = env_world()
    if world <= 1:
        return DistState(timeout_s=p.dist_timeout_s), _single_device(p.device)
    if p.multi_gpu == "off":
        raise _params_error(f"training_params.multi_gpu: got 'off' but this process is rank {rank} of {world} "
                            f"(started by a launcher: WORLD_SIZE={world}); allowed here: 'auto' or 'ddp' (or start "
                            f"a single process)")
    if not dist.is_available():
        raise RuntimeError("distributed training needs torch.distributed, which this torch build lacks")
    if getattr(p, "compile_step", "off") == "cuda_graph":
        raise _params_error("training_params.compile_step: got 'cuda_graph' in a distributed run; allowed there: "
                            "'off' or 'compile' (DDP's gradient all-reduce runs in autograd hooks outside a "
                            "captured graph)")
    device = _rank_device(p.device, local_rank)
    owns = False
    if dist.is_initialized():
        backend = dist.get_backend()
    else:
        backend = p.dist_backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and device.type != "cuda":
            raise _params_error(f"training_params.dist_backend: got 'nccl' but the device is {device}; allowed "
                                f"for a CPU run: 'gloo' or 'auto'")
        if backend == "gloo" and not dist.is_gloo_available():
            raise RuntimeError("training_params.dist_backend: gloo is not available in this torch build")
        if backend == "nccl" and not dist.is_nccl_available():
            raise RuntimeError("training_params.dist_backend: NCCL is not available in this torch build")
        kwargs: Dict[str, Any] = {}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=p.dist_timeout_s), **kwargs)
        owns = True
    state = DistState(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                      backend=str(backend), owns_group=owns, timeout_s=p.dist_timeout_s)
    return state, device


def _single_device(spec: str) -> torch.device:
    """The device of a single-process run. A CUDA device becomes the current
    one (``torch.cuda.set_device``), so work that names no device (a CUDA graph
    capture, tensors made with ``device="cuda"``) lands on it too."""
    dev = torch.device("cuda" if spec == "auto" and torch.cuda.is_available() else
                       "cpu" if spec == "auto" else spec)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise ValueError(f"training_params.device: got {spec!r} but CUDA is not available; allowed here: 'auto', "
                         f"'cpu'")
    n = torch.cuda.device_count()
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= n:
        raise ValueError(f"training_params.device: got {spec!r} but only {n} CUDA device(s) are "
                         f"visible{_visible_note()}; allowed: 'cuda:0' to 'cuda:{n - 1}', 'cuda', 'auto' or 'cpu'")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _rank_device(spec: str, local_rank: int) -> torch.device:
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if spec not in ("auto", "cuda"):
        raise ValueError(f"training_params.device: got {spec!r} in a distributed run; allowed: 'auto', 'cuda' "
                         f"(each process uses cuda:LOCAL_RANK) or 'cpu'; choose the GPUs with CUDA_VISIBLE_DEVICES")
    if not torch.cuda.is_available():
        raise ValueError(f"training_params.device: got {spec!r} but CUDA is not available; allowed here: 'auto', "
                         f"'cpu'")
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise ValueError(f"LOCAL_RANK={local_rank} needs cuda:{local_rank} but only {n} CUDA device(s) are "
                         f"visible{_visible_note()}; start at most {n} processes per node (--nproc_per_node)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def teardown(state: DistState, failed: bool) -> None:
    """Destroy the process group if the Trainer created it. After a failure a
    NCCL group is aborted (destroying it could wait on a dead peer)."""
    import torch.distributed as dist

    if not (state.owns_group and dist.is_available() and dist.is_initialized()):
        return
    try:
        if failed and state.backend == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    except Exception as exc:  # teardown must not hide the training error
        warnings.warn(f"could not tear down the process group: {exc}", stacklevel=2)


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


def on_failure(state: DistState, exc: BaseException, where: str) -> Optional[BaseException]:
    """Called on a rank whose training raised ``exc``. If another rank failed
    first (this rank's collective broke because that peer went away), returns a
    :class:`DistributedTrainingError` naming that rank to raise instead;
    otherwise records this rank as the one that failed and returns None (the
    original exception propagates). Prints one line to stderr either way."""
    if not state.enabled:
        return None
    store = _store()
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]
    first = None
    if store is not None:
        # A communication error usually means a peer died: give its record a moment to land.
        comm = _is_comm_error(exc)
        first = _read_failure(store, 2.0 if comm else 0.0)
        if first is None:
            try:
                store.compare_set(_FAILED_KEY, "", f"{state.rank}|{where}: {text}")
            except Exception:
                pass
            first = _read_failure(store, 0.0)
    if first is not None:
        rank_s, _, msg = first.partition("|")
        if rank_s != str(state.rank):
            err = DistributedTrainingError(
                f"{state.describe()} stopped because rank {rank_s} failed first ({msg}); this rank's own error: "
                f"{text}", rank=int(rank_s) if rank_s.isdigit() else None)
            print(f"fusetrain: {err}", file=sys.stderr, flush=True)
            return err
    print(f"fusetrain: {state.describe()} failed {where}: {text}", file=sys.stderr, flush=True)
    return None


def _is_comm_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(s in text for s in ("connection closed", "connection reset", "gloo", "nccl", "timed out",
                                   "broken pipe", "socket"))


# ---- model -------------------------------------------------------------------------------------------------------


def convert_sync_batchnorm(model: nn.Module) -> nn.Module:
    """BatchNorm layers to synchronised ones: ``fusetrain.nn`` when present
    (it also runs on the CPU), else ``torch.nn.SyncBatchNorm`` (CUDA only)."""
    try:
        from ..nn import convert_sync_batchnorm as convert  # type: ignore[attr-defined]
    except ImportError:
        convert = None
    if convert is not None:
        return convert(model)
    dev = next((t.device for t in model.parameters()), torch.device("cpu"))
    if dev.type == "cpu" and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise ValueError("training_params.sync_bn: torch.nn.SyncBatchNorm runs only on GPUs and fusetrain.nn's "
                         "SyncBatchNorm is not available in this build; allowed on the CPU: sync_bn false")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def wrap_model(model: nn.Module, state: DistState, device: torch.device, find_unused_parameters: bool) -> nn.Module:
    """``DistributedDataParallel(model)`` (broadcasts rank 0's parameters and
    buffers); the model must already be on ``device``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    kwargs: Dict[str, Any] = {"find_unused_parameters": find_unused_parameters}
    if device.type == "cuda":
        kwargs.update(device_ids=[device.index], output_device=device.index)
    return DDP(model, **kwargs)


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


def grad_sync(model: nn.Module, sync: bool):
    """Context for one micro-batch's forward and backward: ``no_sync()`` when
    the gradients must not be all-reduced yet (an accumulation micro-step)."""
    ddp = find_ddp(model)
    if ddp is None or sync:
        return contextlib.nullcontext()
    return ddp.no_sync()


@torch.no_grad()
def broadcast_buffers(state: DistState, modules: Sequence[Optional[nn.Module]]) -> None:
    """Give every rank rank 0's buffers (BatchNorm running stats differ per rank
    without sync_bn) so validation and the EMA agree everywhere."""
    import torch.distributed as dist

    if not state.enabled:
        return
    for m in modules:
        if m is None:
            continue
        for b in m.buffers():
            dist.broadcast(b, src=0)


# ---- data --------------------------------------------------------------------------------------------------------


class ShardSampler(torch.utils.data.Sampler):
    """Indices ``rank, rank + world_size, ...`` of a map-style dataset, in order,
    without padding: the shards of all ranks together are the dataset exactly
    once (for validation, whose sums are all-reduced afterwards; the ranks may
    run different numbers of batches)."""

    def __init__(self, dataset, num_replicas: int, rank: int) -> None:
        self.n = len(dataset)
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self):
        return iter(range(self.rank, self.n, self.num_replicas))

    def __len__(self) -> int:
        return max(0, -(-(self.n - self.rank) // self.num_replicas))


def _loader_kwargs(loader) -> Dict[str, Any]:
    kw = dict(batch_size=loader.batch_size, drop_last=loader.drop_last, num_workers=loader.num_workers,
              collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
              worker_init_fn=loader.worker_init_fn, generator=loader.generator)
    if loader.num_workers > 0:
        kw.update(persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor,
                  multiprocessing_context=loader.multiprocessing_context)
    return kw


def _rewrap_reason(loader, what: str) -> Optional[str]:
    from torch.utils.data import BatchSampler, DataLoader, IterableDataset

    if not isinstance(loader, DataLoader):
        return f"{what} is a {type(loader).__name__}, not a torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return f"{what} reads an IterableDataset"
    if loader.batch_sampler is None:
        return f"{what} has batch_size=None"
    if type(loader.batch_sampler) is not BatchSampler:
        return f"{what} has a custom batch_sampler ({type(loader.batch_sampler).__name__})"
    return None


def shard_train_loader(loader, state: DistState, seed: int):
    """The train loader with a ``DistributedSampler`` (same batch size, workers,
    collate_fn, drop_last, pin_memory; shuffled if the loader shuffled, with
    ``seed``). A loader that already has one is returned as is; one that cannot
    be rebuilt (custom batch sampler, iterable dataset, not a DataLoader) too,
    with a warning: each rank must then see its own shard and the same number
    of batches."""
    from torch.utils.data import DataLoader, RandomSampler
    from torch.utils.data.distributed import DistributedSampler

    if not state.enabled:
        return loader
    if isinstance(getattr(loader, "sampler", None), DistributedSampler):
        return loader
    reason = _rewrap_reason(loader, "the train loader")
    if reason is not None:
        warnings.warn(f"distributed run: {reason}, so it is not re-wrapped with a DistributedSampler; each rank "
                      f"must load its own shard with the same number of batches", stacklevel=3)
        return loader
    shuffle = isinstance(loader.sampler, RandomSampler)
    sampler = DistributedSampler(loader.dataset, num_replicas=state.world_size, rank=state.rank, shuffle=shuffle,
                                 seed=seed, drop_last=loader.drop_last)
    return DataLoader(loader.dataset, sampler=sampler, **_loader_kwargs(loader))


def shard_valid_loader(loader, state: DistState):
    """The validation loader restricted to this rank's :class:`ShardSampler`
    shard (a DistributedSampler already there is kept: its padding repeats a
    few samples)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    if not state.enabled or loader is None:
        return loader
    if isinstance(getattr(loader, "sampler", None), (DistributedSampler, ShardSampler)):
        return loader
    reason = _rewrap_reason(loader, "the validation loader")
    if reason is not None:
        warnings.warn(f"distributed run: {reason}, so it is not sharded; every rank validates on what it loads "
                      f"and the sums are added up across ranks", stacklevel=3)
        return loader
    kw = _loader_kwargs(loader)
    kw.pop("generator")
    return DataLoader(loader.dataset, sampler=ShardSampler(loader.dataset, state.world_size, state.rank), **kw)


def set_epoch(loader, epoch: int) -> None:
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None and batch_sampler is not sampler and hasattr(batch_sampler, "set_epoch"):
        batch_sampler.set_epoch(epoch)


# ---- reductions, barriers, seeds ---------------------------------------------------------------------------------


@torch.no_grad()
def all_reduce_sums(state: DistState, tensors: Sequence[Tensor], counts: Sequence[float] = ()) -> List[float]:
    """Sum ``tensors`` (0-d, float64, same device) in place across ranks with one
    all-reduce, together with the host numbers ``counts``; returns the summed
    counts. A no-op outside a distributed run."""
    if not state.enabled:
        return [float(c) for c in counts]
    import torch.distributed as dist

    if not tensors:
        raise ValueError("all_reduce_sums: needs at least one tensor")
    device = tensors[0].device
    flat = torch.stack([t.reshape(()).to(torch.float64) for t in tensors]
                       + [torch.tensor(float(c), dtype=torch.float64, device=device) for c in counts])
    dist.all_reduce(flat)
    for i, t in enumerate(tensors):
        t.copy_(flat[i])
    return [float(v) for v in flat[len(tensors):].tolist()]


def reduce_epoch(state: DistState, loss_sum: Tensor, metrics: Sequence[Any], count: float) -> float:
    """All-reduce an epoch's running loss sum, the metrics' running sums and the
    sample count (one collective); returns the global count."""
    if not state.enabled:
        return float(count)
    tensors = [loss_sum] + [t for m in metrics for t in m.state_tensors()]
    return all_reduce_sums(state, tensors, [count])[0]


def barrier(state: DistState) -> None:
    """Wait for every rank. On gloo a monitored barrier, which names the ranks
    that did not arrive within ``dist_timeout_s``."""
    import torch.distributed as dist

    if not state.enabled:
        return
    if state.backend == "gloo":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=state.timeout_s), wait_all_ranks=True)
    elif state.backend == "nccl" and torch.cuda.is_available():
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def epoch_seed(seed: int, rank: int, epoch: int) -> int:
    """The seed of rank ``rank``'s random generators for epoch ``epoch`` of a
    distributed run (data augmentation, dropout): derived from all three, so it
    differs per rank and per epoch and a resumed run re-derives it."""
    return int(np.random.SeedSequence([int(seed), int(rank), int(epoch)]).generate_state(1, dtype=np.uint32)[0])


def seed_everything(value: int) -> None:
    import random

    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % 2**32)


class NullLogger:
    """The ExperimentLogger interface for ranks other than 0: logs nothing."""

    def __init__(self) -> None:
        self.rows = []

    def load_existing(self, up_to_epoch: int) -> None:
        pass

    def log_epoch(self, row: Dict[str, Any]) -> None:
        pass

    def plot(self, filename: str = "metrics.png") -> str:
        return ""

    def close(self) -> None:
        pass


# ---- the launcher: the Trainer starts its own workers ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_picklable(payload: Dict[str, Any], how: str) -> None:
    for name, value in payload.items():
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"multi_gpu 'ddp' starts worker processes and sends them {name} by pickling, but {name} cannot be "
                f"pickled: {type(exc).__name__}: {exc}. Use module-level classes and functions (no lambdas or "
                f"local classes), or train from a recipe, which builds everything in each worker: {how}") from exc


def _failure_text(failure) -> str:
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", msg)
    text = str(msg).strip()
    return text.splitlines()[-1] if text else f"exit code {failure.exitcode}"


def _launch_error(exc) -> DistributedTrainingError:
    """The launcher's failure report as one error naming the rank that failed
    first. A rank that stopped because another one failed says so in its
    message (see :func:`on_failure`); the rank it names is preferred."""
    failures = dict(exc.failures)
    primary = {r: f for r, f in failures.items() if "stopped because rank" not in _failure_text(f)}
    pool = primary or failures
    rank = min(pool, key=lambda r: (pool[r].timestamp, r))
    failure = pool[rank]
    others = sorted(r for r in failures if r != rank)
    also = f"; ranks {others} stopped too" if others else ""
    return DistributedTrainingError(
        f"distributed training failed: rank {rank} (local rank {failure.local_rank}, exit code {failure.exitcode}) "
        f"failed first: {_failure_text(failure)}{also}", rank=rank)


def _call_pickled(blob: bytes) -> Any:
    fn, args = pickle.loads(blob)
    return fn(*args)


def launch(fn: Callable[..., Any], args: Sequence[Any], nprocs: int, payload_names: Sequence[str] = (),
           how: str = "torchrun --nproc_per_node=N -m fusetrain.train_from_recipe ...") -> Any:
    """Run ``fn(*args)`` in ``nprocs`` worker processes on this node under
    torch's elastic agent (spawned; ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set in
    each) and return rank 0's result. ``fn`` must be a module-level function
    and ``args`` picklable. A failed worker stops all of them; the error raised
    here is a :class:`DistributedTrainingError` naming the rank that failed
    first."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if payload_names:
        _check_picklable(dict(zip(payload_names, args)), how)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"fusetrain-{uuid.uuid4().hex}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn", local_addr="127.0.0.1")
    env_backup = os.environ.get("OMP_NUM_THREADS")
    if env_backup is None:
        # As torchrun does: the workers share the cores, so each gets its share of intra-op threads.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nprocs))
    # Sent as one pickled blob: torch.multiprocessing would pass tensors through shared memory, which
    # containers often limit (a small /dev/shm); plain pickling copies them.
    blob = pickle.dumps((fn, tuple(args)))
    try:
        results = elastic_launch(config, _call_pickled)(blob)
    except ChildFailedError as exc:
        raise _launch_error(exc) from exc
    finally:
        if env_backup is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    return results[0]


def _train_worker(experiment_name: str, ckpt_root_dir: str, model: nn.Module, training_params: Dict[str, Any],
                  train_loader, valid_loader) -> Dict[str, Any]:
    """What each launched worker runs: the same Trainer.train call."""
    from .trainer import Trainer

    return Trainer(experiment_name, ckpt_root_dir=ckpt_root_dir).train(model, training_params, train_loader,
                                                                         valid_loader)


def launch_training(trainer, model: nn.Module, p, train_loader, valid_loader, nprocs: int) -> Dict[str, Any]:
    """Start ``nprocs`` workers that each run ``trainer.train(...)``; then load the
    final weights (the last checkpoint) into ``model`` so the caller holds the
    trained model, as after a single-process run. Returns rank 0's result."""
    from ..ema import unwrap_model
    from .checkpoints import load_checkpoint

    args = (trainer.experiment_name, trainer.ckpt_root_dir, model, p, train_loader, valid_loader)
    result = launch(_train_worker, args, nprocs,
                    payload_names=("experiment_name", "ckpt_root_dir", "the model", "training_params",
                                   "the train loader", "the validation loader"))
    path = os.path.join(trainer.experiment_dir, "ckpt_latest.pth")
    if os.path.isfile(path):
        unwrap_model(model).load_state_dict(load_checkpoint(path)["model"])
    return result
