"""Where a run is inside an epoch: what a mid-epoch checkpoint records, and
the iterator that continues an epoch from it.

NOTE [mid-epoch resume]: an epoch's data order is drawn when its iterator is
made (the DataLoader's worker base seed, then the sampler's permutation at
the first batch), from the random states of that moment. A mid-epoch
checkpoint stores, for each rank, those states, the number of batches
trained on, the epoch's running sums (loss, its components, train metrics,
samples) and the random states of the moment of the checkpoint. A resume
sets the epoch-start states, makes the iterator again, makes it draw what it
draws at the start of an epoch, skips the batches already trained on, and
then sets the checkpoint's states: every later batch, random augmentation
and dropout mask is the one the uninterrupted run would have had. On
another number of processes the position is one in the epoch's global order
instead (NOTE [resume on another process count]).
"""

from __future__ import annotations

import random
from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np
import torch

from ..distributed.sharding import _loader_kwargs

__all__ = ["EpochPosition", "rng_state", "set_rng_state", "numpy_state_as_data", "resume_iterator",
           "can_skip_in_sampler"]


def numpy_state_as_data(state: Any) -> Dict[str, Any]:
    """A NumPy random state ``(name, keys, pos, has_gauss, gauss)`` as data (NOTE [checkpoints are data]):
    its keys as a tensor."""
    name, key, pos, has_gauss, gauss = state
    return {"name": name, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def _set_numpy_state(state: Any) -> None:
    if isinstance(state, dict):
        state = (state["name"], state["key"].numpy().astype(np.uint32), state["pos"], state["has_gauss"],
                 state["gauss"])
    np.random.set_state(state)  # a tuple: a trusted checkpoint of an older fusetrain


def rng_state(loader: Any) -> Dict[str, Any]:
    """The random states of this process (torch CPU and CUDA, NumPy, Python, the loader's generator)."""
    gen = getattr(loader, "generator", None)
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": numpy_state_as_data(np.random.get_state()), "python": random.getstate(),
            "loader": gen.get_state() if isinstance(gen, torch.Generator) else None}


def set_rng_state(state: Dict[str, Any], loader: Any) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    _set_numpy_state(state["numpy"])
    random.setstate(state["python"])
    gen = getattr(loader, "generator", None)
    if state.get("loader") is not None and isinstance(gen, torch.Generator):
        gen.set_state(state["loader"])


class _SkipBatches:
    """A batch sampler that leaves out the first ``n`` batches of another,
    without loading them. It starts the inner sampler at the first ``next``
    (when the epoch's iterator would) or at :meth:`start`; single use."""

    def __init__(self, batch_sampler: Any, n: int) -> None:
        self.batch_sampler, self.n = batch_sampler, n
        self._it: Optional[Iterator] = None

    def start(self) -> None:
        if self._it is None:
            self._it = iter(self.batch_sampler)
            for _ in range(self.n):
                next(self._it)

    def __iter__(self) -> "_SkipBatches":
        return self

    def __next__(self) -> Any:
        self.start()
        return next(self._it)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.n)


def can_skip_in_sampler(loader: Any) -> bool:
    """A plain torch DataLoader over a map-style dataset with a batch sampler."""
    from torch.utils.data import DataLoader, IterableDataset

    return (type(loader) is DataLoader and not isinstance(loader.dataset, IterableDataset)
            and loader.batch_sampler is not None)


def resume_iterator(loader: Any, batches: int, mode: str) -> Iterator:
    """An iterator over ``loader`` that has made the epoch's start-of-epoch
    random draws and is positioned after its first ``batches`` batches
    (``mode``: ``fast`` skips them in the batch sampler when the loader
    allows it, ``replay`` loads and drops them). NOTE [mid-epoch resume]."""
    from torch.utils.data import DataLoader

    if mode == "fast" and can_skip_in_sampler(loader):
        sampler = _SkipBatches(loader.batch_sampler, batches)
        kw = {k: v for k, v in _loader_kwargs(loader).items() if k not in ("batch_size", "drop_last")}
        for k in ("pin_memory_device", "in_order"):
            if hasattr(loader, k):
                kw[k] = getattr(loader, k)
        it = iter(DataLoader(loader.dataset, batch_sampler=sampler, **kw))
        try:
            sampler.start()
        except StopIteration:
            raise ValueError(f"resume: the checkpoint was written after batch {batches} of its epoch, but the train "
                             f"loader now has only {len(loader.batch_sampler)} batches per epoch") from None
        return it
    it = iter(loader)
    for k in range(batches):
        try:
            next(it)
        except StopIteration:
            raise ValueError(f"resume: the checkpoint was written after batch {batches} of its epoch, but the train "
                             f"loader now ends after {k} batches") from None
    return it


class EpochPosition:
    """This rank's place in the epoch (NOTE [mid-epoch resume]): the random states before the epoch's iterator
    and the epoch's first optimizer step, kept for mid-epoch checkpoints, and a resumed position to continue
    from (:meth:`resume_at`, given by the checkpoint's owner)."""

    def __init__(self, loader: Any, resume_skip: str) -> None:
        self.loader, self.resume_skip = loader, resume_skip
        self.rng_start: Optional[Dict[str, Any]] = None
        self.step0 = 0  # optimizer steps done when the epoch began
        self._resumed: Optional[Dict[str, Any]] = None

    def resume_at(self, position: Optional[Dict[str, Any]]) -> None:
        """This rank's part of a mid-epoch checkpoint's position (None: the checkpoint is an epoch end's)."""
        self._resumed = position

    def begin(self, global_step: int, sums: Any, train_metrics: Any) -> Tuple[Iterator, int, int]:
        """The epoch's batch iterator, and the batches and samples already trained on: a resumed position makes
        the iterator from its epoch-start states, skips its batches, and loads its running sums and states."""
        at, self._resumed = self._resumed, None
        if at is not None and at["rng_start"] is not None:  # None: another number of processes (their states
            set_rng_state(at["rng_start"], self.loader)      # belong to the old ranks' shards)
        self.rng_start, self.step0 = rng_state(self.loader), global_step
        if at is None:
            return iter(self.loader), 0, 0
        batch_iter = resume_iterator(self.loader, at["batches"], self.resume_skip)
        self.step0 = at["step0"]
        if at["sums"] is not None:  # on another number of processes, rank 0 holds the old ranks' sums
            sums.load_state_dict(at["sums"])
            train_metrics.load_state_dict(at["train_metrics"])
        if at["rng"] is not None:
            set_rng_state(at["rng"], self.loader)
        return batch_iter, at["batches"], at["samples"]

    def here(self, batches: int, samples: int, sums: Any, train_metrics: Any) -> Dict[str, Any]:
        """This rank's entry of a mid-epoch checkpoint's position after ``batches`` batches."""
        return {"rng_start": self.rng_start, "rng": rng_state(self.loader), "sums": sums.state_dict(),
                "train_metrics": train_metrics.state_dict(), "samples": samples}
