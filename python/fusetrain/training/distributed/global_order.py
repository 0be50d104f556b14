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

Each sample is loaded with the random generators it draws from (torch's
default generator, NumPy's global one, Python's ``random``) seeded from
``(seed, epoch, index)``, so a random augmentation of sample ``index`` in
epoch ``epoch`` is the same whichever rank or DataLoader worker loads it; in
the training process the seeded generators are restored after each batch, so
loading does not move the training process's own random streams (dropout).

Which generators are seeded (NOTE [seeded generators]): those a dataset
declares in its ``random_generators`` attribute (a tuple of ``"torch"``,
``"numpy"``, ``"random"``; ``()`` for none), else those it is seen to draw
from. Every batch, the generators not yet known to be drawn from are
fingerprinted before and after the load; one that moved is marked as drawn
from and the whole batch is loaded again with it seeded. A dataset that draws
nothing pays the fingerprints (a few microseconds a batch), one that draws
pays the seeding of what it draws from (a few microseconds a sample). A custom
dataset keeps the guarantee when it draws only from those three generators
(or from generators it seeds from them) and loading a sample twice gives the
same sample (no side effects); one that draws from a generator of its own
(``numpy.random.default_rng()`` made once, say) draws a stream that depends
on what the process loaded before, whatever fusetrain does.
"""

from __future__ import annotations

import ctypes
import random
import struct
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["GENERATORS", "GlobalOrderSampler", "SeededSamples", "declared_generators", "sample_seed"]


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


#: The global random generators a sample's load may draw from (NOTE [seeded generators]).
GENERATORS = ("torch", "numpy", "random")

_NP_STATE_BYTES = 624 * 4 + 4  # MT19937's key words and position: the head of numpy's mt19937_state


def _np_mark() -> bytes:
    return ctypes.string_at(np.random.mtrand._rand._bit_generator.ctypes.state_address, _NP_STATE_BYTES)


def _np_restore_mark(mark: bytes) -> None:
    # A Gaussian NumPy had cached is not in the mark; it is dropped (the next one is drawn afresh).
    np.random.set_state(("MT19937", np.frombuffer(mark[:-4], dtype=np.uint32),
                         int.from_bytes(mark[-4:], "little", signed=True)))


def _random_layout_holds() -> bool:
    """Whether a Random object's memory holds its index and words right after the object header, as CPython's
    ``RandomObject`` does (checked on a private generator against ``getstate``)."""
    try:
        r = random.Random(12345)
        r.random()
        words = struct.unpack(_RANDOM_FORMAT, ctypes.string_at(id(r) + object.__basicsize__, _RANDOM_BYTES))
        st = r.getstate()
        return words[0] == st[1][-1] and words[1:] == st[1][:-1]
    except Exception:
        return False


_RANDOM_FORMAT, _RANDOM_BYTES = "=i624I", 4 + 624 * 4  # RandomObject's index and state words
_RANDOM = random.random.__self__  # the generator behind the random module's functions
_RANDOM_RAW = _random_layout_holds()


def _random_mark() -> Any:
    # Read in place where the layout holds (a microsecond; getstate builds a 625-tuple: 30 us).
    if _RANDOM_RAW:
        return ctypes.string_at(id(_RANDOM) + object.__basicsize__, _RANDOM_BYTES), _RANDOM.gauss_next
    return random.getstate()


def _random_restore_mark(mark: Any) -> None:
    if not _RANDOM_RAW:
        random.setstate(mark)
        return
    words = struct.unpack(_RANDOM_FORMAT, mark[0])
    random.setstate((random.Random.VERSION, words[1:] + words[:1], mark[1]))


# name -> (seed, save, restore, mark, moved(mark_before, mark_after), restore from a mark); a mark is a
# cheap fingerprint that changes when the generator is drawn from.
_STREAMS = {
    "torch": (torch.default_generator.manual_seed, torch.default_generator.get_state,
              torch.default_generator.set_state, lambda: torch.default_generator.get_state().numpy().tobytes(),
              lambda a, b: a != b,
              lambda m: torch.default_generator.set_state(torch.frombuffer(bytearray(m), dtype=torch.uint8))),
    "numpy": (np.random.seed, np.random.get_state, np.random.set_state, _np_mark, lambda a, b: a != b,
              _np_restore_mark),
    "random": (random.seed, random.getstate, random.setstate, _random_mark, lambda a, b: a != b,
               _random_restore_mark),
}


def declared_generators(dataset: Any) -> Optional[Tuple[str, ...]]:
    """A dataset's ``random_generators`` (NOTE [seeded generators]), checked; None when it declares none."""
    names = getattr(dataset, "random_generators", None)
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, (tuple, list, set, frozenset)) or \
            any(n not in GENERATORS for n in names):
        raise ValueError(f"{type(dataset).__name__}.random_generators: got {names!r}; allowed: a tuple of "
                         f"{', '.join(repr(g) for g in GENERATORS)} (the global generators its samples draw from; "
                         f"() for none)")
    return tuple(n for n in GENERATORS if n in names)


class SeededSamples(torch.utils.data.Dataset):
    """A map-style dataset read by ``(epoch, index)`` keys: item ``index`` of
    ``dataset``, loaded with the random generators it draws from seeded by
    :func:`sample_seed` (NOTE [global order], NOTE [seeded generators]). A
    batch is read with one save and restore of the seeded generators
    (``__getitems__``); in a DataLoader worker, whose generators serve only
    the loading, with none."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, int(seed)
        declared = declared_generators(dataset)
        self.seeded: Tuple[str, ...] = declared or ()  # seeded for every sample
        self.watched: Tuple[str, ...] = () if declared is not None else GENERATORS  # not yet seen drawn from
        self._epoch_mix = (None, 0)  # (epoch, the epoch's part of sample_seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def _sample_seed(self, epoch: int, index: int) -> int:
        if self._epoch_mix[0] != epoch:
            self._epoch_mix = (epoch, _mix(_mix(self.seed) ^ int(epoch)))
        return _mix(self._epoch_mix[1] ^ int(index)) & 0xFFFFFFFF

    def _load(self, keys: List[Tuple[int, int]]) -> List[Any]:
        seeders = [_STREAMS[n][0] for n in self.seeded]
        if not seeders and hasattr(self.dataset, "__getitems__"):
            return self.dataset.__getitems__([index for _, index in keys])
        out = []
        for epoch, index in keys:
            if seeders:
                s = self._sample_seed(epoch, index)
                for seed in seeders:
                    seed(s)
            out.append(self.dataset[index])
        return out

    def __getitems__(self, keys: List[Tuple[int, int]]) -> List[Any]:
        main = torch.utils.data.get_worker_info() is None
        saved = [(n, _STREAMS[n][1]()) for n in self.seeded] if main else []
        marks: List[Tuple[str, Any]] = []
        try:
            while True:
                before = [(n, _STREAMS[n][3]()) for n in self.watched]
                items = self._load(keys)
                moved = [(n, m) for n, m in before if _STREAMS[n][4](m, _STREAMS[n][3]())]
                if not moved:
                    return items
                # Drawn from unseeded: seed it from now on and load the batch again (NOTE [seeded generators]).
                names = {n for n, _ in moved}
                self.seeded = tuple(n for n in GENERATORS if n in names or n in self.seeded)
                self.watched = tuple(n for n in self.watched if n not in names)
                marks += moved
        finally:
            if main:
                for n, state in saved:
                    _STREAMS[n][2](state)
                for n, mark in marks:
                    _STREAMS[n][5](mark)

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
