"""State dicts of the fused optimizers: torch.optim's, with the lean forms
(NOTE [lean state], NOTE [8-bit state]) converted where a group keeps
another. A mixin of ``FusedOptimizer`` (_base.py)."""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import Tensor

from . import _int8_state
from ._state_layout import _put_in_form, _state_dtype


class StateDicts:
    """torch.optim's state dicts, lean forms converted on load."""

    def state_dict(self) -> Dict[str, Any]:
        """torch.optim's state dict; sharded (FSDP2) params' int8 states are
        in it decoded into float32 DTensors (NOTE [sharded 8-bit state] in
        _int8_state.py), which distributed checkpoints reshard."""
        sd = super().state_dict()
        if self._sharding["any"]:
            _int8_state.widen_sharded(sd["state"])
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict saved by this optimizer or by the matching
        torch.optim optimizer. Optimizer state is float32 for float32,
        float16 and bfloat16 params (torch would cast it to the param dtype)
        and float64 for float64 params; complex params keep complex state, as
        in torch. Step counters move to the param's device as float32 tensors.

        NOTE [lean state] in csrc/common/lean_state.h: ``master_weights`` and
        ``state_dtype`` say how the state is stored. A group that sets them
        (anything but False / float32) keeps its own, whatever the state dict
        was saved with; the others take the saved ones, as torch takes every
        setting. A float32 state loaded into a group with bfloat16 state is
        rounded to it, a float32 master becomes a remainder (or is dropped
        for "stochastic") at the next step, and the reverse. Moments into or
        out of int8 (NOTE [8-bit state]) are encoded or decoded here, when
        loaded; ``fusetrain.optim.full_precision_state_dict`` turns a lean
        state dict into a float32 one."""
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        own = [{k: g[k] for k, default in (("master_weights", False), ("state_dtype", "float32"),
                                           ("state_block_size", _int8_state.DEFAULT_BLOCK))
                if g.get(k, default) != default} for g in self.param_groups]
        for gi, (saved, group, kept) in enumerate(zip(saved_groups, self.param_groups, own)):
            # Checked before anything is loaded.
            trial = dict(self.defaults, **{k: v for k, v in saved.items() if k != "params"})
            self._check_lean_group_settings(gi, dict(trial, **kept, params=group["params"]))
        super().load_state_dict(state_dict)
        id_to_param, group_of = {}, {}
        for saved, group, kept in zip(saved_groups, self.param_groups, own):
            group.update(kept)
            for pid, p in zip(saved["params"], group["params"]):
                id_to_param[pid] = p
                group_of[pid] = group
        for pid, st in saved_state.items():
            p = id_to_param.get(pid)
            if p is None:
                continue
            for k, v in st.items():
                if isinstance(v, Tensor):
                    if v.is_sparse:  # torch's SGD keeps a sparse momentum buffer for sparse gradients
                        v = v.to_dense()
                    dtype = _state_dtype(p, complex_state=v.is_complex(), group=group_of[pid])
                    if k in self._scalar_states or k == "master_param":
                        dtype = torch.float32
                    elif k == "master_remainder":
                        dtype = torch.int16
                    elif torch.int8 in (v.dtype, dtype) or k.endswith("_scales"):
                        dtype = v.dtype  # NOTE [8-bit state]: put in the group's form below
                    self.state[p][k] = v.detach().to(device=p.device, dtype=dtype, copy=True)
            group = group_of[pid]
            for name in self._state_names(group):
                v = self.state[p].get(name)
                if name is not None and name not in self._scalar_states and isinstance(v, Tensor) and \
                        torch.int8 in (v.dtype, _state_dtype(p, group=group)):
                    _put_in_form(self.state[p], name, p, _state_dtype(p, group=group), group["state_block_size"],
                                 0.0)
        self._lr_cache.clear()
        self._forget_lists()
