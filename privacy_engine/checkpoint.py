"""Checkpoints of private training: files that cannot run code, that survive a crash while being
written, that detect damage, and that restore everything or nothing.

``PrivacyEngine.save_checkpoint`` / ``load_checkpoint`` delegate here.

File format (version 1)::

    bytes 0..15    magic  b"PRIVACYENGINECKP"
    bytes 16..19   format version (uint32, little-endian)
    bytes 20..23   reserved (zero)
    bytes 24..31   payload length in bytes (uint64)
    bytes 32..63   SHA-256 of the payload
    bytes 64..     payload: ``torch.save`` of a dict of plain data

The payload holds only tensors, numbers, strings, None, lists, tuples and dicts (``check_plain``
refuses anything else before a byte is written), so it loads with
``torch.load(..., weights_only=True)``: unpickling it builds nothing else and runs no code. The
checksum is verified before anything is unpickled, so a truncated, bit-flipped or foreign file is
reported as such and never reaches the unpickler. ``read_checkpoint`` returns the payload dict for
inspection (plain ``torch.load`` cannot read the file because of the header).

What a checkpoint holds (``build_checkpoint``): the model's state dict; the optimizer's, with its
DP state (noise mechanism, clipper accumulator, counters); the engine's (accountant history,
secure mode, ``noise_plan``); the private loader's sampling state (generator state, position,
cyclic groups); optional scheduler states; and the caller's ``checkpoint_dict`` entries.

It is as sensitive as the training data. Outside secure mode the generator states determine all
future noise and sampling. BandMF's history is past noise, which with the released gradients
reveals past clipped gradients; the cyclic group assignment says which examples share steps; a
clipper accumulator saved between micro-batches is an un-noised gradient sum. In secure mode no
seed or generator state is written (secure sampling draws from the OS and has no state; a resumed
run reseeds its noise generators from the OS), so a secure checkpoint cannot reproduce future noise
or batches; it still holds the history, groups and accumulator above.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import os
import struct
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from privacy_engine.interrupts import deferred_keyboard_interrupt

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "build_checkpoint",
    "check_plain",
    "read_checkpoint",
    "restore_checkpoint",
    "write_checkpoint",
]

MAGIC = b"PRIVACYENGINECKP"
FORMAT_VERSION = 1
PAYLOAD_FORMAT = "privacy_engine.checkpoint/1"
_HEADER = struct.Struct("<16sIIQ32s")  # magic, version, reserved, payload length, sha256: 64 bytes

# Keys the checkpoint writes itself; a caller's checkpoint_dict may not use them.
MODULE_KEY = "module_state_dict"
ENGINE_KEY = "privacy_engine_state_dict"
OPTIMIZER_KEY = "optimizer_state_dict"
LOADER_KEY = "data_loader_state_dict"
NOISE_SCHEDULER_KEY = "noise_scheduler_state_dict"
CLIP_SCHEDULER_KEY = "grad_clip_scheduler_state_dict"
METADATA_KEY = "privacy_engine_metadata"
RESERVED_KEYS = ("format", MODULE_KEY, ENGINE_KEY, OPTIMIZER_KEY, LOADER_KEY, NOISE_SCHEDULER_KEY,
                 CLIP_SCHEDULER_KEY, METADATA_KEY)  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: not a checkpoint, damaged, or not matching the run it is
    loaded into. The message names the file and says what to do."""


# ---------------------------------------------------------------------------------------------- plain data
_PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_PLAIN_HINT = (
    "a checkpoint holds only tensors, numbers, strings, None, lists, tuples and dicts, so that it loads "
    "with torch.load(weights_only=True) and cannot run code; convert it (a dataclass with "
    "dataclasses.asdict, a torch.Generator with get_state(), a numpy array with torch.from_numpy, an "
    "object with its state_dict())"
)


def check_plain(value: Any, name: str = "checkpoint") -> None:
    """Raise ``TypeError`` naming the first entry of ``value`` that is not plain data.

    Plain data: ``None``, bool, int, float, complex, str, bytes, ``torch.dtype``,
    ``torch.device``, ``torch.Size``, tensors (``torch.Tensor`` / ``nn.Parameter``, their Python
    attributes plain too), and dict / OrderedDict / list / tuple of plain data (keys plain
    scalars or tuples of them). Exactly what ``torch.load(weights_only=True)`` rebuilds.

    ===============================  ======================================
    value                            result
    ===============================  ======================================
    plain data (nested)              returns None
    numpy array / scalar, dataclass  TypeError naming it (e.g. ``x['a'][2]``)
    namedtuple, defaultdict, enum    TypeError (subclasses pickle by class)
    a container that holds itself    TypeError
    ===============================  ======================================
    """
    _check_plain(value, name, set())


