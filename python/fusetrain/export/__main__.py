"""``python -m fusetrain.export``: see :mod:`fusetrain.export.cli`."""

import sys

from .cli import main

sys.exit(main())
