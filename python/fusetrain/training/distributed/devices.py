"""Which devices and how many processes a run uses: the checks of the GPU
request (``num_gpus``, ``num_processes``, ``device``), how many workers the
Trainer starts itself (:func:`workers_to_launch`), and :func:`setup`, which
joins (or creates) the process group and picks this process's device."""

from __future__ import annotations

import datetime
import os
from typing import Any, Dict, Tuple

import torch

from .context import DistContext, env_world, launched_by_launcher

__all__ = ["check_gpu_request", "workers_to_launch", "setup", "single_device"]


# ---- validation of the distributed training_params ---------------------------------------------------------------


def _params_error(message: str) -> Exception:
    from ..params import TrainingParamsError

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
        raise _params_error(f"training_params.multi_gpu: got {p.multi_gpu!r} on the CPU (no CUDA device "
                            f"available) without num_processes; allowed: set num_processes to the number of CPU "
                            f"processes, or use multi_gpu 'off'/'auto'")
    return p.num_processes


def _target_is_cuda(device_spec: str) -> bool:
    if device_spec == "auto":
        return torch.cuda.is_available()
    return device_spec.startswith("cuda")


# ---- process group -----------------------------------------------------------------------------------------------


def setup(p) -> Tuple[DistContext, torch.device]:
    """Join (or create) the process group for training params ``p``; returns the
    state and this process's training device."""
    import torch.distributed as dist

    rank, world, local_rank = env_world()
    if world <= 1:
        return DistContext(timeout_s=p.dist_timeout_s), single_device(p.device)
    if p.multi_gpu == "off":
        raise _params_error(f"training_params.multi_gpu: got 'off' but this process is rank {rank} of {world} "
                            f"(started by a launcher: WORLD_SIZE={world}); allowed here: 'auto', 'ddp' or 'fsdp' "
                            f"(or start a single process)")
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
        timeout = datetime.timedelta(seconds=p.dist_timeout_s)
        from .preemption import restart_store

        kwargs.update(restart_store(rank, world, timeout))
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
        owns = True
    state = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                        backend=str(backend), owns_group=owns, timeout_s=p.dist_timeout_s, fsdp=p.multi_gpu == "fsdp")
    return state, device


def single_device(spec: str) -> torch.device:
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