def _check_plain(value: Any, where: str, open_containers: set[int]) -> None:
    kind = type(value)
    if kind in _PLAIN_SCALARS or kind in (torch.dtype, torch.device, torch.Size):
        return
    if kind in (torch.Tensor, nn.Parameter):
        for attribute, item in vars(value).items():
            _check_plain(item, f"{where}.{attribute}", open_containers)
        return
    if kind not in (dict, OrderedDict, list, tuple):
        raise TypeError(f"{where} is a {kind.__module__}.{kind.__qualname__}: {_PLAIN_HINT}")
    if id(value) in open_containers:
        raise TypeError(f"{where} contains itself; a checkpoint must be a tree of plain data")
    open_containers.add(id(value))
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) not in _PLAIN_SCALARS and type(key) is not tuple:
                raise TypeError(f"{where} has a key of type {type(key).__qualname__}: {_PLAIN_HINT}")
            if type(key) is tuple:
                _check_plain(key, f"{where} key {key!r}", open_containers)
            _check_plain(item, f"{where}[{key!r}]", open_containers)
    else:
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]", open_containers)
    open_containers.discard(id(value))


# ---------------------------------------------------------------------------------------------- the file
def _name(path: Any) -> str:
    if isinstance(path, (str, os.PathLike)):
        return repr(os.fspath(path))
    return repr(getattr(path, "name", f"<{type(path).__name__}>"))


