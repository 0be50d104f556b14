"""What is trained and how it is measured: batches of any structure
(:mod:`.batches`), losses (:mod:`.losses`), metrics (:mod:`.metrics`),
evaluation and the running loss sums (:mod:`.evaluation`), callbacks and the
run's state they read (:mod:`.callbacks`), and the registry by which recipes
name them (:mod:`.registry`). Nothing here knows of processes, checkpoints or
the loop."""
