"""``python -m fusetrain.optim --markdown`` prints the record section of
docs/ops.md, generated from the C++ kind table (fusetrain.optim._kinds)."""

import sys

from ._kinds import main

sys.exit(main())
