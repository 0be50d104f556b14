"""SuperGradients training hyperparameters in fusetrain.

``translate(sg_params, supply=None)`` takes an SG training-hyperparameters
YAML (``defaults: [default_train_params]``, ``${...}``, ``_target_`` nodes of
plain values) or the dict SG's Hydra resolves, applies SG's defaults and
semantics, and returns ``(training_params, report)``; ``str(report)`` lists
each SG key, what it became and where SG's behaviour is reproduced on
purpose. ``python -m fusetrain.train_from_recipe --from-super-gradients
PATH.yaml`` trains a recipe's model and data with the translated params. See
docs/guides/from_super_gradients.md.
"""

import os as _os

from .defaults import SG_DEFAULTS, SG_OPTIMIZER_DEFAULTS
from .loading import SAFE_TARGETS, SGObject, load_sg_params
from .report import SGTranslationError, TranslationReport
from .translate import translate

#: SG training-hyperparameter files of seven SG recipes, written for fusetrain's tests and guide.
SG_RECIPES_DIR = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "sg_recipes")

__all__ = ["translate", "TranslationReport", "SGTranslationError", "SGObject", "load_sg_params", "SG_DEFAULTS",
           "SG_OPTIMIZER_DEFAULTS", "SAFE_TARGETS", "SG_RECIPES_DIR"]
