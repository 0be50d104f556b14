"""What follows the last epoch of a run: the test loaders evaluated on the
final weights, the average of the best models validated, and the export of
the final weights (``training_params.export``)."""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict, List

from ..export import export_model
from .checkpoint.manager import AVERAGE
from .task.batches import split_batch, to_device
from .task.evaluation import evaluate, prefixed
from .task.metrics import MetricSet

__all__ = ["export", "run_tests", "validate_average"]


def run_tests(run: Any) -> Dict[str, float]:
    """Each test loader once, on the final weights (the EMA's with ``ema``)."""
    out: Dict[str, float] = {}
    model = run.ema.module if run.ema is not None else run.model
    for name, loader in run.test_loaders.items():
        metrics = MetricSet(run.p.valid_metrics, "test").to(run.device)
        res = evaluate(model, loader, run.loss_fn, run.precision, metrics, run.device, ctx=run.ctx,
                       **run.batch_rules, what=f"test_loader[{name!r}]" if name else "test_loader")
        out.update(prefixed("test", name, res))
        run.callbacks("on_test_end", run.state, name, res)
    if run.ctx.is_main:
        print("test | " + "  ".join(f"{k} {v:.4f}" for k, v in out.items()), flush=True)
        os.makedirs(run.run_dir, exist_ok=True)
        with open(os.path.join(run.run_dir, "test_metrics.json"), "w") as f:
            json.dump(out, f, indent=2)
    return out

def validate_average(run: Any) -> Dict[str, Any]:
    """``average_best_models``: the averaged weights validated (on a copy of the watched model) and where
    they are; ``{"path", "averaged": [{"epoch", "value"}], "valid": {valid_<metric>: ...}}``."""
    out: Dict[str, Any] = {"path": os.path.join(run.run_dir, AVERAGE), "averaged": run.checkpoints.averaged()}
    weights = run.checkpoints.average_model()
    if weights is not None and run.valid_loaders and not run.ctx.enabled:
        model = copy.deepcopy(run.ema.module if run.ema is not None else run.model)
        model.load_state_dict(weights)
        row: Dict[str, Any] = {}
        run.validate(row, model=model)
        out["valid"] = row
    return out

def export(run: Any) -> List[Dict[str, Any]]:
    """training_params.export: the final weights (the EMA's with ema) to files in the run folder, each
    checked against the eager model on the first validation batch."""
    model = run.ema.module if run.ema is not None else run.model
    loader = next(iter(run.valid_loaders.values()), None) or run.train_loader
    inputs, _, _ = split_batch(to_device(next(iter(loader)), run.device), run.split_fn)
    was_training = model.training
    try:
        return [export_model(model, inputs, os.path.join(run.run_dir, name)) for name in run.p.export]
    finally:
        model.train(was_training)
