"""A run's checkpoints, with one owner: :class:`~.manager.CheckpointManager`
(the checkpoint's schema, writing, reading as data, the resume plan). Beside
it: atomic files and data-only reads (:mod:`.files`), sharded state through
``torch.distributed.checkpoint`` (:mod:`.sharded`), the resume plan and what a
resume takes from new training_params (:mod:`.resume`, :mod:`.resume_plan`),
the position inside an epoch (:mod:`.position`), the average of the best
models (:mod:`.average`), the run folders on disk (:mod:`.run_folder`) and
the converter of older files (:mod:`.convert`)."""
