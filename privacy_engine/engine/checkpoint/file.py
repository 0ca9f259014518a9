"""The checkpoint file: a 64-byte header (magic, version, payload length, SHA-256) and a
``torch.save`` payload of plain data; written atomically, verified before it is unpickled.
The format is described in ``privacy_engine.engine.checkpoint``."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import struct
import tempfile
import zipfile
from typing import Any

import torch

from privacy_engine.engine.checkpoint.plain import check_plain

__all__ = ["FORMAT_VERSION", "MAGIC", "PAYLOAD_FORMAT", "CheckpointError", "display_name", "read_checkpoint",
           "write_checkpoint"]  # fmt: skip

MAGIC = b"PRIVACYENGINECKP"
FORMAT_VERSION = 1
PAYLOAD_FORMAT = "privacy_engine.checkpoint/1"
_HEADER = struct.Struct("<16sIIQ32s")  # magic, version, reserved, payload length, sha256: 64 bytes
_READ_CHUNK_BYTES = 1 << 24  # 16 MiB: a stream's payload is read in pieces of this size at most


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: not a checkpoint, damaged, or not matching the run it is
    loaded into. The message names the file and says what to do."""


def display_name(path: Any) -> str:
    """``path`` as error messages name it (a file name, or a file object's name)."""
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
        raise FileNotFoundError(f"cannot save checkpoint {display_name(path)}: the folder {folder!r} does not exist")
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
    a FIFO, folder or device at the path    "not a regular file" (never opened for reading
                                            in a way that blocks)
    compressed archive entries (bombs),     "compressed entry" / "declares N bytes": refused
    entries declaring more than the file    before unpickling; memory stays ~ the file size
    ======================================  ==============================================
    """
    name = display_name(path)
    if isinstance(path, (str, os.PathLike)):
        _check_regular(os.stat(path), name)  # a FIFO would block open() and read() forever
        # O_NONBLOCK: should the path become a FIFO between stat and open, open returns at once.
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        try:
            _check_regular(os.fstat(descriptor), name)
        except BaseException:
            os.close(descriptor)
            raise
        with os.fdopen(descriptor, "rb") as file:
            return _read(file, name, map_location)
    return _read(path, name, map_location)


def _check_regular(status: os.stat_result, name: str) -> None:
    if not stat.S_ISREG(status.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(status.st_mode) else "a folder" if stat.S_ISDIR(status.st_mode)
                else "a device or socket")  # fmt: skip
        raise CheckpointError(
            f"checkpoint {name} is {kind}, not a regular file: a checkpoint is a file written by "
            "PrivacyEngine.save_checkpoint (reading anything else could block or never end)"
        )


def _read_at_most(file: Any, length: int) -> bytes:
    """Up to ``length`` bytes, read in chunks so that memory follows the bytes really there, not a
    length field (a stream cannot be measured first)."""
    chunks, remaining = [], length
    while remaining > 0:
        chunk = file.read(min(remaining, _READ_CHUNK_BYTES))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _check_archive(payload: bytes, name: str) -> None:
    """Refuse a torch.save archive whose entries are compressed or claim more bytes than the
    payload holds: torch.save stores every entry uncompressed, so the unpickled data can never be
    larger than the file, and a compressed entry (a "zip bomb": 2.1 MB inflating to 2.1 GB, or
    millions of ledger entries in 16 kB) was crafted."""
    if not payload.startswith(b"PK"):
        return  # the legacy (non-zip) torch.save format: a pickle, no larger than the file
    try:
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as error:
        raise CheckpointError(f"checkpoint {name} holds a damaged archive ({error}); it was altered") from error
    declared = 0
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(
                f"checkpoint {name} holds a compressed entry {entry.filename!r} ({entry.compress_size} bytes that "
                f"would inflate to {entry.file_size}): PrivacyEngine.save_checkpoint never compresses, so the file "
                "was crafted or altered; nothing was unpickled"
            )
        declared += entry.file_size
    if declared > len(payload):
        raise CheckpointError(
            f"checkpoint {name} declares {declared} bytes of entries in a {len(payload)}-byte payload: it was "
            "altered; nothing was unpickled"
        )


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
    payload = file.read(to_read) if file.seekable() else _read_at_most(file, to_read)
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
    _check_archive(payload, name)
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

