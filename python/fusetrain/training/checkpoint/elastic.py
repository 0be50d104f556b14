"""A resume on another number of processes than the checkpoint's: the global
batch kept, and the position in the epoch's global order.

NOTE [resume on another process count]: every checkpoint records its run's
data order (``data_order``: whether the train loader read the global order of
NOTE [global order], its seed, ``batch_size`` per process,
``batch_accumulate`` and ``world_size``). A resume on ``W'`` processes keeps
the global batch ``G = batch_size * batch_accumulate * world_size``: when the
new values do not give ``G``, ``batch_accumulate`` becomes
``G / (batch_size * W')`` (the per-process batch kept, so the memory per
process stays), else the per-process batch becomes
``G / (batch_accumulate * W')``; when neither divides, a mid-epoch checkpoint
is refused and an epoch-end one continues with the new global batch (a
warning). A mid-epoch position is ``batches * batch_size * world_size``
samples of the epoch's global order; the resumed ranks skip that many
(``batches`` of their new size), rank 0 takes the epoch's running sums of all
the old ranks, and the random states start from the seed, the rank and the
epoch (those of the old ranks belong to their shards). The weights,
optimizer, EMA and scaler load as at any resume (a sharded run's through
``torch.distributed.checkpoint``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..._warnings import warn
from ..distributed.sharding import global_order_reason, order_seed
from ..params import TrainingParams

__all__ = ["DataPlan", "plan", "data_order_record", "rank_position"]


@dataclass(frozen=True)
class DataPlan:
    """How this run reads its data: the params (``batch_accumulate`` and ``max_train_batches`` as kept for the
    global batch), the per-process batch size (None: the loader's), the order's seed, and what changed (a line for
    the log, or "")."""

    params: TrainingParams
    batch_size: Optional[int]
    seed: int
    note: str = ""
    changed: Tuple[str, ...] = ()  # the training_params keys changed to keep the global batch


def data_order_record(loader: Any, p: TrainingParams, world_size: int) -> Dict[str, Any]:
    """What a checkpoint records of its run's data order (NOTE [resume on another process count])."""
    from ..distributed.global_order import GlobalOrderSampler

    sampler = getattr(loader, "sampler", None)
    glob = isinstance(sampler, GlobalOrderSampler)
    return {"global": glob, "seed": sampler.seed if glob else None,
            "batch_size": getattr(loader, "batch_size", None), "batch_accumulate": p.batch_accumulate,
            "world_size": world_size}


def _same_processes_text(ck: Dict[str, Any], path: str, why: str) -> str:
    n, epoch = ck.get("world_size", 1), ck["position"]["epoch"]
    return (f"resume: {path} was written in the middle of epoch {epoch + 1} by {n} process(es) and {why}; allowed: "
            f"resume it with {n} process(es), or resume from a checkpoint written at an epoch end")


def plan(ck: Optional[Dict[str, Any]], path: Optional[str], p: TrainingParams, loader: Any,
         world: int) -> DataPlan:
    """The data plan of a run on ``world`` processes, resuming ``ck`` (None: a fresh run). Raises ValueError for
    a mid-epoch checkpoint whose global batch or position cannot be kept (before anything is written)."""
    fresh = DataPlan(p, None, order_seed(loader, p.seed))
    if ck is None:
        return fresh
    rec, mid = ck.get("data_order"), ck.get("position") is not None
    seed = rec["seed"] if rec and rec.get("seed") is not None else fresh.seed
    old_world = int(ck.get("world_size", 1))
    if world == old_world:
        return DataPlan(p, None, seed)
    reason = global_order_reason(loader)
    if not rec or not rec.get("global") or reason is not None:
        if mid:
            why = (f"{reason}, so it cannot read the global order" if reason is not None else
                   "its train loader did not read the global order (the position belongs to each process's shard)")
            raise ValueError(_same_processes_text(ck, path, why))
        return DataPlan(p, None, seed)
    b_old, a_old = int(rec["batch_size"]), int(rec["batch_accumulate"])
    g = b_old * a_old * old_world
    b, a = int(loader.batch_size), p.batch_accumulate
    if b * a * world == g:
        return DataPlan(p, None, seed)
    was = (f"batch_size {b_old} x batch_accumulate {a_old} x {old_world} process(es) = global batch {g}")
    if g % (b * world) == 0:
        a_new = g // (b * world)
        changes: Dict[str, Any] = {"batch_accumulate": a_new}
        if p.max_train_batches:  # micro-batches per process per epoch scale with the accumulation
            if p.max_train_batches * a_new % a:
                return _refuse_or_warn(ck, path, p, seed, mid, was, world, b, a,
                                       f"max_train_batches {p.max_train_batches} does not scale to it")
            changes["max_train_batches"] = p.max_train_batches * a_new // a
        note = (f"resume on {world} process(es): {path} was trained with {was}; batch_accumulate {a_new} keeps it "
                f"(batch_size {b} per process)")
        return DataPlan(p.replace(**changes), None, seed, note, tuple(changes))
    if g % (a * world) == 0:
        b_new = g // (a * world)
        note = (f"resume on {world} process(es): {path} was trained with {was}; batch_size {b_new} per process "
                f"keeps it (batch_accumulate {a})")
        return DataPlan(p, b_new, seed, note)
    return _refuse_or_warn(ck, path, p, seed, mid, was, world, b, a, "")


def _refuse_or_warn(ck, path, p, seed, mid, was, world, b, a, extra) -> DataPlan:
    text = (f"resume on {world} process(es): {path} was trained with {was}, which neither batch_accumulate "
            f"(batch_size {b} per process) nor the per-process batch (batch_accumulate {a}) can keep on {world} "
            f"process(es){'; ' + extra if extra else ''}")
    if mid:
        raise ValueError(f"{text}; allowed: a process count that divides the global batch together with "
                         f"batch_size or batch_accumulate, or a checkpoint written at an epoch end")
    warn(f"{text}: training goes on with the global batch {b * a * world}")
    return DataPlan(p, None, seed)


def _summed(states: List[Any]) -> Any:
    """The element-wise sum of the ranks' running sums (tensors summed, other values from the first)."""
    first = states[0]
    if isinstance(first, torch.Tensor):
        return sum(states[1:], first.clone())
    if isinstance(first, dict):
        return {k: _summed([s[k] for s in states]) for k in first}
    if isinstance(first, (list, tuple)):
        longest = max(len(s) for s in states)
        if any(len(s) != longest for s in states):  # a metric with no state yet on some rank
            states = [s for s in states if len(s) == longest]
        return type(first)(_summed([s[i] for s in states]) for i in range(longest)) if states else first
    return first


def rank_position(ck: Dict[str, Any], ctx: Any, path: str, batch_size: Optional[int]) -> Optional[Dict[str, Any]]:
    """This rank's part of the checkpoint's mid-epoch position (NOTE [mid-epoch resume]), or None; on another
    number of processes, the position in the global order for a rank of ``batch_size`` samples per batch
    (NOTE [resume on another process count])."""
    position = ck.get("position")
    if position is None:
        return None
    ranks, common = position["ranks"], {k: v for k, v in position.items() if k != "ranks"}
    if len(ranks) == ctx.world_size:
        return {**ranks[ctx.rank], **common}
    rec = ck.get("data_order")
    if not rec or not rec.get("global") or not batch_size:
        raise ValueError(_same_processes_text({**ck, "world_size": len(ranks)}, path,
                                              "its train loader did not read the global order"))
    samples = position["batches"] * int(rec["batch_size"]) * len(ranks)
    per_batch = batch_size * ctx.world_size
    if samples % per_batch:
        raise ValueError(f"resume: the position of {path} ({samples} samples into epoch {position['epoch'] + 1}) "
                         f"is not a whole number of batches of {batch_size} x {ctx.world_size} process(es)")
    main = ctx.rank == 0
    return {**common, "batches": samples // per_batch, "rng_start": None, "rng": None,
            "sums": _summed([r["sums"] for r in ranks]) if main else None,
            "train_metrics": _summed([r["train_metrics"] for r in ranks]) if main else None,
            "samples": sum(r["samples"] for r in ranks) if main else 0}
