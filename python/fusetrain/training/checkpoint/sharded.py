"""Checkpoints of sharded runs (``multi_gpu: fsdp``), with ``torch.distributed.checkpoint``.

NOTE [sharded checkpoints]: a checkpoint file of an fsdp run
(``ckpt_latest.pth``, ``ckpt_best.pth``, ...) holds everything the files of
other runs hold except the sharded tensors, plus ``"shards"``: the name of a
folder under ``<experiment>/shards/`` into which every rank wrote its shards
with ``dcp.save`` (the weights, the optimizer state with master weights, the
EMA weights and their remainders), keyed by parameter names, so any number of processes (one
included, without a process group) can load it; its metadata and
non-tensor values are read as data (NOTE [checkpoints are data]). The
folder is written first and is complete when ``dcp.save`` returns (its
``.metadata`` is written last, after every rank's files); only then does
rank 0 write the small file, atomically. A crash mid-save leaves the previous file and the folder it names.
After each save, folders that no checkpoint file names are deleted.

:func:`full_state_dict` reads the full weights of any checkpoint (sharded or
not) in one process, for inference; ``python -m
fusetrain.training.checkpoint.sharded CKPT OUT [--ema]`` writes them as a
plain ``state_dict`` file.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pickle
import re
import shutil
import uuid
import warnings
from typing import Any, Dict

import torch
from torch import nn

from ...optim._base import FusedOptimizer
from .files import UntrustedCheckpointError, atomic_save, load_checkpoint

__all__ = ["SHARDS", "ShardedState", "collect_garbage", "folder", "full_state_dict", "new_name"]

SHARDS = "shards"
_CKPT_FILE = re.compile(r"ckpt_.*\.pth")


class _MetadataUnpickler(pickle.Unpickler):
    """Reads a DCP ``.metadata`` file as data (NOTE [checkpoints are data]): the only globals it resolves are
    DCP's metadata classes, torch dtypes and sizes, layouts and paths; anything else is refused."""

    _DCP = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")

    def find_class(self, module: str, name: str) -> Any:
        obj = getattr(importlib.import_module(module), name, None) if module in self._DCP + (
            "torch", "pathlib", "torch.serialization") else None
        allowed = (isinstance(obj, type) and module in self._DCP and obj.__module__ == module
                   or isinstance(obj, torch.dtype) or obj is torch.Size
                   or (module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath",
                                                        "PureWindowsPath"))
                   or (module == "torch.serialization" and name == "_get_layout"))
        if not allowed:
            raise pickle.UnpicklingError(f"the sharded checkpoint's metadata names {module}.{name}, which is not "
                                         f"data; it is not read")
        return obj


def _reader(path: str):
    """DCP's file reader for ``path``, reading the metadata and the non-tensor values as data; a metadata file
    that is not data is refused here, with the error naming it."""
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise UntrustedCheckpointError(f"{os.path.join(path, '.metadata')}: {e}") from None
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class DataReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return DataReader(path)


