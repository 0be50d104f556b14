"""Loaders of a run: the train loader reads the global order (NOTE [global
order]; re-wrapping a user DataLoader with the same dataset, workers,
collate_fn, ..., in a distributed run and a single process alike), each rank
its share of it; in a distributed run the validation loader reads an exact
:class:`ShardSampler` shard (no padding, so reduced means are exact)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch.utils.data.distributed import DistributedSampler

from ..._warnings import warn
from .context import DistContext
from .global_order import GlobalOrderSampler, SeededSamples

__all__ = ["ShardSampler", "shard_train_loader", "shard_valid_loader", "set_epoch", "global_order_reason",
           "order_seed"]


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


def _order_of(loader) -> Optional[Tuple[bool, Optional[int]]]:
    """``(shuffle, seed or None)`` of a loader whose sampler is a plain permutation or sequence, else None."""
    from torch.utils.data import RandomSampler, SequentialSampler

    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        return sampler.shuffle, sampler.seed
    if type(sampler) is SequentialSampler:
        return False, None
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        return True, None
    return None


def global_order_reason(loader) -> Optional[str]:
    """Why the train loader cannot read the global order (NOTE [global order]), or None when it can."""
    reason = _rewrap_reason(loader, "the train loader")
    if reason is None and _order_of(loader) is None:
        reason = f"the train loader has a custom sampler ({type(loader.sampler).__name__})"
    return reason


def order_seed(loader, seed: int) -> int:
    """The seed of the global order: a DistributedSampler's, else the loader's own generator's initial seed
    (``dataset_params.seed`` in a recipe), else ``seed`` (``training_params.seed``)."""
    found = _order_of(loader) if global_order_reason(loader) is None else None
    if found is not None and found[1] is not None:
        return int(found[1])
    gen = getattr(loader, "generator", None)
    return int(gen.initial_seed()) if isinstance(gen, torch.Generator) else int(seed)


def shard_train_loader(loader, ctx: DistContext, seed: int, batch_size: Optional[int] = None,
                       accumulate: int = 1):
    """The train loader over this rank's share of the global order (NOTE [global order]; same workers,
    collate_fn, pin_memory; shuffled if the loader shuffled, with ``seed``; ``batch_size`` per process, default
    the loader's). A loader that cannot be rebuilt (custom sampler or batch sampler, iterable dataset, not a
    DataLoader) is returned as is, in a distributed run with a warning: each rank must then see its own shard
    and the same number of batches."""
    from torch.utils.data import DataLoader

    reason = global_order_reason(loader)
    if reason is not None:
        if ctx.enabled and not isinstance(getattr(loader, "sampler", None), DistributedSampler):
            warn(f"distributed run: {reason}, so it is not re-wrapped to read its share of the global "
                 f"order; each rank must load its own shard with the same number of batches")
        return loader
    shuffle, _ = _order_of(loader)
    batch_size = batch_size or loader.batch_size
    sampler = GlobalOrderSampler(len(loader.dataset), ctx.world_size, ctx.rank, shuffle, seed, loader.drop_last,
                                 batch_size * accumulate * ctx.world_size)
    kw = dict(_loader_kwargs(loader), batch_size=batch_size, drop_last=False)  # the order is cut already
    return DataLoader(SeededSamples(loader.dataset, seed), sampler=sampler, **kw)


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
        warn(f"distributed run: {reason}, so it is not sharded; every rank validates on what it loads "
             f"and the sums are added up across ranks")
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
