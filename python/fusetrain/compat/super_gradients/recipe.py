"""``train_from_recipe --from-super-gradients PATH.yaml``: a recipe's model
and data trained with SG training hyperparameters.

The command line's overrides split three ways: ``super_gradients.KEY=VALUE``
sets an SG key before translating (``super_gradients.max_epochs=1``);
``training_params.KEY=VALUE`` (with ``+``/``++`` for keys the recipe lacks)
supplies a fusetrain value, which replaces an SG value with no counterpart and
wins over the translation; the rest are the recipe's Hydra overrides."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

__all__ = ["split_overrides", "apply_sg_params"]

SG_PREFIX = "super_gradients."


def split_overrides(overrides: Sequence[str]) -> Tuple[List[str], Dict[str, Any], List[str]]:
    """(Hydra overrides for the recipe, SG overrides {key: value}, the
    training_params keys the command line sets)."""
    from ..._optional import require

    yaml = require("yaml", "super_gradients.KEY=VALUE overrides")
    hydra, sg, supplied = [], {}, []
    for text in overrides:
        if text.startswith(SG_PREFIX):
            key, sep, value = text[len(SG_PREFIX):].partition("=")
            if not sep or not key:
                raise ValueError(f"{text!r}: allowed: super_gradients.KEY=VALUE (a YAML value)")
            try:
                sg[key] = yaml.safe_load(value) if value else None
            except yaml.YAMLError as e:
                problem = getattr(e, "problem", None) or str(e).splitlines()[0]
                raise ValueError(f"{text!r}: the value is not readable YAML ({problem}); allowed: "
                                 f"super_gradients.KEY=VALUE (a YAML value)") from None
            continue
        hydra.append(text)
        bare = text.lstrip("+~")
        if bare.startswith("training_params.") and "=" in bare and not text.startswith("~"):
            supplied.append(bare[len("training_params."):].split("=", 1)[0].split(".", 1)[0])
    return hydra, sg, supplied


def apply_sg_params(recipe: Dict[str, Any], path: str, sg_overrides: Dict[str, Any],
                    supplied: Sequence[str]) -> str:
    """Replace the recipe's training_params by the translation of ``path``
    (the keys in ``supplied`` keep the command line's values); returns the
    report's text. Raises ValueError (SGTranslationError) when a key has no
    counterpart."""
    from .translate import translate

    supply = {k: recipe["training_params"][k] for k in supplied if k in recipe["training_params"]}
    params, report = translate(path, supply=supply, overrides=sg_overrides)
    recipe["training_params"] = params
    return str(report)