class _HashingWriter:
    """Passes writes on to a file while hashing and counting them (so the payload is streamed
    to disk, never held twice in memory)."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()
        self.length = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.length += view.nbytes
        self.file.write(view)
        return view.nbytes

    def flush(self) -> None:
        self.file.flush()


def _header(length: int, digest: bytes) -> bytes:
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, length, digest)


def _fsync_folder(folder: str) -> None:
    # Makes the rename itself durable. Not every OS/filesystem lets a folder be opened or synced
    # (Windows, some network filesystems): the file's own fsync has happened by then anyway.
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def write_checkpoint(path: Any, checkpoint: dict, **torch_save_kwargs: Any) -> None:
    """Write ``checkpoint`` (plain data, see ``check_plain``) to ``path`` in the checkpoint format.

    Guarantee (``path`` a file name): when the call returns, ``path`` holds the complete
    checkpoint, flushed and fsynced before being renamed over ``path`` (``os.replace``, atomic),
    and the folder is fsynced where the OS allows. If the call raises, or the process is killed
    at any point, ``path`` holds exactly what it held before: the previous checkpoint stays intact
    and loadable. A file object instead of a name is written in place (its owner handles
    atomicity).

    ==========================================  ===========================================
    case                                        result
    ==========================================  ===========================================
    a value is not plain data                   TypeError naming it, nothing written
    folder does not exist                       FileNotFoundError naming it, nothing written
    exception / Ctrl-C while writing            temporary file removed, ``path`` unchanged
    process killed while writing                ``path`` unchanged; a ``.<name>.*.tmp`` file
                                                may be left in the folder (safe to delete)
    replacing an existing file                  its permission bits are kept; a new file is
                                                created readable by its owner only (0600)
    torch_save_kwargs has pickle_module         TypeError: the format is fixed
    ==========================================  ===========================================
    """
    if "pickle_module" in torch_save_kwargs:
        raise TypeError("torch_save_kwargs may not set pickle_module: checkpoints are always plain torch.save data")
    check_plain(checkpoint)
    if not isinstance(path, (str, os.PathLike)):
        buffer = io.BytesIO()
        writer = _HashingWriter(buffer)
        torch.save(checkpoint, writer, **torch_save_kwargs)
        path.write(_header(writer.length, writer.sha256.digest()))
        path.write(buffer.getbuffer())
        path.flush()
        return
    target = os.path.abspath(os.fspath(path))
    folder, base = os.path.split(target)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot save checkpoint {_name(path)}: the folder {folder!r} does not exist")
    descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=f".{base}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(bytes(_HEADER.size))
            writer = _HashingWriter(file)
            torch.save(checkpoint, writer, **torch_save_kwargs)
            file.seek(0)
            file.write(_header(writer.length, writer.sha256.digest()))
            file.flush()
            os.fsync(file.fileno())
        if os.path.exists(target):
            os.chmod(temporary, os.stat(target).st_mode & 0o7777)
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    _fsync_folder(folder)


def read_checkpoint(path: Any, *, map_location: Any = "cpu") -> dict:
    """The payload dict of a checkpoint file, after checking that it is one and is undamaged.

    Guarantee: nothing is unpickled before the header and the SHA-256 of the payload have been
    verified, and the payload is unpickled with ``torch.load(weights_only=True)``: no code from
    the file runs, whatever the file holds. ``map_location`` as in ``torch.load`` (default: CPU;
    the restore moves every tensor to its parameter's device).

    ======================================  ==============================================
    file                                    result (``CheckpointError`` naming the file)
    ======================================  ==============================================
    missing                                 FileNotFoundError
    empty                                   "is empty"
    foreign (a plain torch.save, a pickle)  "is not a privacy_engine checkpoint"
    truncated / extended                    "is truncated" / "has extra bytes"
    payload bit-flipped                     "is damaged (checksum ...)"
    a newer format version                  "format version N"
    payload with non-plain objects          "refused to unpickle" (nothing run)
    ======================================  ==============================================
    """
    name = _name(path)
    if isinstance(path, (str, os.PathLike)):
        with open(path, "rb") as file:
            return _read(file, name, map_location)
    return _read(path, name, map_location)


def _read(file: Any, name: str, map_location: Any) -> dict:
    header = file.read(_HEADER.size)
    if not header:
        raise CheckpointError(f"checkpoint {name} is empty: it was never completely written; use an earlier one")
    if len(header) < _HEADER.size or not header.startswith(MAGIC):
        what = "a plain torch.save/zip archive" if header.startswith(b"PK\x03\x04") else "some other file"
        raise CheckpointError(
            f"{name} is not a privacy_engine checkpoint (it looks like {what}; a checkpoint starts with "
            f"{MAGIC!r} and carries a checksum). Load files written by PrivacyEngine.save_checkpoint; a file from "
            "elsewhere is not unpickled here, as it may run code"
        )
    _, version, reserved, length, digest = _HEADER.unpack(header)
    if version != FORMAT_VERSION or reserved != 0:
        raise CheckpointError(
            f"checkpoint {name} has format version {version} (reserved field {reserved}); this privacy_engine reads "
            f"version {FORMAT_VERSION}: the file is damaged or from a newer version, which can read it"
        )
    to_read = length
    if file.seekable():  # compare sizes first: a damaged length field must not make us allocate it
        start = file.tell()
        available = file.seek(0, os.SEEK_END) - start
        file.seek(start)
        to_read = min(length, available)
    # One bytes object (BytesIO shares it instead of copying): the file is held once in memory.
    payload = file.read(to_read)
    if len(payload) < length:
        raise CheckpointError(
            f"checkpoint {name} is truncated: {len(payload)} of its {length} payload bytes are there (an "
            "interrupted copy?); use an earlier checkpoint or copy it again"
        )
    if file.read(1):
        raise CheckpointError(f"checkpoint {name} has extra bytes after its {length}-byte payload: it is damaged")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(
            f"checkpoint {name} is damaged: the SHA-256 of its payload does not match the one stored with it "
            "(bit flips in storage or transfer); use an earlier checkpoint or copy it again"
        )
    try:
        checkpoint = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except Exception as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"refused to unpickle checkpoint {name}: it holds objects other than tensors and plain data, which "
            f"could run code (torch.load(weights_only=True) said: {first_line}). Files written by "
            "PrivacyEngine.save_checkpoint never do; this one was crafted or altered"
        ) from error
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != PAYLOAD_FORMAT:
        raise CheckpointError(
            f"checkpoint {name} does not hold a {PAYLOAD_FORMAT!r} payload; it was not written by "
            "PrivacyEngine.save_checkpoint"
        )
    return checkpoint


# ---------------------------------------------------------------------------------------------- what goes in
def _dp_optimizer_types() -> tuple[type, ...]:
    from privacy_engine.optimizer import DPOptimizer  # the optimizer module imports the engine's neighbours

    return (DPOptimizer,)


def _is_cyclic_loader_state(state: Any) -> bool:
    return isinstance(state, Mapping) and "groups" in state


def _needs_loader(engine: Any) -> bool:
    """BandMF with cyclic sampling over several groups: the loader's groups must carry over."""
    plan = getattr(engine, "noise_plan", None)
    return plan is not None and int(plan.num_bands) > 1


def build_checkpoint(
    engine: Any,
    *,
    module: nn.Module,
    optimizer: Any = None,
    data_loader: Any = None,
    noise_scheduler: Any = None,
    grad_clip_scheduler: Any = None,
    checkpoint_dict: Mapping[str, Any] | None = None,
    module_state_dict_kwargs: Mapping[str, Any] | None = None,
) -> dict:
    """The payload of ``engine.save_checkpoint`` (plain data; see the module docstring).

    ============================================  ==========================================
    case                                          result
    ============================================  ==========================================
    checkpoint_dict uses a key the checkpoint     ValueError naming the key
    writes itself
    optimizer not the DPOptimizer of the run      TypeError
    data_loader not a DPDataLoader                TypeError
    BandMF / cyclic sampling without data_loader  ValueError: the groups and position must
                                                  be saved to resume
    ============================================  ==========================================
    """
    from privacy_engine.sampling import DPDataLoader

    extra = dict(checkpoint_dict or {})
    clashing = [key for key in extra if key in RESERVED_KEYS]
    if clashing:
        raise ValueError(f"checkpoint_dict uses the key {clashing[0]!r}, which the checkpoint writes itself; rename it")
    if optimizer is not None and not isinstance(optimizer, _dp_optimizer_types()):
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__}; pass the DPOptimizer returned by make_private (its state "
            "holds the noise state)"
        )
    if data_loader is not None and not isinstance(data_loader, DPDataLoader):
        raise TypeError(
            f"data_loader is a {type(data_loader).__name__}; pass the DPDataLoader returned by make_private (it "
            "holds the sampling state)"
        )
    if data_loader is None and _needs_loader(engine):
        raise ValueError(
            "this run uses BandMF noise with cyclic sampling: pass data_loader= to save_checkpoint, so that its "
            "group assignment and position are saved (without them a resumed run could sample an example fewer "
            "than num_bands steps after its last participation, which the accounting does not allow)"
        )
    checkpoint: dict[str, Any] = {"format": PAYLOAD_FORMAT, **extra}
    checkpoint[MODULE_KEY] = module.state_dict(**dict(module_state_dict_kwargs or {}))
    checkpoint[ENGINE_KEY] = engine.state_dict()
    metadata: dict[str, Any] = {"optimizer_class": None, "batch_in_flight": False}
    if optimizer is not None:
        checkpoint[OPTIMIZER_KEY] = optimizer.state_dict()
        metadata["optimizer_class"] = type(optimizer.original_optimizer).__qualname__
    if data_loader is not None:
        checkpoint[LOADER_KEY] = data_loader.state_dict()
        if optimizer is not None:
            metadata["batch_in_flight"] = _batch_in_flight(optimizer, checkpoint[LOADER_KEY]["next_step"])
    if noise_scheduler is not None:
        checkpoint[NOISE_SCHEDULER_KEY] = noise_scheduler.state_dict()
    if grad_clip_scheduler is not None:
        checkpoint[CLIP_SCHEDULER_KEY] = grad_clip_scheduler.state_dict()
    checkpoint[METADATA_KEY] = metadata
    return checkpoint


