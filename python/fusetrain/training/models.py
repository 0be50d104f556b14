"""The models moved to :mod:`fusetrain.models`; this name still imports them."""

from ..models import *  # noqa: F401,F403
from ..models import __all__  # noqa: F401
