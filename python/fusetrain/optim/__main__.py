"""``python -m fusetrain.optim --write | --check | --markdown``: the files the
optimizer table generates (fusetrain.optim._codegen)."""

import sys

from ._codegen import main

sys.exit(main())
