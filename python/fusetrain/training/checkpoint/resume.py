"""The resume decision: which checkpoint a run continues (NOTE [run
folders]), read as data in the current schema, how its data is read on this
many processes (:mod:`.elastic`), and what a run takes from its checkpoint
and what from the new training_params (the table in ``docs/checkpoints.md``).

The checkpoint gives the state: weights, optimizer state (momentum, moments,
master weights), the EMA's weights and step count, the loss scale and its
growth tracker, the epoch and step counters, the best metric, the
early-stopping count and the random states. The new training_params give
every setting, hyperparameters included (they are applied to the restored
optimizer, EMA and scaler). Each key that differs from the checkpoint's
training_params is reported in one warning; a change that cannot work is an
error raised before anything is loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ..._warnings import warn
from ..params import TrainingParams, TrainingParamsError
from . import elastic
from .files import load_checkpoint
from .run_folder import LATEST, RUN_PREFIX, latest_checkpoint
from .schema import upgrade

__all__ = ["ResumePlan", "check_changes", "plan_resume", "read", "resume_file"]

#: Keys that must not change on resume, and why.
REFUSED = {
    "optimizer": "an optimizer's state (momentum buffers, moments) cannot carry over to another optimizer",
    "zero_weight_decay_on_bias_and_bn": "it changes the optimizer's parameter groups, by which the checkpoint's "
                                        "optimizer state is laid out",
}
#: Keys whose new value has no effect on resume, and why.
KEPT = {"seed": "not used: the checkpoint's random states continue the run (the seed starts fresh runs)",
        "pretrained_weights": "not used: the checkpoint has the weights"}
#: What applying a new value means, where it is not obvious.
NOTES = {
    "optimizer_params": "applied to the restored optimizer; its state is kept",
    "clip_grad_norm": "applied from the next step",
    "ema_params": "applied to the restored EMA; its weights and step count are kept",
    "scaler_params": "growth_factor, backoff_factor and growth_interval applied; the scale and its growth tracker "
                     "continue from the checkpoint",
    "mixed_precision": "applied; the loss scaler's state is restored only when both runs use fp16",
    "ema": "applied; an EMA that the checkpoint lacks starts from the restored weights",
    "weights_dtype": "applied: the restored weights are cast to it (rounded from float32 to bfloat16; a master "
                     "copy or remainder the checkpoint lacks starts from the rounded weights)",
    **dict.fromkeys(("max_epochs", "max_steps"), "applied; the schedule is recomputed for the new length at the "
                    "restored step"),
    **dict.fromkeys(("lr_multipliers", "layer_decay", "freeze"), "applied to the restored groups; a change that "
                    "regroups the parameters makes the optimizer state unfit (an error)"),
    "batch_accumulate": "applied; it changes the steps per epoch, so the schedule, which continues at the restored "
                        "step, spans a different number of epochs",
    "max_train_batches": "applied; it changes the steps per epoch, so the schedule, which continues at the "
                         "restored step, spans a different number of epochs",
}
IGNORED = ("resume", "resume_path", "resume_trusted", "overwrite_experiment")


def _diff(old: Any, new: Any, key: str) -> List[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [f"{key}.{k}: {old.get(k, '<default>')!r} -> {new.get(k, '<default>')!r}"
                for k in sorted(set(old) | set(new), key=str) if old.get(k) != new.get(k)]
    return [f"{key}: {old!r} -> {new!r}"]


def check_changes(saved: Optional[Dict[str, Any]], p: TrainingParams, path: str, kept: Tuple[str, ...] = ()) -> None:
    """Raise for a change that cannot work; warn once listing the others (not ``kept``: the keys a resume on
    another number of processes set to keep the global batch, which it reports itself)."""
    if not saved:
        return
    new = p.to_dict(json_safe=True)
    changed = [k for k in new if k not in IGNORED and k not in kept and k in saved and saved[k] != new[k]]
    refused = [f"training_params.{k}: got {new[k]!r} but the checkpoint {path} was trained with {saved[k]!r}; "
               f"allowed on resume: {saved[k]!r} ({REFUSED[k]}); to change it, start a fresh run (resume: false) "
               f"from the checkpoint's weights (pretrained_weights: {path})"
               for k in changed if k in REFUSED]
    if refused:
        raise TrainingParamsError(refused)
    if changed:
        lines = []
        for k in changed:
            note = KEPT.get(k) or NOTES.get(k, "applied")
            lines += [f"  {d} ({note})" for d in _diff(saved[k], new[k], k)]
        warn(f"resume from {path}: training_params changed since the checkpoint was written:\n"
             + "\n".join(lines))


def resume_file(experiment_dir: str, p: TrainingParams) -> Optional[str]:
    """The checkpoint a resume reads (checked to exist): ``resume_path``, else the newest run's ``ckpt_latest.pth``
    (NOTE [run folders]); None for a fresh run (``resume: auto`` without a checkpoint, too)."""
    if not (p.resume or p.resume_path):
        return None
    path = p.resume_path or latest_checkpoint(experiment_dir)
    if path is not None and os.path.isfile(path):
        return path
    if p.resume == "auto":
        return None
    if p.resume_path:
        raise FileNotFoundError(f"training_params.resume_path: no checkpoint at {p.resume_path}")
    raise FileNotFoundError(f"training_params.resume: no run of {experiment_dir} has a checkpoint ({LATEST}); "
                            f"allowed: resume: false (a fresh run), resume: auto, or resume_path: a checkpoint file")


def read(path: str, trusted: bool = False, trust: str = "training_params.resume_trusted: true") -> Dict[str, Any]:
    """A checkpoint file as data (NOTE [checkpoints are data]) in the current schema (NOTE [checkpoint schema])."""
    ck = load_checkpoint(path, trusted=trusted, trust=trust)
    if not isinstance(ck, dict) or "global_step" not in ck or "epoch" not in ck:
        raise ValueError(f"resume: {path} is not a fusetrain checkpoint (a dict with its epoch and global_step); "
                         f"allowed: a file the Trainer wrote (ckpt_latest.pth, ckpt_best.pth, ...)")
    return upgrade(ck, path)


@dataclass(frozen=True)
class ResumePlan:
    """What a run continues: the checkpoint (``path``, its contents; None: a fresh run), the run folder it writes
    (a resumed run of this experiment continues in its own; None: a new one) and how it reads its data
    (``data``: the params as kept for the global batch, the per-process batch, the order's seed, a note)."""

    path: Optional[str]
    checkpoint: Optional[Dict[str, Any]]
    run_dir: Optional[str]
    data: elastic.DataPlan

    @property
    def resumed(self) -> bool:
        return self.path is not None

    def describe(self) -> str:
        """One line for the log: what the run continues (a resumed run)."""
        ck = self.checkpoint or {}
        where = (f"inside epoch {ck['position']['epoch'] + 1}" if ck.get("position") is not None
                 else f"after epoch {ck.get('epoch')}")
        return (f"continuing from {self.path} (optimizer step {ck.get('global_step')}, {where}, written by "
                f"{ck.get('world_size', 1)} process(es))")


def plan_resume(experiment_dir: str, p: TrainingParams, train_loader: Any, world: int) -> ResumePlan:
    """The resume decision of a run of ``world`` processes, before anything is written: the checkpoint read (or
    refused) as data, its data plan (NOTE [resume on another process count]) and the training_params changes
    checked (a change that cannot work raises; the others are reported)."""
    path = resume_file(experiment_dir, p)
    ck = read(path, p.resume_trusted) if path is not None else None
    data = elastic.plan(ck, path, p, train_loader, world)
    run_dir = None
    if ck is not None:
        check_changes(ck.get("training_params"), data.params, path, data.changed)
        folder = os.path.dirname(os.path.abspath(path))
        inside = os.path.dirname(folder) == os.path.abspath(experiment_dir) and \
            os.path.basename(folder).startswith(RUN_PREFIX)
        run_dir = folder if inside or folder == os.path.abspath(experiment_dir) else None
    return ResumePlan(path, ck, run_dir, data)
