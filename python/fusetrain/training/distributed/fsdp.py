"""Sharded data parallelism in the Trainer (``multi_gpu: fsdp``): FSDP2.

:func:`shard` applies ``torch.distributed.fsdp.fully_shard`` to the model
(and to the EMA copy, so the EMA is sharded exactly like the weights it
follows): first to each module the wrap policy picks, innermost first, then to
the root. Parameters become DTensor shards; fusetrain's optimizers step the
local shards (NOTE [sharded steps] in ``fusetrain.optim._sharded``). The
mixed-precision policy follows ``mixed_precision`` (parameters all-gathered in
bf16/fp16 for compute, gradients reduced in fp32).

:func:`lockstep` keeps every rank's evaluation loop in step: a sharded
forward all-gathers parameters, so all ranks must run the same number of
forwards even when their shards of a validation set differ by a batch.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, List, Sequence, Tuple

import torch
from torch import nn

from ..task.registry import import_path

__all__ = ["BLOCKS", "wrap_targets", "shard", "find_fsdp", "grad_sync", "lockstep", "is_fsdp"]

#: The default wrap policy: every child of an ``nn.ModuleList`` / ``nn.Sequential`` that has parameters.
BLOCKS = "blocks"


def _policy(spec: Any) -> Callable[[nn.Module], bool]:
    """A user's wrap policy (validated by training_params) as a predicate on modules."""
    if isinstance(spec, (list, tuple)):
        names = set(spec)
        return lambda m: type(m).__name__ in names
    fn = import_path(spec, "training_params.fsdp_params.wrap") if isinstance(spec, str) else spec
    return lambda m: bool(fn(m))


def wrap_targets(model: nn.Module, spec: Any = BLOCKS) -> List[nn.Module]:
    """The submodules that get their own ``fully_shard`` (each an all-gather /
    reduce-scatter unit), innermost first; the root is sharded after them.

    ``spec``: ``"blocks"`` (every child with parameters of an ``nn.ModuleList``
    or ``nn.Sequential``: the repeated blocks of most models), a list of class
    names, or a function ``module -> bool`` (or its path)."""
    if spec == BLOCKS:
        chosen = {id(c) for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))
                  for c in m.children() if any(True for _ in c.parameters())}
    else:
        want = _policy(spec)
        chosen = {id(m) for m in model.modules() if want(m)}
    chosen.discard(id(model))
    return [m for m in reversed(list(model.modules())) if id(m) in chosen]  # descendants before ancestors


def _mp_policy(precision_name: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision_name == "fp32":
        return MixedPrecisionPolicy()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision_name]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard(modules: Sequence[nn.Module], device: torch.device, world_size: int, wrap: Any,
          reshard_after_forward: bool, precision_name: str) -> None:
    """``fully_shard`` each of ``modules`` in place over a 1-d mesh of all ranks
    (same policy for each: the EMA copy shards like the model)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    kwargs = dict(mesh=mesh, mp_policy=_mp_policy(precision_name), reshard_after_forward=reshard_after_forward)
    # NOTE [fp32 batch norm]: a BatchNorm's weights cast to bf16 would meet its fp32 running statistics in
    # one kernel (an error); each BatchNorm is its own unit with fp32 weights, as under autocast.
    fp32 = dict(kwargs, mp_policy=_mp_policy("fp32"))
    for module in modules:
        norms = [] if precision_name == "fp32" else [m for m in module.modules()
                                                     if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        for sub in norms:
            fully_shard(sub, **fp32)
        for sub in wrap_targets(module, wrap):
            if not any(sub is n for n in norms):
                fully_shard(sub, **kwargs)
        fully_shard(module, **kwargs)


def find_fsdp(model: nn.Module):
    """The root FSDP2 module under ``torch.compile`` wrappers, or None."""
    from torch.distributed.fsdp import FSDPModule

    while not isinstance(model, FSDPModule):
        model = getattr(model, "_orig_mod", None)
        if model is None:
            return None
    return model


def is_fsdp(model: nn.Module) -> bool:
    return find_fsdp(model) is not None


@contextlib.contextmanager
def grad_sync(model: nn.Module, sync: bool):
    """An accumulation micro-batch: gradients stay unreduced (FSDP2's
    ``set_requires_gradient_sync(False)``) until the stepping micro-batch."""
    root = find_fsdp(model)
    if root is None or sync:
        yield
        return
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


def lockstep(batches: Iterable[Any], device: torch.device, what: str) -> Iterator[Tuple[Any, bool]]:
    """Yield ``(batch, real)`` until every rank has run out of batches: one
    all-reduce of "has a batch" per batch (evaluation only, never in a training
    step). A rank whose shard ended repeats its last batch with ``real``
    False; the caller runs the forward (its collectives) and drops the result."""
    import torch.distributed as dist

    it = iter(batches)
    last = None
    while True:
        batch = next(it, None)
        flag = torch.tensor([0.0 if batch is None else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0.0:
            return
        if batch is None:
            if last is None:
                raise ValueError(f"{what}: this rank's shard has no batch while other ranks have some (fewer "
                                 f"samples than processes); allowed with multi_gpu 'fsdp': at least one batch per "
                                 f"process")
            yield last, False
        else:
            last = batch
            yield batch, True
