"""A param group's numbers as the fused step reads them: its lr tensor, its
record (NOTE [group records] in csrc/ops/fused_step.cpp) and its values
tensor of schedulable settings (NOTE [device values]), and the settings a
compiled step sees (``compiled_view``). A mixin of ``FusedOptimizer``
(_base.py)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, List, Sequence

import torch
from torch import Tensor

from .. import _C
from .._checks import check_number
from . import _capture
from ._kinds import KINDS
from ._settings import _MASTER_CODES, _check_master_weights


class GroupValues:
    """Each group's lr, record and schedulable settings on the device."""

    def _lr_tensor(self, gi: int, group: Dict[str, Any], device: torch.device) -> Tensor:
        lr = group["lr"]
        if isinstance(lr, Tensor):
            if lr.device == device and lr.dtype == torch.float32:
                return lr.reshape(())
            self._check_lr_copy(gi, lr, device)
            return lr.detach().to(device=device, dtype=torch.float32).reshape(())
        cached = self._lr_cache.get(gi)
        if (cached is None or cached[0] != lr) and not torch.compiler.is_compiling():
            check_number(f"{self._opt_name} (param group {gi})", "lr", lr, 0.0)  # a new Python number: on the host
        if cached is None or cached[1].device != device or cached[0] != lr:
            if _capture.capturing(device):
                raise RuntimeError(
                    f"{self._opt_name}: param group {gi}'s lr is the Python number {lr!r} and a CUDA graph is being "
                    "captured: the graph would keep this value on every replay. Use a device tensor lr "
                    "(optimizer.prepare_capture() checks this before capturing)")
        if cached is None or cached[1].device != device:
            t = torch.full((), lr, dtype=torch.float32, device=device)
            self._lr_cache[gi] = [lr, t]
            return t
        if cached[0] != lr:
            cached[1].fill_(lr)
            cached[0] = lr
        return cached[1]

    def _check_lr_copy(self, gi: int, lr: Tensor, device: torch.device) -> None:
        """An lr tensor that must be copied to the params' device each step."""
        if _capture.capturing(device):
            raise RuntimeError(
                f"{self._opt_name}: param group {gi}'s lr is a tensor on {lr.device} but its params are on {device}, "
                f"and a CUDA graph is being captured: the copy would freeze the lr. Create the lr on {device}")
        if lr.device.type == "cpu" and device.type != "cpu" and not self._warned.get("lr_device") \
                and not torch.compiler.is_compiling():
            self._warned["lr_device"] = True
            warnings.warn(
                f"{self._opt_name}: param group {gi}'s lr is a CPU tensor but its params are on {device}: every step "
                f"copies it to the device and waits for the host. Create it on the device, e.g. "
                f"torch.tensor(lr, device='{device}')", stacklevel=4)

    def _group_records(self, groups: Sequence[Any]):
        """Each stepped group's lr tensor, record (NOTE [group records] in
        csrc/ops/fused_step.cpp) and values tensor (NOTE [device values]; none
        when the step's kind has no schedulable fields). A compiled step takes
        them as NOTE [compiled settings] says."""
        lrs: List[Tensor] = []
        hyper: List[Any] = []
        values: List[Tensor] = []
        positions = KINDS[self._kind]["value_positions"]
        compiling = torch.compiler.is_compiling()
        view = compiling and self._view["active"]
        for gi, group, device, has_ema in groups:
            lrs.append(self._lr_tensor(gi, group, device))
            max_norm = group["max_grad_norm"]
            hyper.append(0.0 if max_norm is None else float(max_norm))
            code = _MASTER_CODES.get(group["master_weights"]) if isinstance(group["master_weights"], (bool, str)) \
                else None
            if code is None:
                _check_master_weights(f"{self._opt_name} (param group {gi})", group["master_weights"], True)
            hyper.append(code)
            hyper.append(1.0 if has_ema else 0.0)
            hyper.append(1.0 if group["maximize"] else 0.0)
            if compiling and not view and positions:
                fields, live = self._compiled_record(group, positions)
                hyper.extend(fields)
                values.append(live)
                continue
            fields = self._kind_fields(group)
            hyper.extend(fields)
            if not positions:
                continue
            if not compiling:
                values.append(self._values_tensor(gi, fields, device, checked=True))
            else:
                values.append(self._view_values(gi, fields))
        return lrs, hyper, values

    def _compiled_record(self, group: Dict[str, Any], positions: Sequence[int]):
        """NOTE [compiled settings]: a compiled step outside ``compiled_view``
        reads the group's schedulable settings as they are, into a values
        tensor made in the graph (float64, on the CPU: fused_step_ reads it on
        the host, checks it and passes the numbers to the kernels), so dynamo
        treats them as inputs (after one recompile when a setting first
        changes: its automatic dynamic) rather than constants. The record
        holds 0.5 for each non-zero one and 0 for the others: a valid value
        that decides the states as the setting does (a setting turning zero
        or non-zero recompiles)."""
        raw = self._record_of(group)
        fields = [(0.5 if v != 0 else 0.0) if i in positions else float(v) for i, v in enumerate(raw)]
        # Sums with a tensor rather than torch.tensor(floats): inductor keeps the floats symbolic in
        # arithmetic, but turns a tensor made from them into constants (a recompile per value).
        zero = torch.zeros((), dtype=torch.float64)
        return fields, torch.stack([zero + raw[i] for i in positions])

    def _view_values(self, gi: int, fields: List[float]) -> Tensor:
        """Under ``compiled_view`` the group shows the settings of its last
        structural change and the kernels read the values tensor that
        ``compiled_view`` synced on entry (NOTE [compiled settings]): the two
        must be the group's, else the step would silently use others. The
        error raised while tracing makes dynamo run the step eagerly (where
        the group's values are written as every eager step writes them)."""
        cached = self._values_cache.get(gi)
        snap = self._snapshots.get(gi)
        if cached is None or snap is None:
            raise RuntimeError(f"{self._opt_name}: param group {gi} has no synced values under compiled_view(); "
                               "call the compiled step inside `with optimizer.compiled_view():`")
        if tuple(fields) != tuple(self._kind_fields(snap)):
            raise RuntimeError(
                f"{self._opt_name}: param group {gi}'s settings changed inside a compiled step that runs under "
                "compiled_view(): its kernels would read the values synced before the call. Change settings "
                "(betas, momentum, weight_decay, ...) before the call")
        return cached[1]

    def sync_hyperparameters(self) -> tuple:
        """Write the schedulable settings of every group (betas, momentum,
        weight_decay, eps, ...: ``optim_kinds()``'s ``value_fields``) into its
        device values tensor, checking new values first. Every eager
        ``step()`` does this itself; :class:`fusetrain.TrainStep` calls it
        before each compiled or captured step, which then follows a schedule
        of these settings without recompiling or capturing again (NOTE
        [device values]). Call it before replaying a CUDA graph of ``step()``
        that you captured yourself. Returns what such a step still reads on
        the host (each group's settings as of its last structural change):
        when that changes, a captured step must be captured again.
        ``compiled_view()`` calls it (NOTE [compiled settings])."""
        positions = KINDS[self._kind]["value_positions"]
        key = []
        for gi, group in enumerate(self.param_groups):
            device = next((p.device for p in group["params"] if p.requires_grad), None)
            if device is None:
                continue
            fields = self._kind_fields(group)
            if positions:
                self._values_tensor(gi, fields, device, checked=False)
            key.append(tuple(sorted(self._compiled_settings(gi, group, fields).items())))
        return tuple(key)

    def _values_tensor(self, gi: int, fields: List[float], device: torch.device, checked: bool) -> Tensor:
        """The group's values tensor holding ``fields``' schedulable entries,
        made once per group and device and written in place (a fill per
        changed value, no host sync) when a value changes. ``checked``: the
        step's op checks ``fields`` itself."""
        positions = KINDS[self._kind]["value_positions"]
        fields = tuple(fields)
        cached = self._values_cache.get(gi)  # [fields written, tensor]
        if cached is not None and cached[1].device == device and cached[0] == fields:
            return cached[1]
        if _capture.capturing(device):
            raise RuntimeError(
                f"{self._opt_name}: param group {gi}'s settings changed while a CUDA graph is being captured: the "
                "graph would keep them on every replay. Call optimizer.sync_hyperparameters() before capturing "
                "and before each replay (fusetrain.TrainStep does)")
        if not checked:
            try:
                _C.check_kind_record(self._kind, list(fields))
            except ValueError as e:
                raise ValueError(f"{self._opt_name}: param group {gi}: {e}") from None
        if cached is None or cached[1].device != device:
            # Filled value by value: a copy from host memory would wait for the device.
            t = torch.empty(len(positions), dtype=torch.float64, device=device)
            for k, i in enumerate(positions):
                t[k].fill_(fields[i])
            self._values_cache[gi] = [fields, t]
            return t
        t = cached[1]
        for k, i in enumerate(positions):
            if fields[i] != cached[0][i]:
                t[k].fill_(fields[i])
        cached[0] = fields
        return t

    def _compiled_settings(self, gi: int, group: Dict[str, Any], fields: List[float]) -> Dict[str, Any]:
        """The group's settings a compiled step sees (``compiled_view``): those
        of its last structural change. They are replaced by the current ones
        when anything but schedulable values changed (any other key, a flag,
        max_grad_norm, a schedulable value turning zero or non-zero, which
        decides the states a group keeps)."""
        now = {k: v for k, v in group.items() if k not in ("params", "lr") and not isinstance(v, Tensor)}
        snap = self._snapshots.get(gi)
        if snap is not None and snap != now:
            positions = KINDS[self._kind]["value_positions"]
            was = self._kind_fields(snap)
            keep = snap.keys() == now.keys() and all(
                self._kind_fields(dict(snap, **{k: now[k]})) != was for k in now if now[k] != snap[k])
            keep = keep and all(w == f if i not in positions else (w != 0) == (f != 0)
                                for i, (w, f) in enumerate(zip(was, fields)))
            if not keep:
                snap = None
        if snap is None:
            snap = self._snapshots[gi] = now
        return snap

    @contextlib.contextmanager
    def compiled_view(self):
        """NOTE [compiled settings]: the context in which to call a step you
        compiled yourself (``torch.compile`` of a function that calls
        ``step()``) so that it follows schedules of betas, momentum,
        weight_decay, eps, ... without recompiling: on entry the settings of
        every group are written into its device values tensor (checked, as
        ``sync_hyperparameters()``), and while the step runs each group shows
        the settings of its last structural change, so the compiled code,
        whose guards cover every setting of the param groups, sees the same
        numbers every step; the kernels read the current ones from the values
        tensors. A structural change (a flag, max_grad_norm, a schedulable
        value turning zero or non-zero) recompiles. ``fusetrain.TrainStep``
        runs its compiled steps in it. A compiled step outside it follows the
        settings too, after one recompile when a setting first changes."""
        self.sync_hyperparameters()
        saved = []
        self._view["active"] = True
        try:
            for gi, group in enumerate(self.param_groups):
                snap = self._snapshots.get(gi)
                if snap is not None and snap.keys() <= group.keys():
                    saved.append((group, {k: group[k] for k in snap}))
                    group.update(snap)
            yield
        finally:
            self._view["active"] = False
            for group, items in saved:
                group.update(items)
