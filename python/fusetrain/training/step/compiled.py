"""What the compiled (``"compile"``) and captured (``"cuda_graph"``) modes of
:class:`~.train_step.TrainStep` share: the batch signature a step was built
for and the eager run of a batch that does not match it; and the compiled
step itself."""

from __future__ import annotations

import types
from typing import Callable, Optional

import torch

from ..._warnings import warn
from ..task.batches import signature

__all__ = ["CompiledModes"]


def _fresh(fn: Callable) -> Callable:
    # NOTE [fresh code object]: dynamo keeps its compiled code (and counts its
    # recompilations) per code object. The step functions are closures defined
    # in one place, so every TrainStep would share one cache: a second model
    # would count as a recompilation of the first, and after
    # torch._dynamo.config.recompile_limit of them dynamo would silently run the
    # step eagerly. A copy of the code object gives each TrainStep (and each
    # rebuild after invalidate()) a cache of its own, freed with it.
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)


class CompiledModes:
    """TrainStep's methods for the modes that build the step once (its state: ``_sig``, ``_new_sig``,
    ``_prev_mismatch``, ``_warned_shape``, ``_c``; set up by TrainStep)."""

    def _build_compiled(self, fwd_bwd: Callable, step_no_zero: Optional[Callable], tail: Callable) -> None:
        opt = self.optimizer
        # NOTE [compile split]: dynamo breaks the graph at loss.backward();
        # AOTAutograd still compiles the backward of the forward graph, and
        # the code after backward() (the fused tail) is a second graph.
        # Compiled autograd (torch._dynamo.config.compiled_autograd) would
        # trace the backward at run time instead: on this project's models it
        # was slower to compile and no faster per step (docs/design.md,
        # "Whole-step capture"), so it is left to the user's global setting.
        c_micro = torch.compile(_fresh(fwd_bwd), **self.compile_options)
        if step_no_zero is not None:  # a fusetrain optimizer: the tail is compiled too
            c_step = torch.compile(_fresh(step_no_zero), **self.compile_options)

            def c_full(x, y):
                res = c_step(x, y)
                opt.zero_grad(set_to_none=True)
                return res
        else:
            def c_full(x, y):
                res = c_micro(x, y)
                tail()
                return res
        self._c = {False: c_micro, True: c_full}
        self._run = self._run_compiled

    def _matches(self, x, y) -> bool:
        sig = signature(x, y)
        if self._sig is None:
            self._sig = sig
            return True
        if sig == self._sig:
            return True
        self._new_sig = sig
        return False

    def _mismatch(self, x, y, do_step: bool):
        """A batch the compiled/captured step was not built for: run it eagerly."""
        new, built = self._new_sig, self._sig
        if (not new.partial_of(built) or self._prev_mismatch) and not self._warned_shape:
            self._warned_shape = True
            what = "captured" if self._mode == "cuda_graph" else "compiled"
            why = "" if new.spec == "tensor pair" else f" ({new.mismatch(built)})"
            warn(f"TrainStep(mode={self._mode!r}): the step was {what} for {built.text()}, but got "
                 f"{new.text()}{why}; such batches run eagerly (slower). Only a smaller last batch of an epoch runs "
                 f"eagerly without this warning. Call invalidate() to rebuild the step for new shapes"
                 + ("" if self._mode == "cuda_graph" else ", or pass compile_options={'dynamic': True}"))
        self._prev_mismatch = True
        return self._run_eager(x, y, do_step)

    def _run_compiled(self, x, y, do_step: bool):
        if not self._dynamic and not self._matches(x, y):
            return self._mismatch(x, y, do_step)
        self._prev_mismatch = False
        self._compiled_used = True
        if do_step and self.fused:
            self.optimizer.sync_hyperparameters()  # NOTE [device values]
            self.optimizer._sync_masters()  # NOTE [master re-sync]
            with self.optimizer.compiled_view():
                return self._c[do_step](x, y)
        return self._c[do_step](x, y)
