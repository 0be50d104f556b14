"""Starting the worker processes of a distributed run on this node
(``multi_gpu: ddp`` outside a launcher): torch's elastic launcher
(:func:`torch.distributed.launcher.api.elastic_launch`, spawned workers,
c10d rendezvous on 127.0.0.1, no restarts). The Trainer and the recipe entry
point pass the function each worker runs; a failure is reported as one
:class:`~fusetrain.training.distributed.context.DistributedTrainingError` naming the
rank that failed first."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import threading
import uuid
from typing import Any, Callable, Dict, Sequence

from .context import DistributedTrainingError

__all__ = ["launch"]


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


class _Stopped:
    """What a worker returns instead of raising TrainingInterrupted: the launcher raises it again here."""

    def __init__(self, message: str) -> None:
        self.message = message


# NOTE [worker start method]: the workers are spawned, which makes "spawn" the
# default start method inside them, so a DataLoader with workers (and no
# multiprocessing_context of its own) would start each loader worker as a new
# interpreter importing torch (seconds each, every epoch unless persistent).
# A worker takes the launching process's start method instead ("fork" on Linux
# before Python 3.14), as a worker started by torchrun has.
def _call_pickled(blob: bytes, start_method: str) -> Any:
    from .preemption import TrainingInterrupted

    multiprocessing.set_start_method(start_method, force=True)
    fn, args = pickle.loads(blob)
    try:
        return fn(*args)
    except TrainingInterrupted as exc:  # a stop with a checkpoint is no failure (NOTE [preemption])
        return _Stopped(str(exc))


def launch(fn: Callable[..., Any], args: Sequence[Any], nprocs: int, payload_names: Sequence[str] = (),
           how: str = "torchrun --nproc_per_node=N -m fusetrain.train_from_recipe ...",
           signals: Sequence[str] = ()) -> Any:
    """Run ``fn(*args)`` in ``nprocs`` worker processes on this node under
    torch's elastic agent (spawned; ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set in
    each) and return rank 0's result. ``fn`` must be a module-level function
    and ``args`` picklable. A failed worker stops all of them; the error raised
    here is a :class:`DistributedTrainingError` naming the rank that failed
    first. Workers stopped by a signal with a checkpoint make it raise
    :class:`~fusetrain.training.schedules.triggers.TrainingInterrupted`; ``signals``
    (names) sent to this process are passed on to the workers."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .preemption import TrainingInterrupted

    if payload_names:
        _check_picklable(dict(zip(payload_names, args)), how)
    handled = list(dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *signals]))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"fusetrain-{uuid.uuid4().hex}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn", local_addr="127.0.0.1",
                          signals_to_handle=",".join(handled))
    # The launcher's handlers of these signals stay installed after it returns: the caller's come back then.
    previous = ({name: signal.getsignal(signal.Signals[name]) for name in handled}
                if threading.current_thread() is threading.main_thread() else {})
    env_backup = os.environ.get("OMP_NUM_THREADS")
    if env_backup is None:
        # As torchrun does: the workers share the cores, so each gets its share of intra-op threads.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nprocs))
    # Sent as one pickled blob: torch.multiprocessing would pass tensors through shared memory, which
    # containers often limit (a small /dev/shm); plain pickling copies them.
    blob = pickle.dumps((fn, tuple(args)))
    try:
        # The caller's start method, or the platform's default ("the first is the default"), read without fixing it.
        start_method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
        results = elastic_launch(config, _call_pickled)(blob, start_method)
    except ChildFailedError as exc:
        raise _launch_error(exc) from exc
    except SignalException as exc:  # passed on to the workers, which stop with a checkpoint
        raise TrainingInterrupted(f"training stopped on {exc.sigval.name}: the workers were asked to stop after "
                                  f"their step in flight and write a checkpoint") from None
    finally:
        if env_backup is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        for name, handler in previous.items():
            if handler is not None:  # None: one set outside Python, which cannot be put back
                signal.signal(signal.Signals[name], handler)
    stopped = [r for r in results.values() if isinstance(r, _Stopped)]
    if stopped:
        raise TrainingInterrupted(stopped[0].message)
    return results[0]
