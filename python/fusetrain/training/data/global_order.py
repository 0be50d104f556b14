"""The training data's order, defined over the whole dataset and independent
of the number of processes.

NOTE [global order]: an epoch's order is a permutation of the dataset drawn
from ``(seed, epoch)`` alone (the identity without shuffling). Optimizer
step ``s`` of the epoch trains on positions ``[s * G, (s + 1) * G)`` of it,
``G = batch_size * batch_accumulate * world_size`` the global batch; rank
``r`` of ``W`` takes positions ``r, r + W, r + 2W, ...``, so micro-batch
``m`` of every rank together covers ``[m * B * W, (m + 1) * B * W)``. With
``drop_last`` the order is cut to whole global batches; without, it is
padded with its first samples to a multiple of ``W`` so that every rank has
as many batches (as ``DistributedSampler`` does). Resumed on ``W'``
processes with ``B' * A' * W' == G``, the same position continues the same
global batches: no sample is skipped or repeated.

Each sample is loaded with the random generators (torch, NumPy, Python)
seeded from ``(seed, epoch, index)`` (in the training process, restored
afterwards), so a random augmentation of sample ``index`` in epoch ``epoch``
is the same whichever rank or DataLoader worker loads it, and loading does
not move the training process's own random streams (dropout).
"""

from __future__ import annotations

import random
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["GlobalOrderSampler", "SeededSamples", "sample_seed"]


_MASK = 2**64 - 1


def _mix(x: int) -> int:
    """A 64-bit finalizer (splitmix64's): nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed (32 bits) of sample ``index``'s random draws in epoch ``epoch``."""
    return _mix(_mix(_mix(int(seed)) ^ int(epoch)) ^ int(index)) & 0xFFFFFFFF


class SeededSamples(torch.utils.data.Dataset):
    """A map-style dataset read by ``(epoch, index)`` keys: item ``index`` of
    ``dataset``, loaded with the random generators seeded by
    :func:`sample_seed` (NOTE [global order]). A batch is read with one save
    and restore of the generators (``__getitems__``); in a DataLoader worker,
    whose generators serve only the loading, with none."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, int(seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def _load(self, key: Tuple[int, int]) -> Any:
        epoch, index = key
        s = sample_seed(self.seed, epoch, index)
        torch.default_generator.manual_seed(s)
        np.random.seed(s)
        random.seed(s)
        return self.dataset[index]

    def __getitems__(self, keys: List[Tuple[int, int]]) -> List[Any]:
        if torch.utils.data.get_worker_info() is not None:
            return [self._load(k) for k in keys]
        saved = torch.default_generator.get_state(), np.random.get_state(), random.getstate()
        try:
            return [self._load(k) for k in keys]
        finally:
            torch.default_generator.set_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])

    def __getitem__(self, key: Tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]


class GlobalOrderSampler(torch.utils.data.Sampler):
    """Rank ``rank``'s share of each epoch's global order (NOTE [global
    order]), as ``(epoch, index)`` keys of :class:`SeededSamples`."""

    def __init__(self, n: int, world_size: int, rank: int, shuffle: bool, seed: int, drop_last: bool,
                 global_batch: int) -> None:
        self.n, self.world_size, self.rank = n, world_size, rank
        self.shuffle, self.seed, self.drop_last, self.global_batch = shuffle, int(seed), drop_last, global_batch
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: Optional[int] = None) -> List[int]:
        """The epoch's global order (cut or padded as NOTE [global order] says)."""
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        if self.drop_last:
            return order[:self.n // self.global_batch * self.global_batch]
        pad = -len(order) % self.world_size
        while pad > 0:
            order += order[:pad]
            pad = -len(order) % self.world_size
        return order

    def _length(self) -> int:
        if self.drop_last:
            return self.n // self.global_batch * self.global_batch
        return -(-self.n // self.world_size) * self.world_size

    def __iter__(self) -> Iterator[Tuple[int, int]]:
        epoch = self.epoch
        return iter([(epoch, i) for i in self.order()[self.rank::self.world_size]])

    def __len__(self) -> int:
        return self._length() // self.world_size
