"""Run a function in several CPU processes joined by a gloo process group
(or, with ``backend="nccl"``, one process per CUDA GPU, rank r on cuda:r).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes,
calls ``fn(rank, world_size, *args)`` in each after ``init_process_group("gloo")``,
and re-raises the first failure (with the child's traceback) in the caller.
``fn`` must be importable (module level).

The ranks meet through a file store in a fresh temporary directory, not a TCP
store: no port to pick (and race for), and no store server thread in rank 0,
which could abort rank 0 at exit ("terminate called without an active
exception") while another rank was still tearing down. Each rank passes a
barrier before destroying the process group, so no collective is in flight.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GLOO_AVAILABLE = dist.is_available() and dist.is_gloo_available()
requires_gloo = pytest.mark.skipif(not GLOO_AVAILABLE, reason="torch.distributed with the gloo backend is not available")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, store_file, fn, args, backend="gloo"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    ok = False
    try:
        fn(rank, world_size, *args)
        ok = True
    finally:
        if ok:
            dist.barrier()  # a failed rank skips it: the others then fail on their own collective
        dist.destroy_process_group()
    exit_now()


def exit_now() -> None:
    """End a worker process that finished its work, skipping the interpreter's
    teardown. NOTE [exit after success]: a process whose last collective ran
    on gloo with tensors made in Python (FSDP2's, the step's norm) sometimes
    aborts in that teardown ("terminate called without an active exception",
    1 run in 10 to 30 on 2 cores), which mp.spawn reports as a failure: a gloo
    worker thread drops its last reference to the finished work, and so to
    those tensors, after the main thread has begun finalizing; freeing their
    Python objects needs the GIL, and a thread that asks for it then is ended
    by pthread_exit, whose unwinding through a noexcept frame calls
    std::terminate (backtrace: ProcessGroupGloo::runLoop ->
    TensorImpl::decref_pyobject -> PyEval_AcquireThread). A barrier as the last
    collective (its work holds no Python tensors) avoids it, as the Trainer's
    teardown does (training/distributed.py); these workers exit directly."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int = 2, *args, timeout: float = 120.0, backend: str = "gloo") -> None:
    with tempfile.TemporaryDirectory(prefix="fusetrain-dist-") as tmp:
        ctx = mp.spawn(_worker, args=(world_size, os.path.join(tmp, "store"), fn, args, backend), nprocs=world_size,
                       join=False)
        while not ctx.join(timeout=timeout):
            pass
