"""The training step: :class:`TrainStep` runs forward, loss, backward and the
fused optimizer tail as one callable, eagerly, compiled with ``torch.compile``
or captured as CUDA graphs (:mod:`.train_step`)."""

from .train_step import MODES, TrainStep

__all__ = ["MODES", "TrainStep"]
