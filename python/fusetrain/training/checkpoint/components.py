"""The Trainer's checkpointed components: thin ``state_dict()`` /
``load_state_dict()`` objects (torch's ``Stateful`` protocol) over the model,
optimizer, loss scaler, EMA and random states, which carry the resume rule
of ``docs/checkpoints.md``: a resume takes the *state* from the checkpoint
and every *setting* from the new training_params.

NOTE [resume hyperparameters]: ``load_state_dict`` of a torch optimizer, a
scaler or an EMA brings back the saved settings too (weight decay, betas,
the lr tensor; growth factors; decay settings). These components load the
state, then put the current settings back, as the resume's warning of the
changed keys says.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ...ema import unwrap_model
from ..distributed import fsdp
from .position import rng_state, set_rng_state

__all__ = ["ModelState", "OptimizerState", "ScalerState", "EMAState", "RNGState"]


class ModelState:
    """The model's weights (of the module inside DDP / torch.compile wrappers)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def state_dict(self) -> Dict[str, Any]:
        return unwrap_model(self.model).state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if fsdp.is_fsdp(self.model):
            raise ValueError("resume: the checkpoint holds the full state of a run without multi_gpu 'fsdp'; "
                             "allowed: resume it without fsdp, or start a fresh fsdp run from its weights "
                             "(pretrained_weights: the checkpoint)")
        unwrap_model(self.model).load_state_dict(state)


class OptimizerState:
    """The optimizer's state (moments, master weights); its param groups keep their current settings (NOTE
    [resume hyperparameters])."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt

    def state_dict(self) -> Dict[str, Any]:
        return self.opt.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        current = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        try:
            self.opt.load_state_dict(state)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ValueError(f"resume: the optimizer state of the checkpoint does not fit this model and "
                             f"optimizer: {e}") from e
        for g, settings in zip(self.opt.param_groups, current):
            g.update(settings)


class ScalerState:
    """The loss scale and its growth tracker; the growth settings stay (NOTE [resume hyperparameters]). Restored
    only when the scaler is enabled (both runs fp16)."""

    _SETTINGS = ("growth_factor", "backoff_factor", "growth_interval")

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    def state_dict(self) -> Dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not state or not self.scaler.is_enabled():
            return
        settings = {k: v for k, v in self.scaler.state_dict().items() if k in self._SETTINGS}
        self.scaler.load_state_dict({**state, **settings})


class EMAState:
    """The EMA's weights, remainders and step; its decay settings stay (NOTE [resume hyperparameters]). In a
    sharded run its module and remainders are in the shards (``ModelEMA.state_dict(sharded=True)``)."""

    _STATE = ("module", "step", "remainders", "sharded_remainders")

    def __init__(self, ema: Any, sharded: bool = False) -> None:
        self.ema, self.sharded = ema, sharded

    def state_dict(self) -> Dict[str, Any]:
        return self.ema.state_dict(sharded=self.sharded)

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        settings = {k: v for k, v in self.ema.state_dict(sharded=True).items() if k not in self._STATE}
        self.ema.load_state_dict({**state, **settings})


class RNGState:
    """This process's random states (torch CPU and CUDA, NumPy, Python, the train loader's generator)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> Dict[str, Any]:
        return rng_state(self.loader)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        set_rng_state(state, self.loader)
