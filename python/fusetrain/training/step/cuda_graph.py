"""The ``"cuda_graph"`` mode of :class:`~.train_step.TrainStep`: eager
warm-up steps on a side stream, the capture of the step (and, with
accumulation, of the micro-step) into CUDA graphs sharing one memory pool,
their replay for every batch, and the undoing of a capture that failed."""

from __future__ import annotations


import torch

from ..._warnings import warn
from ... import _ops
from ..task.batches import copy_into, empty_like_tree, tensor_count
from .compiled import CompiledModes

__all__ = ["CudaGraphMode"]


def _root_cause(e: BaseException) -> BaseException:
    """The first exception of a chain (capture_end's error hides the one that
    broke the capture)."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        nxt = e.__cause__ or e.__context__
        if nxt is None:
            break
        e = nxt
    return e


class CudaGraphMode(CompiledModes):
    """TrainStep's methods for mode ``"cuda_graph"`` (its state: ``_graphs``, ``_outs``, ``_static``,
    ``_pool``, ``_side_stream``, ``_warm``, ``_host_settings``; set up by TrainStep)."""

    # ---- CUDA graphs -------------------------------------------------------------------

    def _run_graphed(self, x, y, do_step: bool):
        # NOTE [capture device]: everything (warm-up, capture, replay) runs with
        # the model's device current and on a side stream created there, so a
        # model on cuda:1 is captured on cuda:1 whatever device is current.
        with torch.cuda.device(self.device):
            return self._run_graphed_on_device(x, y, do_step)

    def _run_graphed_on_device(self, x, y, do_step: bool):
        matches = self._matches(x, y)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.device)
        if self._warm < self.warmup_steps:
            # Eager warm-up steps on the side stream (what capture needs: lazily
            # created state, cuBLAS workspaces, the .grad tensors ... exist before it).
            cur = torch.cuda.current_stream(self.device)
            self._side_stream.wait_stream(cur)
            with torch.cuda.stream(self._side_stream):
                res = self._run_eager(x, y, do_step)
            cur.wait_stream(self._side_stream)
            if do_step:
                self._warm += 1
            return res
        if not matches:
            return self._mismatch(x, y, do_step)
        self._prev_mismatch = False
        if do_step:
            host = self.optimizer.sync_hyperparameters()  # NOTE [device values]
            self.optimizer._sync_masters()  # NOTE [master re-sync]
            if self._graphs.get(True) is not None and host != self._host_settings:
                if not self._warned_recapture:
                    self._warned_recapture = True
                    warn("TrainStep(mode='cuda_graph'): an optimizer setting read on the host changed after capture "
                         f"(per group: max_grad_norm, master_weights, maximize, record: {self._host_settings} -> "
                         f"{host}); the step is captured again. Schedulable settings (betas, momentum, weight_decay, "
                         "eps of the element-wise optimizers) change without this")
                self.invalidate()
                return self._run_graphed_on_device(x, y, do_step)
            self._host_settings = host
        graph = self._graphs.get(do_step)
        if graph is None:
            return self._capture(x, y, do_step)
        copy_into(self._static, (x, y))
        graph.replay()
        if do_step:
            # The replayed step wrote the optimizer's result tensors (NOTE
            # [persistent step results]); an eager step without gradients may
            # have cleared what last_grad_norm / last_found_inf point at.
            self.optimizer._last.update(self.optimizer._results)
        return self._outs[do_step]

    def _prepare_capture(self, x, y) -> None:
        """What must exist before a capture (NOTE [state before capture])."""
        opt = self.optimizer
        opt.prepare_capture()  # state of every trainable param; lr tensors on the device, checked again
        if self._static is None:
            if tensor_count((x, y)) == 0:
                raise ValueError("TrainStep(mode='cuda_graph'): the batch holds no tensor to copy into the graph's "
                                 "static buffers; use compile_step='compile' or 'off'")
            self._static = empty_like_tree((x, y))  # a buffer per tensor leaf of (inputs, targets)
        if self._pool is None:
            # Both graphs (micro-step and full step) allocate from one pool.
            self._pool = torch.cuda.graph_pool_handle()
        # NOTE [persistent step results]: with accumulate > 1 the two graphs
        # share a pool and may replay in another order than they were captured
        # (a last=True step), so a tensor the full step leaves for the host
        # (non-finite flag, gradient norm) must not live in the pool, where the
        # next micro-step's replay could overwrite it. The optimizer's step
        # writes them into its result tensors, which prepare_capture() made
        # outside the pool (fusetrain::fused_step_'s grad_norm_out/found_inf_out).

    def _capture(self, x, y, do_step: bool):
        self._prepare_capture(x, y)
        copy_into(self._static, (x, y))
        opt, scaler = self.optimizer, self.scaler
        saved_last = dict(opt._last)
        no_grad_before = [p for g in opt.param_groups for p in g["params"] if p.requires_grad and p.grad is None]
        cur = torch.cuda.current_stream(self.device)
        graph = torch.cuda.CUDAGraph()
        fn = self._full if do_step else self._fwd_bwd
        try:
            # NOTE [capture mode]: "thread_local" lets other threads (the
            # DataLoader's pin-memory thread, a logger) call CUDA while this
            # thread captures; the default "global" mode would invalidate the
            # capture at their first call.
            with torch.cuda.graph(graph, pool=self._pool, stream=self._side_stream,
                                  capture_error_mode="thread_local"):
                outs = fn(*self._static)
        except Exception as e:
            self._abandon(graph, cur, opt, scaler, saved_last)
            cause = _root_cause(e)
            raise RuntimeError(
                "TrainStep: the training step could not be captured as a CUDA graph "
                f"({type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}). "
                "The likely cause is a host synchronisation or data-dependent control flow in the model or the loss "
                "(.item(), .tolist(), bool/float/int of a tensor, printing a tensor value, an `if` on a tensor, "
                "nonzero()/masked indexing, .cpu()). Use compile_step='compile' or 'off' for this model, or find the "
                "sync by running an eager step under torch.cuda.set_sync_debug_mode('warn'). The weights and "
                "optimizer state are unchanged") from e
        late = [p for p in no_grad_before if p.grad is not None]
        if late and self.accumulate > 1:
            # The captured backward assigns these .grad tensors instead of
            # accumulating into them, so every micro-step replay would overwrite
            # the gradients summed so far.
            self._abandon(graph, cur, opt, scaler, saved_last)
            for p in late:
                p.grad = None
            raise RuntimeError(
                f"TrainStep: {len(late)} parameter(s) got their first gradient inside the CUDA-graph capture, after "
                f"{self.warmup_steps} warm-up step(s) without one; with accumulate={self.accumulate} the captured "
                "step would overwrite instead of accumulate their gradients. A captured step needs the same "
                "parameters to receive gradients in every step: call invalidate() after unfreezing layers, raise "
                "warmup_steps, or use compile_step='compile'")
        self._graphs[do_step] = graph
        self._outs[do_step] = outs
        if do_step:
            opt._last.update(opt._results)
        # Capture ran nothing: this batch is trained by the first replay.
        graph.replay()
        return outs

    def _abandon(self, graph, cur, opt, scaler, saved_last) -> None:
        """Undo what a failed capture left behind. Capture records kernels
        without running them, so no weight, state or gradient changed."""
        torch.cuda.set_stream(cur)  # capture_end may have failed before leaving the capture stream
        try:
            graph.pool()  # succeeds when the capture ended: the graph then releases its pool itself
        except Exception:
            _ops.abandon_capture(self.device, self._pool)  # NOTE [failed capture] (csrc/api/capture.h)
        scaler._per_optimizer.clear()
        opt._set_amp(None, None)
        opt._last.clear()
        opt._last.update(saved_last)
        self._graphs.clear()
        self._outs.clear()
        self._pool = None
        torch.cuda.synchronize(self.device)
