"""Steps over sharded parameters (DTensor: FSDP2's ``fully_shard``, tensor
parallelism, HSDP).

NOTE [sharded steps]: the fused step runs on each rank's local shards (the
update is element-wise, or per shard for the ATen-stage optimizers' local
reductions); what must be global is what decides the step for every rank
together: the gradient norm that clipping divides by and the non-finite flag
that skips the step. Each rank measures its shards (one read-only stats pass),
weights each squared norm by 1 / (the number of ranks holding the same shard:
the product of the mesh sizes of its Replicate placements; for a plain tensor
among sharded ones, the world size), and one all-reduce of [squared norm,
flag] over the default process group gives every rank the same values, which
``fusetrain::fused_step_`` then takes as given (its ``grad_norm`` and
``found_inf``). Optimizer state, master weights and EMA copies are DTensors
sharded like their parameters (``full_like`` of a DTensor), so state dicts and
``torch.distributed.checkpoint`` see them as sharded.
"""

from __future__ import annotations

import sys
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import _ops


def _dtensor_class():
    """DTensor, or None when torch.distributed.tensor was never imported (it is
    heavy, and a program holding DTensors has imported it)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_sharded(t) -> bool:
    """Whether ``t`` is a DTensor."""
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(t, dtensor)


def local_fn():
    """A function giving the local shard of a DTensor (aliasing it: in-place
    updates reach the DTensor), or the tensor itself; the class is looked up
    once per step, not once per tensor."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return lambda t: t
    return lambda t: t.to_local() if isinstance(t, dtensor) else t


def copies(p: Tensor) -> int:
    """How many ranks hold the same elements as this rank's part of ``p``."""
    import torch.distributed as dist

    if not is_sharded(p):
        return dist.get_world_size()
    n = 1
    for dim, placement in enumerate(p.placements):
        if placement.is_partial():
            raise ValueError("fusetrain optimizers: a parameter's gradient has a Partial placement (not yet "
                             "reduced); step after the gradient reduction (FSDP2 reduces in backward)")
        if placement.is_replicate():
            n *= p.device_mesh.size(dim)
    return n


def local_stats(params: Sequence[Tensor], local_grads: Sequence[Tensor], inv_scale: Optional[Tensor],
                cache: Dict[int, int]) -> Tuple[Tensor, Tensor]:
    """This rank's share of the squared global norm (each shard's squared norm,
    unscaled by ``inv_scale``, over its ``copies``) and its non-finite flag:
    one stats pass per group of equal ``copies``. ``cache`` keeps each
    parameter's copies (by ``id``; the optimizer holds the parameters, so ids
    are not reused). The step plan computes the same in C++ (NOTE [step plan])."""
    by_copies: dict = {}
    for p, g in zip(params, local_grads):
        n = cache.get(id(p))
        if n is None:
            n = cache[id(p)] = copies(p)
        by_copies.setdefault(n, []).append(g)
    device = local_grads[0].device
    sq = torch.zeros((), dtype=torch.float32, device=device)
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for n, grads in by_copies.items():
        norm, f = _ops.grad_stats(grads, inv_scale)
        sq = sq + norm * norm / n
        flag = torch.maximum(flag, f)
    return sq, flag


def reduce_stats(sq: Tensor, flag: Tensor, found_inf: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """The global gradient norm and non-finite flag (0-d float32 tensors on
    ``sq``'s device) from every rank's ``local_stats``: one all-reduce."""
    import torch.distributed as dist

    if found_inf is not None:
        flag = torch.maximum(flag, found_inf.to(flag.device))
    both = torch.stack([sq, flag])
    dist.all_reduce(both)
    return both[0].clamp_min(0).sqrt(), (both[1] > 0).to(torch.float32)
