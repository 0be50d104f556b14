"""What a run reports: the per-epoch history (CSV, JSONL, TensorBoard, the
metrics plot: :mod:`.experiment_log`), the per-step scalars
(:mod:`.step_log`) and the progress bar (:mod:`.progress_bar`)."""
