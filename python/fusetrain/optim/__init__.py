"""Fused optimizers: drop-in replacements for torch.optim with the whole step
(unscale, non-finite skip, clipping, update, EMA) in fused kernels. Each is
an entry of the optimizer table (_table.py, NOTE [optimizer table])."""

from types import MappingProxyType

from ._base import FusedOptimizer
from ._int8_state import full_precision_state_dict
from ._table import CLASSES as _CLASSES
from .adam import Adam, AdamW
from .lamb import AdamP, Lamb
from .lion import Lion
from .muon import Muon
from .nadam import NAdam
from .radam import RAdam
from .rmsprop import Adadelta, RMSprop, RMSpropTF
from .sgd import SGD

__all__ = ["Adam", "AdamW", "SGD", "Lion", "RMSprop", "Adadelta", "RAdam", "NAdam", "RMSpropTF", "Lamb", "AdamP", "Muon",
           "FusedOptimizer", "full_precision_state_dict", "OPTIMIZERS"]


def _optimizers():
    missing = [name for name in _CLASSES if name not in __all__ or name not in globals()]
    if missing:
        raise ImportError(f"fusetrain.optim: the optimizer table declares {missing} but the package does not export "
                          "them: add each class (python/fusetrain/optim/<name>.py) to __init__.py")
    return MappingProxyType({name: globals()[name] for name in _CLASSES})


#: Every optimizer of the table by name, in the table's order (the Trainer's `optimizer` names).
OPTIMIZERS = _optimizers()