def _batch_in_flight(optimizer: Any, loader_next_step: int) -> bool:
    """True if the loader has yielded a batch that no released step has used yet (a save between
    drawing a batch and its ``optimizer.step()``, or between micro-batches of one logical step)."""
    last_released = getattr(getattr(optimizer, "contract", None), "last_released_step", None)
    released_next = 0 if last_released is None else last_released + 1
    return loader_next_step > released_next or bool(getattr(optimizer, "_in_logical_step", False))


def _inexact_resume_reason(engine: Any, checkpoint: Mapping, optimizer: Any, data_loader: Any) -> str | None:
    """Why the saved noise generators must not continue (None: they may)."""
    if optimizer is None or engine.secure_mode:
        return None  # nothing restored, or secure mode: the generators are fresh anyway
    if data_loader is None or LOADER_KEY not in checkpoint:
        return "the loader's sampling state was not restored (save and load with data_loader=)"
    if checkpoint.get(METADATA_KEY, {}).get("batch_in_flight"):
        return ("it was saved after a batch was drawn from the loader and before optimizer.step() released it (save "
                "right after optimizer.step())")
    return None


# ---------------------------------------------------------------------------------------------- checks
def _fail(name: str, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {name}: {problem}; nothing was restored")


def check_module_state(module: nn.Module, saved: Any, *, strict: bool = True) -> None:
    """Raise ``ValueError`` naming the first entry where ``saved`` does not fit ``module``
    (missing or unexpected key when ``strict``, another shape or dtype); changes nothing."""
    if not isinstance(saved, Mapping):
        raise ValueError(f"the model state is a {type(saved).__name__}, not a state dict")
    current = module.state_dict()
    if strict:
        missing = [key for key in current if key not in saved]
        if missing:
            raise ValueError(
                f"the model has {missing[0]!r}, which the saved model state lacks ({len(missing)} missing): build "
                "the same model as the saved run"
            )
        unexpected = [key for key in saved if key not in current]
        if unexpected:
            raise ValueError(
                f"the saved model state has {unexpected[0]!r}, which this model lacks ({len(unexpected)} "
                "unexpected): build the same model as the saved run"
            )
    for key, value in current.items():
        if key not in saved or not isinstance(value, torch.Tensor):
            continue
        stored = saved[key]
        if not isinstance(stored, torch.Tensor):
            raise ValueError(f"the saved model state's {key!r} is a {type(stored).__name__}, not a tensor")
        if tuple(stored.shape) != tuple(value.shape) or stored.dtype != value.dtype:
            raise ValueError(
                f"{key!r} was saved with shape {list(stored.shape)} and {stored.dtype}, the model's has shape "
                f"{list(value.shape)} and {value.dtype}: build (and convert) the model as in the saved run"
            )


def check_loader_state(data_loader: Any, state: Any) -> None:
    """Raise ``ValueError`` unless ``data_loader.load_state_dict(state)`` restores a sampling state
    of the same kind: Poisson or cyclic, the same generator kind, and for cyclic sampling groups
    that partition exactly this loader's examples into as many groups. Changes nothing."""
    from privacy_engine.sampling import CyclicPoissonBatchSampler, PoissonBatchSampler

    if not isinstance(state, Mapping):
        raise ValueError(f"the saved loader state is a {type(state).__name__}, not a dict")
    next_step = state.get("next_step")
    if isinstance(next_step, bool) or not isinstance(next_step, int) or next_step < 0:
        raise ValueError(f"the saved loader state's next_step is {next_step!r}, not an int >= 0")
    if callable(getattr(data_loader, "check_state_dict", None)):
        data_loader.check_state_dict(state)  # a loader that knows its own state best
        return
    sampler = data_loader.batch_sampler
    if type(sampler) not in (PoissonBatchSampler, CyclicPoissonBatchSampler):
        return  # another sampler (e.g. distributed): its load_state_dict validates before changing anything
    cyclic = isinstance(sampler, CyclicPoissonBatchSampler)
    if cyclic != _is_cyclic_loader_state(state):
        saved_kind, kind = ("Poisson", "cyclic Poisson") if cyclic else ("cyclic Poisson", "Poisson")
        raise ValueError(
            f"the loader state was saved from {saved_kind} sampling, this loader uses {kind} sampling: make_private "
            "with the same noise mechanism and num_bands / max_batch_size as the saved run"
        )
    if cyclic:
        groups = state["groups"]
        if not isinstance(groups, (list, tuple)) or len(groups) != sampler.num_groups:
            count = len(groups) if isinstance(groups, (list, tuple)) else groups
            raise ValueError(
                f"the loader state has {count} cyclic groups, this loader has {sampler.num_groups}: make_private with "
                "the same num_bands as the saved run"
            )
        for number, group in enumerate(groups):
            if not isinstance(group, torch.Tensor) or group.dim() != 1 or group.is_floating_point():
                raise ValueError(f"the loader state's group {number} is not a 1-D integer tensor")
        members = torch.cat([g.to(torch.long) for g in groups]) if groups else torch.zeros(0, dtype=torch.long)
        population = getattr(sampler, "indices", None)
        if population is None:
            population = torch.arange(sampler.num_samples)
        if members.numel() != population.numel() or not torch.equal(members.sort().values, population.sort().values):
            raise ValueError(
                f"the loader state's groups hold {members.numel()} examples that are not exactly this loader's "
                f"{population.numel()} examples: resume with the same dataset (and train subset) as the saved run"
            )
    saved_kind = state.get("generator")
    kind = sampling_generator_kind(sampler.generator)
    if saved_kind != kind:
        raise ValueError(
            f"the loader state was sampled with {_GENERATOR_KINDS.get(saved_kind, repr(saved_kind))}, this loader "
            f"samples with {_GENERATOR_KINDS[kind]}: make_private with the same secure_mode and noise_generator "
            "settings as the saved run"
        )
    generator_state = state.get("generator_state")
    if kind != "own":
        if generator_state is not None:
            raise ValueError(f"the loader state of a loader sampling with {_GENERATOR_KINDS[kind]} holds a generator "
                             "state: it was altered")
    else:
        size = torch.Generator().get_state().numel()
        if not (isinstance(generator_state, torch.Tensor) and generator_state.dtype == torch.uint8
                and tuple(generator_state.shape) == (size,)):  # fmt: skip
            raise ValueError(f"the loader state's generator_state is not a CPU generator state ({size} uint8 bytes)")


_GENERATOR_KINDS = {
    "own": "its own torch.Generator",
    "global": "torch's global generator",
    "secure": "OS randomness (secure mode)",
}


def sampling_generator_kind(generator: Any) -> str:
    """``"secure"``, ``"global"`` (None: torch's global generator) or ``"own"``."""
    from privacy_engine.secure_random import is_secure_generator

    if is_secure_generator(generator):
        return "secure"
    return "global" if generator is None else "own"


def _check_scheduler(name: str, key: str, scheduler: Any, checkpoint: Mapping) -> None:
    if scheduler is None:
        return
    if key not in checkpoint:
        raise ValueError(f"{name}= was given but the checkpoint holds no {name} state (save it with {name}=)")
    if not callable(getattr(scheduler, "load_state_dict", None)):
        raise TypeError(f"{name} has no load_state_dict(); pass the scheduler whose state was saved")


def _validate(engine: Any, checkpoint: dict, *, module: nn.Module, optimizer: Any, data_loader: Any,
              noise_scheduler: Any, grad_clip_scheduler: Any, strict: bool) -> None:  # fmt: skip
    """Everything a restore will need, checked in the order of the error table of
    ``restore_checkpoint``; raises ValueError / TypeError on the first mismatch."""
    for key in (MODULE_KEY, ENGINE_KEY):
        if key not in checkpoint:
            raise ValueError(f"the checkpoint has no {key!r} (it was altered)")
    engine.check_state_dict(checkpoint[ENGINE_KEY])
    check_module_state(module, checkpoint[MODULE_KEY], strict=strict)
    if optimizer is not None:
        if OPTIMIZER_KEY not in checkpoint:
            raise ValueError(
                "optimizer= was given but the checkpoint holds no optimizer state (it was saved without "
                "optimizer=): load without optimizer=, or use a checkpoint saved with it"
            )
        if not isinstance(optimizer, _dp_optimizer_types()):
            raise TypeError(
                f"optimizer is a {type(optimizer).__name__}; pass the DPOptimizer returned by make_private"
            )
        saved_class = checkpoint.get(METADATA_KEY, {}).get("optimizer_class")
        current_class = type(optimizer.original_optimizer).__qualname__
        if saved_class is not None and saved_class != current_class:
            raise ValueError(
                f"the optimizer state was saved from a {saved_class}, this run's optimizer is a {current_class}: "
                "make the same optimizer private as in the saved run"
            )
        optimizer.check_state_dict(checkpoint[OPTIMIZER_KEY])
    loader_state = checkpoint.get(LOADER_KEY)
    if data_loader is not None:
        if loader_state is None:
            raise ValueError(
                "data_loader= was given but the checkpoint holds no loader state (it was saved without "
                "data_loader=): load without data_loader=, or use a checkpoint saved with it"
            )
        from privacy_engine.sampling import DPDataLoader

        if not isinstance(data_loader, DPDataLoader):
            raise TypeError(f"data_loader is a {type(data_loader).__name__}; pass the DPDataLoader from make_private")
        check_loader_state(data_loader, loader_state)
    saved_plan = checkpoint[ENGINE_KEY].get("noise_plan")
    saved_bands = 1 if not isinstance(saved_plan, Mapping) else int(saved_plan.get("num_bands", 1))
    saved_groups = len(loader_state["groups"]) if _is_cyclic_loader_state(loader_state) else 1
    if saved_bands > 1 or saved_groups > 1 or _needs_loader(engine):
        if loader_state is None:
            raise ValueError(
                "this is a BandMF run with cyclic sampling, but the checkpoint holds no loader state: its group "
                "assignment and position are lost, and a new assignment could sample an example fewer than "
                "num_bands steps after its last participation. Resume from a checkpoint saved with data_loader="
            )
        if data_loader is None:
            raise ValueError(
                "this is a BandMF run with cyclic sampling: pass data_loader= (the DPDataLoader from make_private) "
                "so that its group assignment and position are restored; a new assignment could sample an example "
                "fewer than num_bands steps after its last participation"
            )
    _check_scheduler("noise_scheduler", NOISE_SCHEDULER_KEY, noise_scheduler, checkpoint)
    _check_scheduler("grad_clip_scheduler", CLIP_SCHEDULER_KEY, grad_clip_scheduler, checkpoint)


# ---------------------------------------------------------------------------------------------- restore
def _snapshot_module(module: nn.Module) -> dict:
    return {
        key: value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
        for key, value in module.state_dict().items()
    }


def restore_checkpoint(
    engine: Any,
    checkpoint: dict,
    *,
    name: str,
    module: nn.Module,
    optimizer: Any = None,
    data_loader: Any = None,
    noise_scheduler: Any = None,
    grad_clip_scheduler: Any = None,
    module_load_dict_kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Restore ``checkpoint`` (from ``read_checkpoint``) into the objects given, all or nothing.

    Guarantee: every part is checked against the objects it goes into before any of them changes;
    on any mismatch ``CheckpointError`` names the file and the first mismatch, says what to do,
    and model, optimizer, accountant, noise, loader and schedulers are exactly as they were. The
    restore itself runs with Ctrl-C held off and is undone if a part still fails.

    ==============================================  ============================================
    mismatch (checked in this order)                error names
    ==============================================  ============================================
    secure_mode of the engine                       secure_mode
    accountant kind / damaged history               the accountant kinds
    noise plan (mechanism, bands, coefficients,     the field, saved and current values
    noise multiplier, sample rate, truncation)
    model keys, shapes, dtypes                      the first differing key
    optimizer= given, none in the file              optimizer
    optimizer class, groups, state shapes           the group / parameter
    noise mechanism, coefficients, layout           the noise state field
    clipper bounds / mode                           the clipper field
    data_loader= given, none in the file            data_loader
    loader kind, groups, generator kind             the loader field
    BandMF without loader state or loader           data_loader
    scheduler given, none in the file               the scheduler
    ==============================================  ============================================

    Exact or fresh noise. The saved noise generators continue only if the resume is exact: the
    loader's state is restored and no drawn batch was waiting for its step when the file was saved.
    Otherwise the noise continues from new generators (``NoiseMechanism.reseed``; a warning says
    why), the waiting batch is skipped and a partly accumulated logical step is dropped: the saved
    generators would add the noise the interrupted run added (or was about to add) to one batch to
    another, and two releases with the same noise reveal the difference of their gradients.

    An optimizer state in the file but no ``optimizer=`` restores the rest (with a warning).
    A loader that samples from torch's global generator (one built by hand without a generator)
    restores its position but not that shared generator: its batches do not continue exactly.
    """
    load_kwargs = dict(module_load_dict_kwargs or {})
    try:
        _validate(engine, checkpoint, module=module, optimizer=optimizer, data_loader=data_loader,
                  noise_scheduler=noise_scheduler, grad_clip_scheduler=grad_clip_scheduler,
                  strict=bool(load_kwargs.get("strict", True)))  # fmt: skip
    except (ValueError, TypeError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise _fail(name, str(error)) from error
    if optimizer is None and OPTIMIZER_KEY in checkpoint:
        warnings.warn(
            f"checkpoint {name} holds an optimizer state (with the noise state) but no optimizer= was given: it is not "
            "restored, so training on would continue with the current optimizer's noise",
            stacklevel=3,
        )
    fresh_noise_reason = _inexact_resume_reason(engine, checkpoint, optimizer, data_loader)
    batch_in_flight = bool(checkpoint.get(METADATA_KEY, {}).get("batch_in_flight"))
    undo: list = []
    with deferred_keyboard_interrupt():
        try:
            engine_backup = engine.state_dict(), engine.noise_plan
            undo.append(lambda: _restore_engine(engine, engine_backup))
            engine.load_state_dict(checkpoint[ENGINE_KEY])
            if data_loader is not None:
                loader_backup = data_loader.state_dict()
                undo.append(lambda: data_loader.load_state_dict(loader_backup))
                data_loader.load_state_dict(checkpoint[LOADER_KEY])
            if optimizer is not None:
                optimizer_backup = optimizer.state_dict()
                undo.append(lambda: optimizer.load_state_dict(optimizer_backup))
                optimizer.load_state_dict(checkpoint[OPTIMIZER_KEY])
                if fresh_noise_reason is not None:
                    optimizer.noise.reseed()
                if batch_in_flight:
                    optimizer.discard_logical_step()
            module_backup = _snapshot_module(module)
            undo.append(lambda: module.load_state_dict(module_backup))
            module.load_state_dict(checkpoint[MODULE_KEY], **load_kwargs)
            for scheduler, key in ((noise_scheduler, NOISE_SCHEDULER_KEY), (grad_clip_scheduler, CLIP_SCHEDULER_KEY)):
                if scheduler is not None:
                    backup = copy.deepcopy(scheduler.state_dict())
                    undo.append(lambda scheduler=scheduler, backup=backup: scheduler.load_state_dict(backup))
                    scheduler.load_state_dict(checkpoint[key])
        except BaseException as error:
            for step in reversed(undo):
                step()
            if isinstance(error, (ValueError, TypeError, RuntimeError)) and not isinstance(error, CheckpointError):
                raise _fail(name, f"{type(error).__name__}: {error}") from error
            raise
    if fresh_noise_reason is not None:
        warnings.warn(
            f"checkpoint {name}: the noise continues from new generators, not the saved ones, because "
            f"{fresh_noise_reason}. The saved generators would add noise the interrupted run used on one batch to "
            "another batch, which reveals the difference of their gradients. Training stays private; it is not "
            "bit-identical to an uninterrupted run.",
            stacklevel=3,
        )


def _restore_engine(engine: Any, backup: tuple) -> None:
    state, plan = backup
    engine.accountant.load_state_dict(state["accountant"])
    engine.noise_plan = plan


# ---------------------------------------------------------------------------------------------- engine state
def plan_to_dict(plan: Any) -> dict | None:
    """A ``NoisePlan`` as plain data (None stays None)."""
    return None if plan is None else dataclasses.asdict(plan)


def plan_from_dict(data: Any) -> Any:
    """The ``NoisePlan`` written by ``plan_to_dict``; ValueError naming an unknown or missing field."""
    from privacy_engine.engine import BandCandidate, NoisePlan

    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise ValueError(f"the saved noise_plan is a {type(data).__name__}, not a dict")
    fields = {field.name for field in dataclasses.fields(NoisePlan)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(
            f"the saved noise_plan has fields {unknown} that this version's NoisePlan lacks: load it with the "
            "version of privacy_engine that wrote it"
        )
    values = dict(data)
    if values.get("coefficients") is not None:
        values["coefficients"] = tuple(float(c) for c in values["coefficients"])
    candidate_fields = {field.name for field in dataclasses.fields(BandCandidate)}
    candidates = []
    for candidate in values.get("candidates", ()):
        if not isinstance(candidate, Mapping) or set(candidate) != candidate_fields:
            raise ValueError("the saved noise_plan's candidates are not BandCandidate fields")
        candidates.append(BandCandidate(**candidate))
    values["candidates"] = tuple(candidates)
    try:
        return NoisePlan(**values)
    except TypeError as error:
        raise ValueError(f"the saved noise_plan does not rebuild a NoisePlan: {error}") from error


#: NoisePlan fields a resumed run must share with the saved one (the rest describe how it was chosen).
PLAN_FIELDS_TO_MATCH = ("mechanism", "num_bands", "coefficients", "noise_multiplier", "sample_rate", "group_size",
                        "max_batch_size")  # fmt: skip


def check_engine_state(engine: Any, state: Any) -> Any:
    """Check an engine state dict against ``engine``; return its ``NoisePlan`` (or None).

    Raises ValueError naming the first mismatch: not a dict, secure_mode, accountant kind or a
    damaged accountant state, a noise plan that differs from the engine's own in one of
    ``PLAN_FIELDS_TO_MATCH``. Changes nothing."""
    if not isinstance(state, Mapping) or "accountant" not in state or "secure_mode" not in state:
        raise ValueError("the engine state is not a dict with 'accountant' and 'secure_mode' (it was altered)")
    if state["secure_mode"] is not engine.secure_mode:
        raise ValueError(
            f"it was written by a PrivacyEngine(secure_mode={state['secure_mode']!r}), this engine has "
            f"secure_mode={engine.secure_mode}: build PrivacyEngine(secure_mode={state['secure_mode']!r}) to resume it"
        )
    accountant_state = state["accountant"]
    saved_kind = accountant_state.get("accountant") if isinstance(accountant_state, Mapping) else None
    if saved_kind != engine.accountant.name:
        raise ValueError(
            f"its accountant is {saved_kind!r}, this engine's is {engine.accountant.name!r}: build "
            f"PrivacyEngine(accountant={saved_kind!r}) to resume it"
        )
    engine.accountant.fresh().load_state_dict(dict(accountant_state))  # validates, changes nothing here
    plan = plan_from_dict(state.get("noise_plan"))
    current = engine.noise_plan
    if plan is not None and current is not None:
        for field in PLAN_FIELDS_TO_MATCH:
            saved_value, value = getattr(plan, field), getattr(current, field)
            if saved_value != value:
                raise ValueError(
                    f"it was saved from a run with {field}={saved_value!r}, this engine was made private with "
                    f"{field}={value!r}: call make_private with the settings of the saved run"
                )
    return plan
