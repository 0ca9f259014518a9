"""Checkpoints of a run ``make_private`` built for a ``fully_shard`` (FSDP2) model: the model's and the
optimizer's sharded state through ``torch.distributed.checkpoint`` (DCP), the engine's own state per
rank in this package's verified file format.

A checkpoint is a folder::

    PATH/sharded/      DCP's files (every rank writes its shards; rank 0 the metadata)
    PATH/rank{r}.pt    rank r's engine state (``file.write_checkpoint``): the ledger, secure mode and
                       noise plan (equal on every rank), this rank's noise stream (BandMF/BLT: with
                       the history of its shard) and step counter,
                       this rank's sampling state (seed, next step)

Save and load are collective (every rank calls them with the same ``path``). What a load restores is
what a run without the interruption would have had after the same step: the parameters, the optimizer's
moments, each rank's noise stream and sampler position and the ledger, so the run goes on with the same
batches, the same noise and the same epsilon (secure mode: fresh OS randomness instead, as for one
process). Loading never runs code from the folder: the rank files are verified (SHA-256) and unpickled
with ``weights_only=True``, DCP's tensors are read with ``weights_only=True`` too, its non-tensor items are
checked with ``weights_only=True`` before DCP unpickles them (``_SafeLoadPlanner``), and DCP's metadata file
(a pickle in DCP's format) is unpickled by ``_MetadataUnpickler``, which builds only DCP's metadata
classes, torch sizes and dtypes and plain containers, and refuses every other global.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from privacy_engine.engine.checkpoint.file import PAYLOAD_FORMAT, CheckpointError, read_checkpoint, write_checkpoint
from privacy_engine.training.distributed_sampling import DistributedDPDataLoader
from privacy_engine.training.fsdp_private import FSDPPrivateOptimizer

__all__ = ["load_sharded_checkpoint", "save_sharded_checkpoint"]

_FORMAT = "privacy_engine.fsdp/1"

# The globals DCP's metadata pickle may name: its own dataclasses, torch's Size and dtypes, plain containers.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_PLAIN_GLOBALS = {("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"), ("builtins", "frozenset"),
                  ("builtins", "slice"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                  ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
                  ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                  ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata building nothing but its plain classes (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN_GLOBALS or module in _METADATA_MODULES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"DCP metadata names {module}.{name}, which a checkpoint never needs: refused")


class _SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read by ``_MetadataUnpickler`` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with every non-tensor item (DCP stores them as pickles and loads them with
    ``torch.load(weights_only=False)``) first read with ``weights_only=True``: a pickle naming anything but
    plain data is refused before DCP unpickles it."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise CheckpointError(f"the sharded checkpoint's item {read_item.dest_index.fqn!r} is not plain data: "
                                  f"refused ({error})") from error  # fmt: skip
        value.seek(0)
        super().load_bytes(read_item, value)


def _check_objects(optimizer: Any, data_loader: Any) -> tuple[FSDPPrivateOptimizer, DistributedDPDataLoader]:
    if not isinstance(optimizer, FSDPPrivateOptimizer):
        raise TypeError("optimizer must be the optimizer make_private returned for the fully_shard model "
                        f"(FSDPPrivateOptimizer); got {type(optimizer).__name__}")  # fmt: skip
    if not isinstance(data_loader, DistributedDPDataLoader) or data_loader.distributed_job is None:
        raise TypeError("data_loader must be the loader make_private returned for the fully_shard model")
    return optimizer, data_loader


def save_sharded_checkpoint(engine: Any, path: Any, *, module: torch.nn.Module, optimizer: Any,
                            data_loader: Any) -> None:  # fmt: skip
    """Save the sharded run to the folder ``path`` (collective: every rank, between steps).

    Guarantee: the new checkpoint is written into ``PATH.partial`` and renamed to ``path`` by rank 0 only
    once every rank has written its part (the ranks meet at a barrier under the job's timeout): an
    exception or a kill on any rank while writing leaves the previous checkpoint at ``path`` intact. The
    previous folder is first renamed ``PATH.previous`` and removed after the rename; a kill between the
    two renames leaves it there (load it by that name).

    ==========================================  =========================================
    case                                        result (nothing written)
    ==========================================  =========================================
    optimizer / data_loader not make_private's  TypeError
    the folder above ``path`` does not exist    FileNotFoundError naming it
    a rank fails or stalls                      the others raise ``DistributedStepError``
    ==========================================  =========================================
    """
    optimizer, data_loader = _check_objects(optimizer, data_loader)
    job = data_loader.distributed_job
    target = Path(os.path.abspath(os.fspath(path)))
    if not target.parent.is_dir():
        raise FileNotFoundError(f"cannot save checkpoint {str(path)!r}: the folder {str(target.parent)!r} does not exist")
    partial = target.with_name(target.name + ".partial")
    if job.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    job.barrier("the sharded checkpoint's folder")
    model_state, optimizer_state = get_state_dict(module, optimizer.original_optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=partial / "sharded")
    write_checkpoint(partial / f"rank{job.rank}.pt", {
        "format": PAYLOAD_FORMAT, "sharded_format": _FORMAT, "rank": job.rank, "world_size": job.world_size, "engine": engine.state_dict(),
        "optimizer": optimizer.state_dict(), "sampling": data_loader.state_dict(),
    })  # fmt: skip
    job.barrier("every rank's part of the sharded checkpoint")
    if job.rank == 0:
        previous = target.with_name(target.name + ".previous")
        if target.exists():
            shutil.rmtree(previous, ignore_errors=True)
            os.replace(target, previous)
        os.replace(partial, target)
        shutil.rmtree(previous, ignore_errors=True)
    job.barrier("renaming the sharded checkpoint")


def load_sharded_checkpoint(engine: Any, path: Any, *, module: torch.nn.Module, optimizer: Any,
                            data_loader: Any) -> None:  # fmt: skip
    """Restore ``save_sharded_checkpoint``'s folder into the objects of a fresh ``make_private`` with the same
    settings and number of ranks (collective: every rank).

    Guarantee: this rank's file is verified and every part checked against the run (format, rank and
    number of ranks, ledger and noise plan, sigma, C, rate, secure mode, dataset and grouping) before
    anything changes; on a mismatch ``CheckpointError`` names the file and the mismatch and nothing is
    restored on this rank. Then DCP reads the shards (no code runs, see the module docstring) and the
    model, the optimizer, the ledger, the noise stream and the sampler continue as after the saved step.
    Ranks must all succeed: a rank that raised leaves the others waiting at DCP's collectives until the
    timeout.
    """
    optimizer, data_loader = _check_objects(optimizer, data_loader)
    job = data_loader.distributed_job
    folder = Path(os.fspath(path))
    name = f"{folder}/rank{job.rank}.pt"
    if not (folder / "sharded").is_dir():
        raise CheckpointError(f"{str(folder)!r} is not a sharded checkpoint (no sharded/ folder)")
    state = read_checkpoint(name)
    try:
        if state.get("sharded_format") != _FORMAT:
            raise ValueError(f"not a rank's part of a sharded checkpoint (expected {_FORMAT!r})")
        if int(state["world_size"]) != job.world_size or int(state["rank"]) != job.rank:
            raise ValueError(f"saved by rank {state['rank']} of {state['world_size']}; this is rank {job.rank} of "
                             f"{job.world_size}: resume with the same number of ranks")  # fmt: skip
        engine.check_state_dict(state["engine"])
        optimizer.check_state_dict(state["optimizer"])
        sampler = data_loader.batch_sampler
        sampling = state["sampling"]
        for key in ("kind", "num_samples", "population", "num_groups", "rank", "world_size", "secure"):
            mine = sampler.state_dict()[key]
            if sampling.get(key) != mine:
                raise ValueError(f"sampling state has {key}={sampling.get(key)!r}; this loader has {mine!r}")
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"checkpoint {name!r} does not fit this run: {error}") from error
    model_state, optimizer_state = get_state_dict(module, optimizer.original_optimizer)
    loaded = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(loaded, storage_reader=_SafeReader(folder / "sharded"), planner=_SafeLoadPlanner())
    set_state_dict(module, optimizer.original_optimizer, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optimizer"])  # fmt: skip
    engine.load_state_dict(state["engine"], optimizer=optimizer)
    optimizer.load_state_dict(state["optimizer"])
    data_loader.load_state_dict(sampling)
