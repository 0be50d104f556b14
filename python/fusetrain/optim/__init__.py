"""Fused optimizers: drop-in replacements for torch.optim with the whole step
(unscale, non-finite skip, clipping, update, EMA) in fused kernels."""

from ._base import FusedOptimizer
from ._int8_state import full_precision_state_dict
from .adam import Adam, AdamW
from .lamb import AdamP, Lamb
from .lion import Lion
from .muon import Muon
from .nadam import NAdam
from .radam import RAdam
from .rmsprop import Adadelta, RMSprop, RMSpropTF
from .sgd import SGD

__all__ = ["Adam", "AdamW", "SGD", "Lion", "RMSprop", "Adadelta", "RAdam", "NAdam", "RMSpropTF", "Lamb", "AdamP", "Muon",
           "FusedOptimizer", "full_precision_state_dict"]
