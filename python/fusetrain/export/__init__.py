"""Export a trained model for inference and check it against the eager model.

``export_model(model, example, "model.pt2")`` writes a ``torch.export``
program; ``"model.onnx"`` an ONNX graph (needs the ``onnx`` and
``onnxscript`` packages: ``pip install 'fusetrain[export]'``). The batch
dimension of every tensor input is dynamic when the example batch has at
least two samples. After writing, the saved file is loaded back and run on the
example (ONNX through onnxruntime when it is installed); outputs that differ
from the eager model's beyond the tolerance are an error, and the file is
removed. Files are written atomically.

From a recipe and a checkpoint, :mod:`fusetrain.export.cli`::

    python -m fusetrain.export --config-name=default --checkpoint runs/default/ckpt_best.pth --out model.onnx
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["FORMATS", "check_onnx_packages", "export_model"]

FORMATS = {".pt2": "torch_export", ".onnx": "onnx"}


def _args(example: Any) -> Tuple[Any, ...]:
    return tuple(example) if isinstance(example, (tuple, list)) else (example,)


def _dynamic_shapes(args: Tuple[Any, ...]):
    """Dim 0 of every tensor input is the (shared) batch dimension."""
    tensors = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
    if not tensors or min(t.dim() for t in tensors) < 1 or min(t.shape[0] for t in tensors) < 2:
        return None  # a batch of one would be specialised: export static shapes
    batch = torch.export.Dim("batch", min=1)
    return pytree.tree_map(lambda a: {0: batch} if isinstance(a, torch.Tensor) and a.dim() >= 1 else None, args)


def _flat_outputs(out: Any) -> list:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _max_diff(got: Sequence[Any], ref: Sequence[torch.Tensor], rtol: float, atol: float, fmt: str) -> float:
    if len(got) != len(ref):
        raise ValueError(f"export ({fmt}): the exported model returns {len(got)} tensors, the eager model "
                         f"{len(ref)}")
    worst = 0.0
    for i, (g, r) in enumerate(zip(got, ref)):
        g = torch.as_tensor(g).to(r.device)
        if g.shape != r.shape:
            raise ValueError(f"export ({fmt}): output {i} has shape {tuple(g.shape)}, the eager model's "
                             f"{tuple(r.shape)}")
        if r.is_floating_point():
            diff = (g.double() - r.double()).abs()
            worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
            if not torch.allclose(g.to(r.dtype), r, rtol=rtol, atol=atol, equal_nan=True):
                raise ValueError(f"export ({fmt}): output {i} differs from the eager model by up to {worst:.3g} "
                                 f"(rtol {rtol}, atol {atol})")
        elif not torch.equal(g.to(r.dtype), r):
            raise ValueError(f"export ({fmt}): output {i} differs from the eager model")
    return worst


def check_onnx_packages() -> None:
    missing = [m for m in ("onnx", "onnxscript") if not _importable(m)]
    if missing:
        raise ValueError(f"export: ONNX needs the package(s) {', '.join(missing)} (pip install "
                         f"'fusetrain[export]'); a .pt2 path (torch.export) needs nothing")


def _importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except ImportError:
        return False


def export_model(model: nn.Module, example: Any, path: str, check: bool = True, rtol: float = 1e-4,
                 atol: float = 1e-5) -> Dict[str, Any]:
    """Export ``model`` (put in eval mode) called as ``model(*example)`` to
    ``path`` (``.pt2`` or ``.onnx``); returns ``{"path", "format",
    "dynamic_batch", "checked", "max_abs_diff"}`` (``checked`` is False only
    for ONNX without onnxruntime)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ValueError(f"export: got {path!r}; allowed: a path ending in {' or '.join(FORMATS)}")
    fmt = FORMATS[ext]
    if fmt == "onnx":
        check_onnx_packages()
    args = _args(example)
    model = model.eval()
    with torch.no_grad():
        ref = _flat_outputs(model(*args))
    dynamic = _dynamic_shapes(args)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp_" + os.path.basename(path), suffix=ext, dir=directory)
    os.close(fd)
    try:
        if fmt == "torch_export":
            program = torch.export.export(model, args, dynamic_shapes=dynamic)
            torch.export.save(program, tmp)
        else:
            torch.onnx.export(model, args, tmp, dynamo=True, dynamic_shapes=dynamic, verbose=False)
        checked, worst = False, float("nan")
        if check:
            got = _run_saved(fmt, tmp, args)
            if got is not None:
                worst, checked = _max_diff(got, ref, rtol, atol, fmt), True
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"path": path, "format": fmt, "dynamic_batch": dynamic is not None, "checked": checked,
            "max_abs_diff": worst}


def _run_saved(fmt: str, path: str, args: Tuple[Any, ...]) -> Optional[list]:
    if fmt == "torch_export":
        with torch.no_grad():
            return _flat_outputs(torch.export.load(path).module()(*args))
    if not _importable("onnxruntime"):
        return None
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    feeds = [t.detach().cpu().numpy() for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    names = [i.name for i in session.get_inputs()]
    return [torch.from_numpy(o) for o in session.run(None, dict(zip(names, feeds)))]
