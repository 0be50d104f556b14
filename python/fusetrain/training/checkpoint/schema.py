"""What a checkpoint file holds, by version, and the one converter of older
versions.

NOTE [checkpoint schema]: a checkpoint is a dict of data (NOTE [checkpoints
are data]) with

* ``schema_version``: :data:`SCHEMA_VERSION`;
* the run's record, written by the
  :class:`~fusetrain.training.checkpoint.manager.CheckpointManager` itself:
  ``training_params`` (JSON-safe), ``world_size``, ``epoch`` (epochs done; in
  a mid-epoch checkpoint, the epoch in progress), ``global_step`` (optimizer
  steps done), ``data_order`` (NOTE [resume on another process count]),
  ``shards`` (a sharded run: the folder of its tensors under ``shards/``,
  NOTE [sharded checkpoints]; else None) and, in a mid-epoch checkpoint,
  ``position`` (``epoch``, ``batches``, ``step0``, ``skipped_seen`` and one
  entry per rank under ``ranks``: NOTE [mid-epoch resume]);
* one entry per registered component, under its name, holding what its
  ``state_dict()`` returned: the Trainer registers ``model``, ``optimizer``,
  ``scaler``, ``ema``, ``schedule``, ``rng``, ``progress`` (the best value of
  ``metric_to_watch``, the validations without improvement, the steps the
  loss scaler skipped), ``averaging`` (``average_best_models``) and
  ``callbacks.<name>`` for each callback with a state. In a sharded run the
  entries ``model`` and ``optimizer`` are None and ``ema`` lacks the module
  and its remainders (their tensors are in the shards).

Version 1 (before the checkpoint had one owner) had no ``schema_version`` and
kept ``best``, ``stale_epochs`` and ``skipped_steps`` at the top level;
:func:`upgrade` turns it into the current version, and every read goes
through it.
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["SCHEMA_VERSION", "upgrade"]

SCHEMA_VERSION = 2


def upgrade(ck: Dict[str, Any], path: str) -> Dict[str, Any]:
    """``ck`` (read from ``path``) in the current schema; a newer one is refused."""
    version = ck.get("schema_version", 1)
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"{path}: schema_version {version!r} is not a checkpoint schema; allowed: an int from 1 "
                         f"to {SCHEMA_VERSION}")
    if version > SCHEMA_VERSION:
        raise ValueError(f"{path} was written by a newer fusetrain (checkpoint schema {version}; this one reads up "
                         f"to {SCHEMA_VERSION}); allowed: upgrade fusetrain to read it")
    if version == 1:
        ck = _from_version_1(ck)
    return ck


def _from_version_1(ck: Dict[str, Any]) -> Dict[str, Any]:
    out = {k: v for k, v in ck.items() if k not in ("best", "stale_epochs", "skipped_steps")}
    out["progress"] = {"best": ck.get("best"), "stale_epochs": int(ck.get("stale_epochs", 0)),
                       "skipped_steps": float(ck.get("skipped_steps", 0.0))}
    out["schema_version"] = SCHEMA_VERSION
    return out
