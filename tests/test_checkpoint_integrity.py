"""Checkpoint integrity beyond the checksum (issue 27, item 5): a file whose checksum is valid but
whose counters disagree, whose archive would inflate, which holds too many ledger entries, or which
is not a regular file is refused quickly, naming the problem, with the live run unchanged."""

from __future__ import annotations

import hashlib
import io
import os
import struct
import time
import zipfile

import pytest
import torch

from privacy_engine.engine import limits
from privacy_engine.engine.checkpoint import CheckpointError, read_checkpoint
from privacy_engine.engine.checkpoint.file import FORMAT_VERSION, MAGIC
from tests.test_checkpoints import assert_same, craft, full_state, load, make_run, save, train_on

LEDGER = ("privacy_engine_state_dict", "accountant", "history")


def _refused(run, path, *phrases):
    before = full_state(*run)
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as info:
        load(run, path)
    assert time.perf_counter() - start < 1.0
    for phrase in phrases:
        assert phrase in str(info.value)
    assert_same(before, full_state(*run))
    return str(info.value)


def _ledger(payload):
    return payload[LEDGER[0]][LEDGER[1]][LEDGER[2]]


@pytest.fixture
def saved(tmp_path):
    """A run trained 6 steps and its checkpoint; the run is then trained on, so a refused load is
    visible as a change of its later state."""
    run = make_run(train_steps=6)
    path = save(run, tmp_path / "good.ckpt")
    train_on(run, steps=2)
    return run, path


def test_a_good_checkpoint_round_trips_and_trains_on(saved):
    run, path = saved
    load(run, path)
    assert run[2].steps_taken == 6 and run[0].accountant.steps == 6
    train_on(run, steps=2)


def test_a_ledger_rewritten_to_fewer_steps_is_refused_naming_the_counters(saved, tmp_path):
    run, path = saved

    def rewind(payload):
        _ledger(payload)[0]["num_steps"] = 2
        del _ledger(payload)[1:]

    message = _refused(run, craft(path, tmp_path / "rewound.ckpt", rewind), "ledger records 2 steps",
                       "noise step counter is 6")  # fmt: skip
    assert "steps_taken=6" in message


def test_an_emptied_ledger_is_refused(saved, tmp_path):
    run, path = saved
    _refused(run, craft(path, tmp_path / "empty.ckpt", lambda p: _ledger(p).clear()), "ledger records 0 steps")


def test_more_released_steps_than_noise_steps_is_refused(saved, tmp_path):
    run, path = saved

    def inflate(payload):
        payload["optimizer_state_dict"]["privacy_engine.dp_state"]["steps_taken"] = 60

    _refused(run, craft(path, tmp_path / "inflated.ckpt", inflate), "steps_taken=60", "step counter is 6")


def test_too_many_ledger_entries_are_refused_before_they_are_validated(saved, tmp_path, monkeypatch):
    run, path = saved
    monkeypatch.setattr(limits, "MAX_LEDGER_ENTRIES", 50)  # the real limit's file would take long to write

    def pad(payload):
        entry = dict(_ledger(payload)[0], num_steps=0)
        _ledger(payload).extend(dict(entry) for _ in range(51))

    _refused(run, craft(path, tmp_path / "padded.ckpt", pad), "MAX_LEDGER_ENTRIES=50")


def _with_payload(path, payload: bytes):
    digest = hashlib.sha256(payload).digest()
    with open(path, "wb") as file:
        file.write(struct.pack("<16sIIQ32s", MAGIC, FORMAT_VERSION, 0, len(payload), digest) + payload)
    return path


def _recompressed(source) -> bytes:
    """``source``'s payload archive with every entry deflated and a 200 MB entry of zeros added
    (a zip bomb that inflates 1000-fold)."""
    with open(source, "rb") as file:
        original = file.read()[64:]
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(original)) as archive, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bomb:
        for entry in archive.infolist():
            bomb.writestr(entry.filename, archive.read(entry))
        prefix = archive.infolist()[0].filename.split("/")[0]
        bomb.writestr(f"{prefix}/data/999", bytes(200 * 10**6))
    return out.getvalue()


@pytest.mark.slow  # compressing the 200 MB entry takes ~1-2 s
def test_a_compressed_archive_is_refused_before_it_inflates(saved, tmp_path):
    run, path = saved
    _refused(run, _with_payload(tmp_path / "bomb.ckpt", _recompressed(path)), "compressed entry")


def test_an_archive_declaring_more_bytes_than_it_holds_is_refused(saved, tmp_path):
    run, path = saved
    with open(path, "rb") as file:
        payload = bytearray(file.read()[64:])
    # Raise one central-directory entry's uncompressed size: the archive claims bytes it does not hold.
    central = payload.rfind(b"PK\x01\x02")
    struct.pack_into("<I", payload, central + 24, 2**31)
    message = _refused(run, _with_payload(tmp_path / "declares.ckpt", bytes(payload)), "checkpoint")
    assert "declares" in message or "damaged archive" in message


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this OS")
def test_a_fifo_at_the_path_is_refused_without_blocking(saved, tmp_path):
    run, _ = saved
    fifo = tmp_path / "fifo.ckpt"
    os.mkfifo(fifo)
    _refused(run, fifo, "FIFO", "not a regular file")


