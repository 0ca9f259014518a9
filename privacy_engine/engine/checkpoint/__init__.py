"""Checkpoints of private training: files that cannot run code, that survive a crash while being
written, that detect damage, and that restore everything or nothing.

``PrivacyEngine.save_checkpoint`` / ``load_checkpoint`` delegate here. Modules, in the order of a
save and a load: ``plain`` (what may be saved), ``contents`` (what is saved, under which keys),
``file`` (the format: atomic write, verified read), ``checks`` and ``engine_state`` (does it fit
the run it is loaded into?), ``restore`` (all or nothing). A run ``make_private`` built for a ``fully_shard``
model is saved as a folder instead (``sharded``: DCP for the shards, this format for each rank's engine state).

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

A valid checksum proves only that the file is as written, not that it was written by us: before
unpickling, a path that is not a regular file (a FIFO would block forever) is refused, the payload is
never read beyond the bytes really there, and an archive whose entries are compressed (``torch.save``
stores them; a compressed one is a bomb) or declare more bytes than the payload holds is refused, so
memory stays about the file's size. Before anything is restored, the file must agree with itself
(``checks.check_counters``): at most ``limits.MAX_LEDGER_ENTRIES`` ledger entries, a ledger holding at
least as many steps for the saved optimizer as its noise step counter, which is at least its released
steps (a ledger rewritten to fewer steps would restore a smaller epsilon on top of later state).

What a checkpoint holds (``build_checkpoint``): the model's state dict; the optimizer's, with its
DP state (noise mechanism, clipper accumulator, counters; with ``make_private(audit=...)`` the canaries:
their inclusion, groups, directions' seed, scores and releases scored); the engine's (accountant history,
secure mode, ``noise_plan``); the private loader's sampling state (generator state, position,
cyclic groups); optional scheduler states; and the caller's ``checkpoint_dict`` entries.

It is as sensitive as the training data. Outside secure mode the generator states determine all
future noise and sampling. BandMF's history is past noise, which with the released gradients
reveals past clipped gradients; the cyclic group assignment says which examples share steps; a
clipper accumulator saved between micro-batches is an un-noised gradient sum. In secure mode no
seed or generator state is written (secure sampling draws from the OS and has no state; a resumed
run reseeds its noise generators from the OS), so a secure checkpoint cannot reproduce future noise
or batches; it still holds the history, groups and accumulator above, and an audit's canary state (which
canaries were included, and the seed of their public directions: the canaries' draws come from the OS).
"""

from __future__ import annotations

import torch  # noqa: F401  (tests replace checkpoint.torch.save to make a write fail)

from privacy_engine.engine.checkpoint.checks import check_loader_state, check_module_state, sampling_generator_kind
from privacy_engine.engine.checkpoint.contents import (
    CLIP_SCHEDULER_KEY,
    ENGINE_KEY,
    LOADER_KEY,
    METADATA_KEY,
    MODULE_KEY,
    NOISE_SCHEDULER_KEY,
    OPTIMIZER_KEY,
    RESERVED_KEYS,
    build_checkpoint,
)
from privacy_engine.engine.checkpoint.engine_state import (
    PLAN_FIELDS_TO_MATCH,
    check_engine_state,
    check_restored_source,
    ledger_after_restore,
    plan_from_dict,
    plan_to_dict,
)
from privacy_engine.engine.checkpoint.file import (
    FORMAT_VERSION,
    MAGIC,
    PAYLOAD_FORMAT,
    CheckpointError,
    _HashingWriter,
    _header,
    display_name,
    read_checkpoint,
    write_checkpoint,
)
from privacy_engine.engine.checkpoint.plain import check_plain
from privacy_engine.engine.checkpoint.restore import restore_checkpoint

__all__ = [
    "CLIP_SCHEDULER_KEY",
    "ENGINE_KEY",
    "FORMAT_VERSION",
    "LOADER_KEY",
    "MAGIC",
    "METADATA_KEY",
    "MODULE_KEY",
    "NOISE_SCHEDULER_KEY",
    "OPTIMIZER_KEY",
    "PAYLOAD_FORMAT",
    "PLAN_FIELDS_TO_MATCH",
    "RESERVED_KEYS",
    "CheckpointError",
    "_HashingWriter",
    "_header",
    "build_checkpoint",
    "check_engine_state",
    "check_loader_state",
    "check_module_state",
    "check_plain",
    "check_restored_source",
    "display_name",
    "ledger_after_restore",
    "plan_from_dict",
    "plan_to_dict",
    "read_checkpoint",
    "restore_checkpoint",
    "sampling_generator_kind",
    "write_checkpoint",
]
