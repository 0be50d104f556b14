"""Run a function in several CPU processes joined by a gloo process group.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes on
127.0.0.1 with a free port, calls ``fn(rank, world_size, *args)`` in each after
``init_process_group("gloo")``, and re-raises the first failure (with the
child's traceback) in the caller. ``fn`` must be importable (module level).
"""

from __future__ import annotations

import os
import socket

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


def _worker(rank, world_size, port, fn, args):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int = 2, *args, timeout: float = 120.0) -> None:
    ctx = mp.spawn(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size, join=False)
    ctx_timeout = timeout
    while not ctx.join(timeout=ctx_timeout):
        pass