def test_a_folder_at_the_path_is_refused(saved, tmp_path):
    run, _ = saved
    _refused(run, tmp_path, "folder", "not a regular file")


def test_a_declared_length_beyond_a_stream_allocates_only_what_is_there(saved):
    _, path = saved
    with open(path, "rb") as file:
        data = bytearray(file.read())
    struct.pack_into("<Q", data, 24, 2**40)  # a 1 TB payload declared

    class Stream(io.RawIOBase):
        def __init__(self, data):
            self.inner = io.BytesIO(data)

        def readable(self):
            return True

        def seekable(self):
            return False

        def readinto(self, buffer):
            chunk = self.inner.read(len(buffer))
            buffer[: len(chunk)] = chunk
            return len(chunk)

    with pytest.raises(CheckpointError, match="truncated"):
        read_checkpoint(io.BufferedReader(Stream(bytes(data))))
    assert torch.is_tensor(read_checkpoint(path)["module_state_dict"]["0.weight"])


def test_a_ledger_longer_than_the_optimizer_counters_still_loads(tmp_path):
    # A resume with load_checkpoint(module=...) keeps the saved ledger beside a fresh optimizer: the
    # ledger then holds more steps than the optimizer's counters. That over-reports epsilon, never
    # under-reports it, and such a run's next checkpoint must load.
    saved_run = make_run(train_steps=6)
    first = save(saved_run, tmp_path / "first.ckpt")
    run = make_run(train_steps=0)
    with pytest.warns(UserWarning, match="no optimizer= was given"):
        run[0].load_checkpoint(path=first, module=run[1])
    train_on(run, steps=2)
    second = save(run, tmp_path / "second.ckpt")
    resumed = make_run(train_steps=0)
    load(resumed, second)
    assert resumed[0].accountant.steps == 8 and resumed[2].steps_taken == 2


# ---------------------------------------------------------------------------- the loader's step counter
LOADER_STEP = ("data_loader_state_dict", "next_step")


@pytest.fixture
def saved_bandmf(tmp_path):
    run = make_run(mechanism="bandmf", train_steps=6)
    path = save(run, tmp_path / "good.ckpt")
    train_on(run, steps=2)
    return run, path


def _loader_next_step(payload, value):
    payload[LOADER_STEP[0]][LOADER_STEP[1]] = value


def test_the_loader_key_is_where_the_loader_counter_is(saved_bandmf):
    _, path = saved_bandmf
    payload = read_checkpoint(path)
    assert payload[LOADER_STEP[0]][LOADER_STEP[1]] == 6
    assert payload["optimizer_state_dict"]["privacy_engine.dp_state"]["noise"]["step"] == 6


@pytest.mark.parametrize("next_step", [2, 0, 9])
def test_a_bandmf_loader_counter_that_disagrees_with_the_noise_rows_is_refused(saved_bandmf, tmp_path, next_step):
    # Rewound (2, 0): released batches would be drawn again and get a second noise row; advanced (9) with no
    # batch in flight: the next batch would get the row of a later step.
    run, path = saved_bandmf
    crafted = craft(path, tmp_path / "loader.ckpt", lambda payload: _loader_next_step(payload, next_step))
    message = _refused(run, crafted, f"next_step={next_step}", "BandMF noise step counter is 6")
    assert "do not belong together" in message


def test_a_bandmf_checkpoint_with_a_batch_in_flight_still_loads(tmp_path):
    from tests import checkpoint_worker as worker

    _, model, optimizer, loader = run = make_run(mechanism="bandmf", train_steps=0)
    stream = worker.batches(loader)
    worker.train(model, optimizer, torch.nn.CrossEntropyLoss(), stream, 3)
    next(stream)  # drawn, not released: the loader is one step ahead of the noise rows
    path = save(run, tmp_path / "in_flight.ckpt")
    resumed = make_run(mechanism="bandmf", train_steps=0)
    with pytest.warns(UserWarning, match="new generators"):
        load(resumed, path)
    assert resumed[3].state_dict()["next_step"] == 4 and resumed[2].noise.step == 3


def test_a_gaussian_run_resumed_without_its_loader_saves_a_checkpoint_that_loads(tmp_path):
    # Why one band is not checked: the loader of a run resumed without data_loader= counts from 0 again
    # beside the saved optimizer's counters (here 2 batches drawn, 8 noise steps).
    first = save(make_run(train_steps=6), tmp_path / "first.ckpt")
    run = make_run(train_steps=0)
    with pytest.warns(UserWarning, match="new generators"):
        run[0].load_checkpoint(path=first, module=run[1], optimizer=run[2])
    train_on(run, steps=2)
    second = save(run, tmp_path / "second.ckpt")
    assert read_checkpoint(second)[LOADER_STEP[0]][LOADER_STEP[1]] == 2
    resumed = make_run(train_steps=0)
    load(resumed, second)
    assert resumed[2].noise.step == 8 and resumed[3].state_dict()["next_step"] == 2
