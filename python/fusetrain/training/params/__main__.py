"""``python -m fusetrain.training.params --markdown``: print docs/training_params.md."""

import sys

from .docs import main

sys.exit(main())
