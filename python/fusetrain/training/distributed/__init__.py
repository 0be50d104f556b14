"""The run's processes: the distributed context and its collectives
(:mod:`.context`), starting workers (:mod:`.launcher`), sharded models
(:mod:`.fsdp`), stops on a signal and Slurm's requeue (:mod:`.preemption`),
and the data every rank reads: the global order (:mod:`.global_order`) and
the sharded loaders (:mod:`.sharding`)."""

from .context import SINGLE, DistContext, DistributedTrainingError, env_world, find_ddp, launched_by_launcher
from .devices import check_gpu_request, setup, single_device, workers_to_launch
from .seeding import epoch_seed, seed_everything

__all__ = ["SINGLE", "DistContext", "DistributedTrainingError", "check_gpu_request", "env_world", "epoch_seed",
           "find_ddp", "launched_by_launcher", "seed_everything", "setup", "single_device", "workers_to_launch"]
