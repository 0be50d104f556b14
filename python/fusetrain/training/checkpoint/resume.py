"""Resume: what a run takes from its checkpoint and what from the new
training_params (the table in ``docs/checkpoints.md``).

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

import warnings
from typing import Any, Dict, List, Optional, Tuple

from ...ema import unwrap_model
from ..params import TrainingParams, TrainingParamsError

__all__ = ["check_changes", "restore"]

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
               f"allowed on resume: {saved[k]!r} ({REFUSED[k]}); to change it, start a fresh run (another "
               f"experiment_name, or overwrite_experiment=True) from the checkpoint's weights"
               for k in changed if k in REFUSED]
    if refused:
        raise TrainingParamsError(refused)
    if changed:
        lines = []
        for k in changed:
            note = KEPT.get(k) or NOTES.get(k, "applied")
            lines += [f"  {d} ({note})" for d in _diff(saved[k], new[k], k)]
        warnings.warn(f"resume from {path}: training_params changed since the checkpoint was written:\n"
                      + "\n".join(lines), stacklevel=5)


def _saved_remainders(ck: Dict[str, Any], ema) -> Optional[Dict[str, Any]]:
    """The EMA's remainder tensors whose values a sharded checkpoint holds (NOTE [checkpoint schema])."""
    if ema is None or ck.get("ema") is None:
        return None
    live = ema.remainder_tensors()
    return {n: live[n] for n in ck["ema"].get("sharded_remainders", ()) if n in live}


def restore(ck: Dict[str, Any], path: str, model, opt, scaler, ema) -> None:
    """Load the checkpoint's state into the freshly built objects, then apply
    the new settings to them (hyperparameters from training_params). A
    sharded checkpoint (NOTE [sharded checkpoints]) loads into any number of
    processes; a full one into an unsharded model."""
    from ..distributed import fsdp
    from . import sharded as sharded_checkpoints
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    if ck.get("shards") is None and fsdp.is_fsdp(model):
        raise ValueError(f"resume: {path} holds the full state of a run without multi_gpu 'fsdp'; allowed: resume "
                         f"it without fsdp, or start a fresh fsdp run from its weights (pretrained_weights: {path})")
    if ck.get("shards") is None:
        unwrap_model(model).load_state_dict(ck["model"])
    saved_remainders = _saved_remainders(ck, ema)
    try:
        if ck.get("shards") is not None:
            sharded_checkpoints.load(ck, path, unwrap_model(model), opt, ema.module if ema is not None else None,
                                     saved_remainders)
        else:
            opt.load_state_dict(ck["optimizer"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise ValueError(f"resume: the optimizer state in {path} does not fit this model and optimizer: {e}") from e
    # NOTE [resume hyperparameters]: load_state_dict brings back the saved
    # param-group settings (weight decay, betas, the lr tensor); the new
    # training_params win, as their warning says.
    for g, settings in zip(opt.param_groups, fresh):
        g.update(settings)
    if ck.get("scaler") and scaler.is_enabled():
        growth = {k: v for k, v in scaler.state_dict().items()
                  if k in ("growth_factor", "backoff_factor", "growth_interval")}
        scaler.load_state_dict({**ck["scaler"], **growth})
    if ema is not None and ck.get("ema") is not None:
        settings = {k: v for k, v in ema.state_dict().items() if k not in ("module", "step", "remainders")}
        # A sharded checkpoint's module and remainders were loaded above (in place); those it lacks restart at zero.
        module = ({"module": ema.module.state_dict(), "remainders": saved_remainders}
                  if ck.get("shards") is not None else {})
        ema.load_state_dict({**ck["ema"], **settings, **module})
