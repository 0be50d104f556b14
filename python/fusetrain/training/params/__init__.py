"""The ``training_params`` schema of the Trainer: keys, defaults, validation and
the reference page.

* :mod:`.table`: :data:`TRAINING_PARAMS`, the ordered table of
  :class:`ParamSpec` rows (name, allowed values, default, documentation,
  validator);
* :mod:`.validators`: the validators and :class:`TrainingParamsError`;
* :mod:`.resolve`: :func:`resolve_training_params` turns a user mapping (a
  dict, or an OmegaConf / Hydra config) into an immutable
  :class:`TrainingParams`: defaults filled in, every value checked (nested
  dicts included) and normalised, unknown keys reported with the closest
  valid key, then the checks that involve several keys. Problems raise
  :class:`TrainingParamsError` with messages of the form
  ``training_params.<key>: got <value> (<type>); allowed: <description>``;
* :mod:`.docs`: ``python -m fusetrain.training.params --markdown`` prints the
  reference page, ``docs/training_params.md``.
"""

from ..task.losses import LOSS_ALIASES as LOSSES
from .docs import render_markdown
from .resolve import TrainingParams, optimizer_class, resolve_training_params
from .table import COMPILE_STEP_MODES, LR_MODES, OPTIMIZERS, TORCH_COMPILE_MODES, TRAINING_PARAMS, ParamSpec
from .validators import TrainingParamsError

__all__ = ["ParamSpec", "TRAINING_PARAMS", "TrainingParams", "TrainingParamsError", "resolve_training_params",
           "optimizer_class", "render_markdown", "OPTIMIZERS", "LOSSES", "LR_MODES", "TORCH_COMPILE_MODES",
           "COMPILE_STEP_MODES"]
