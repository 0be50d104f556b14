"""``python -m fusetrain.export``: a recipe's model with a checkpoint's
weights, exported by :func:`fusetrain.export.export_model`. The checkpoint
is read as data unless ``--trusted`` (NOTE [checkpoints are data])."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from . import export_model

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fusetrain.export",
                                description="Export a recipe's model with a checkpoint's weights (torch.export .pt2 "
                                            "or ONNX .onnx), checked against the eager model on a validation batch.")
    p.add_argument("--config-name", "-cn", default="default", help="the recipe the model was trained with")
    p.add_argument("--config-dir", "-cd", default=None, help="directory of your own recipes")
    p.add_argument("--checkpoint", required=True,
                   help="a fusetrain checkpoint (ckpt_best.pth, ckpt_latest.pth), or a run or experiment folder (its "
                        "newest run's ckpt_best.pth)")
    p.add_argument("--ema", action="store_true", help="export the checkpoint's EMA weights")
    p.add_argument("--trusted", action="store_true",
                   help="read the checkpoint with any pickle allowed (it may run code from the file; only for files "
                        "you trust)")
    p.add_argument("--out", required=True, help="output path ending in .pt2 or .onnx")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the recipe (as when training)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from ..models import build_model
    from ..train_from_recipe import EXIT_RECIPE_ERROR, RecipeError, load_recipe
    from ..training.task.batches import split_batch
    from ..training.checkpoint.run_folder import checkpoint_file
    from ..training.checkpoint.weights import read_weights
    from ..training.data import build_dataloaders

    try:
        recipe = load_recipe(args.config_name, args.overrides, args.config_dir)
        arch = dict(recipe["arch_params"])
        model = build_model(arch.pop("name"), **arch)
        # NOTE [checkpoints are data]: read before the data is loaded; an untrusted file is refused first.
        model.load_state_dict(read_weights(checkpoint_file(args.checkpoint), use_ema=args.ema, trusted=args.trusted,
                                           key="--checkpoint", trust="--trusted", ema_key="--ema"))
        _, valid_loader = build_dataloaders(recipe["dataset_params"])
        inputs, _, _ = split_batch(next(iter(valid_loader)))
        result = export_model(model, inputs, args.out)
    except (RecipeError, ValueError, FileNotFoundError, RuntimeError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_RECIPE_ERROR
    print(f"exported {result['format']} to {result['path']} (dynamic batch: {result['dynamic_batch']}; "
          + (f"outputs match the eager model, max abs diff {result['max_abs_diff']:.3g})" if result["checked"]
             else "not run: install onnxruntime to check the outputs)"))
    return 0
