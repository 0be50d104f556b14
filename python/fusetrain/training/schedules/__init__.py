"""What changes with the step count: the learning rate (:mod:`.lr`), the
other optimizer settings (momentum, weight decay: :mod:`.settings`) and what
happens between two steps of an epoch (validation, checkpoints, a stop:
:mod:`.triggers`)."""
