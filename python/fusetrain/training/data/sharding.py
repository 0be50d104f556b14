"""Loaders of a distributed run: each rank reads its shard. The train loader
gets a ``DistributedSampler`` (re-wrapping a user DataLoader with the same
dataset, batch size, workers, collate_fn, ...), the validation loader an
exact :class:`ShardSampler` (no padding, so reduced means are exact)."""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional

import torch

from ..distributed import DistContext

__all__ = ["ShardSampler", "shard_train_loader", "shard_valid_loader", "set_epoch"]


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


def shard_train_loader(loader, ctx: DistContext, seed: int):
    """The train loader with a ``DistributedSampler`` (same batch size, workers,
    collate_fn, drop_last, pin_memory; shuffled if the loader shuffled, with
    ``seed``). A loader that already has one is returned as is; one that cannot
    be rebuilt (custom batch sampler, iterable dataset, not a DataLoader) too,
    with a warning: each rank must then see its own shard and the same number
    of batches."""
    from torch.utils.data import DataLoader, RandomSampler
    from torch.utils.data.distributed import DistributedSampler

    if not ctx.enabled:
        return loader
    if isinstance(getattr(loader, "sampler", None), DistributedSampler):
        return loader
    reason = _rewrap_reason(loader, "the train loader")
    if reason is not None:
        warnings.warn(f"distributed run: {reason}, so it is not re-wrapped with a DistributedSampler; each rank "
                      f"must load its own shard with the same number of batches", stacklevel=3)
        return loader
    shuffle = isinstance(loader.sampler, RandomSampler)
    sampler = DistributedSampler(loader.dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=shuffle,
                                 seed=seed, drop_last=loader.drop_last)
    return DataLoader(loader.dataset, sampler=sampler, **_loader_kwargs(loader))


def shard_valid_loader(loader, ctx: DistContext):
    """The validation loader restricted to this rank's :class:`ShardSampler`
    shard (a DistributedSampler already there is kept: its padding repeats a
    few samples)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    if not ctx.enabled or loader is None:
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
    return DataLoader(loader.dataset, sampler=ShardSampler(loader.dataset, ctx.world_size, ctx.rank), **kw)


def set_epoch(loader, epoch: int) -> None:
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None and batch_sampler is not sampler and hasattr(batch_sampler, "set_epoch"):
        batch_sampler.set_epoch(epoch)