def _planner():
    """DCP's load planner, reading the non-tensor values (optimizer settings) with weights_only=True."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class DataLoadPlanner(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__(allow_partial_load=True)  # ShardedState.load: what the folder lacks stays

        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return DataLoadPlanner()


def folder(ckpt_path: str, name: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(ckpt_path)), SHARDS, name)


def new_name(global_step: int) -> str:
    """A fresh folder name, the same on every rank (rank 0 picks it)."""
    import torch.distributed as dist

    pick = [f"step_{global_step}_{uuid.uuid4().hex[:8]}"]
    if dist.is_initialized():
        dist.broadcast_object_list(pick, src=0)
    return pick[0]


class ShardedState:
    """The sharded tensors of a ``multi_gpu: fsdp`` run (NOTE [sharded checkpoints]): the model's weights, the
    optimizer's state with its master weights, and the EMA's module and remainders, which every rank writes into
    and reads from a shard folder (``torch.distributed.checkpoint``), resharded to any number of processes."""

    def __init__(self, model: nn.Module, opt: Any, ema: Any = None) -> None:
        self.model, self.opt, self.ema = model, opt, ema

    def _states(self) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model_sd, opt_sd = get_state_dict(self.model, self.opt)
        state = {"model": model_sd, "optimizer": opt_sd}
        if self.ema is not None:
            state["ema"] = get_model_state_dict(self.ema.module)
            remainders = self.ema.remainder_tensors()
            if remainders:
                state["ema_remainders"] = dict(remainders)
        return state

    def save(self, path: str) -> None:
        """Every rank writes its shards into the folder ``path``."""
        import torch.distributed.checkpoint as dcp

        # NOTE [replicated tensors from rank 0]: a tensor every rank holds whole (a
        # buffer: BatchNorm statistics differ per rank without sync_bn; an EMA
        # buffer's remainder) is written by rank 0, not by whichever rank has the
        # least to write, so a bfloat16 EMA buffer and its remainder come from one
        # rank and the file agrees with what rank 0 validated.
        dcp.save(self._states(), checkpoint_id=path, planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))

    def load(self, path: str, ckpt_path: str) -> None:
        """Load the shards of the folder ``path`` (named by the checkpoint file ``ckpt_path``) into this run's
        tensors, whatever its number of processes; what the folder lacks (an EMA the checkpoint was trained
        without, remainders it did not keep) stays as it is."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise FileNotFoundError(f"resume: {ckpt_path} names the sharded state {path}, which is missing or "
                                    f"incomplete (no .metadata); allowed: a checkpoint file next to its {SHARDS}/ "
                                    f"folder")
        # DCP loads into existing tensors. A fresh fusetrain optimizer makes its state without stepping; for
        # another optimizer get_state_dict makes it with one zero-lr step.
        if isinstance(self.opt, FusedOptimizer):
            self.opt.init_state()
        # NOTE [resume hyperparameters]: the groups' settings (lr tensors, betas, ...) stay the run's own.
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        state = self._states()
        with warnings.catch_warnings():  # one process without a process group: DCP says so
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, storage_reader=_reader(path), planner=_planner())
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        for g, current in zip(self.opt.param_groups, settings):
            g.update(current)
        if "ema" in state:
            set_model_state_dict(self.ema.module, state["ema"])


def collect_garbage(run_dir: str) -> None:
    """Delete the shard folders no checkpoint file names (replaced ones, and
    those of saves a crash interrupted). Rank 0, after writing a checkpoint file."""
    root = os.path.join(run_dir, SHARDS)
    if not os.path.isdir(root):
        return
    named = set()
    for f in os.listdir(run_dir):
        if _CKPT_FILE.fullmatch(f):
            try:
                named.add(load_checkpoint(os.path.join(run_dir, f), mmap=True).get("shards"))
            except ValueError:  # a file not read as data (an older checkpoint) may name any folder: keep them
                return
    for name in os.listdir(root):
        if name not in named:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def full_state_dict(ckpt_path: str, ema: bool = False, trusted: bool = False,
                    trust: str = "trusted=True") -> Dict[str, torch.Tensor]:
    """The full weights (``model.state_dict()`` keys, CPU tensors) of a
    checkpoint file, sharded or not; ``ema=True``: the EMA's weights. Read as
    data unless ``trusted`` (NOTE [checkpoints are data])."""
    ck = load_checkpoint(ckpt_path, trusted=trusted, trust=trust)
    if ema and ck.get("ema") is None:
        raise ValueError(f"{ckpt_path} has no EMA weights (trained without ema); allowed: ema=False")
    if ck.get("shards") is None:
        return ck["ema"]["module"] if ema else ck["model"]
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    key = "ema" if ema else "model"
    path = folder(ckpt_path, ck["shards"])
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"{ckpt_path} names the sharded state {path}, which is missing or incomplete")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        return _load_state_dict_from_keys(keys={key}, storage_reader=_reader(path))[key]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fusetrain.training.checkpoint.sharded",
                                     description="Write the full weights of a checkpoint (sharded or not) as a "
                                                 "plain state_dict file, for inference.")
    parser.add_argument("checkpoint", help="a checkpoint file, e.g. checkpoints/<experiment>/ckpt_best.pth")
    parser.add_argument("output", help="the state_dict file to write")
    parser.add_argument("--ema", action="store_true", help="the EMA's weights instead of the model's")
    parser.add_argument("--trusted", action="store_true",
                        help="read the checkpoint with any pickle allowed (it may run code from the file)")
    args = parser.parse_args(argv)
    weights = full_state_dict(args.checkpoint, ema=args.ema, trusted=args.trusted, trust="--trusted")
    atomic_save(weights, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
