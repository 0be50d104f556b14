"""The seeds of a distributed run's random generators, per rank and epoch."""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["epoch_seed", "seed_everything"]


def epoch_seed(seed: int, rank: int, epoch: int) -> int:
    """The seed of rank ``rank``'s random generators for epoch ``epoch`` of a
    distributed run (data augmentation, dropout): derived from all three, so it
    differs per rank and per epoch and a resumed run re-derives it."""
    return int(np.random.SeedSequence([int(seed), int(rank), int(epoch)]).generate_state(1, dtype=np.uint32)[0])


def seed_everything(value: int) -> None:
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % 2**32)
