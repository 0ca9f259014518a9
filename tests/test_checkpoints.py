"""Checkpoints: no code runs from a file, a crash while saving keeps the previous file, damage is
detected, a mismatching checkpoint changes nothing, a resumed run (in a fresh process) is the run
that would have happened, and an interrupted step leaves the state consistent."""

from __future__ import annotations

import copy
import hashlib
import io
import os
import pickle
import signal
import subprocess
import sys
import time
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import PrivacyEngine
from privacy_engine.engine import checkpoint
from privacy_engine.engine.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from privacy_engine.noise import BandMFNoise, GaussianNoise
from tests import checkpoint_worker as worker

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "checkpoint_worker.py"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---------------------------------------------------------------------------------------------- helpers
def make_model(hidden=5, names=False):
    layers = [nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 3)]
    if names:
        return nn.Sequential(OrderedDict(zip(("first", "act", "second"), layers)))
    return nn.Sequential(*layers)


def make_run(*, mechanism="gaussian", num_bands=4, secure_mode=False, accountant="rdp", noise_multiplier=1.0,
             max_grad_norm=0.5, optimizer="sgd", hidden=5, names=False, seed=0, train_steps=2,
             own_generator=False, grad_sample_mode="hooks"):  # fmt: skip
    """A small private run (engine, model, optimizer, criterion, loader), trained ``train_steps`` steps so
    that optimizer state, noise history and accountant history are not empty."""
    torch.manual_seed(seed)
    model = make_model(hidden, names)
    if optimizer == "sgd":
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        inner = torch.optim.Adam(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1234)
    dataset = TensorDataset(torch.randn(40, 6, generator=data), torch.randint(0, 3, (40,), generator=data))
    engine = PrivacyEngine(accountant=accountant, secure_mode=secure_mode)
    kwargs = {"noise_multiplier": noise_multiplier, "max_grad_norm": max_grad_norm,
              "grad_sample_mode": grad_sample_mode}  # fmt: skip
    if not secure_mode:
        if own_generator:
            kwargs["noise_generator"] = torch.Generator().manual_seed(seed + 11)
        else:
            kwargs["noise_seed"] = seed + 7
    if mechanism == "bandmf":
        kwargs.update(noise_mechanism="bandmf", num_bands=num_bands, total_steps=16)
    model, private_optimizer, loader = engine.make_private(
        module=model, optimizer=inner, data_loader=DataLoader(dataset, batch_size=5), **kwargs
    )
    criterion = nn.CrossEntropyLoss()
    if train_steps:
        worker.train(model, private_optimizer, criterion, worker.batches(loader), train_steps)
    return engine, model, private_optimizer, loader


def full_state(engine, model, optimizer, loader):
    """Everything a load could change, as copies."""
    generators = [g.get_state() for group in optimizer.noise._groups for g in group.generators]
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "noise": copy.deepcopy(optimizer.noise.state_dict()),
        "generators": generators,
        "counters": (optimizer.steps_taken, optimizer.noise.step, optimizer.noise_multiplier),
        "engine": copy.deepcopy(engine.state_dict()),
        "plan": engine.noise_plan,
        "loader": copy.deepcopy(loader.state_dict()),
        "sampler_generator": None if loader.batch_sampler.generator is None
        else loader.batch_sampler.generator.get_state(),
        "groups": [g.clone() for g in getattr(loader.batch_sampler, "groups", [])],
    }


def assert_same(a, b, where="state"):
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{index}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def save(run, path, **kwargs):
    engine, model, optimizer, loader = run
    arguments = {"module": model, "optimizer": optimizer, "data_loader": loader, **kwargs}
    engine.save_checkpoint(path=path, **{k: v for k, v in arguments.items() if v is not None})
    return path


def load(run, path, **kwargs):
    engine, model, optimizer, loader = run
    arguments = {"module": model, "optimizer": optimizer, "data_loader": loader, **kwargs}
    return engine.load_checkpoint(path=path, **{k: v for k, v in arguments.items() if v is not None})


def train_on(run, steps=2, skipped_rows=0):
    """Train ``steps`` more steps on a run a checkpoint was loaded into: a resume must train on, not only
    restore. Each step is released and recorded once (BandMF also draws, discards and records the noise
    rows of ``skipped_rows`` batches skipped by the resume), and the model stays finite."""
    engine, model, optimizer, loader = run
    noise_steps, accounted_steps = optimizer.noise.step, engine.accountant.steps
    records = worker.train(model, optimizer, nn.CrossEntropyLoss(), worker.batches(loader), steps)
    expected = steps + skipped_rows
    assert (optimizer.noise.step, engine.accountant.steps) == (noise_steps + expected, accounted_steps + expected)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return records


def craft(source, target, mutate):
    """A checkpoint with a valid header and checksum whose payload ``mutate`` altered."""
    payload = read_checkpoint(source)
    mutate(payload)
    write_checkpoint(target, payload)
    return target


# ---------------------------------------------------------------------------------------------- no code runs
class RunsCommand:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.parametrize("wrapping", ["plain pickle", "torch.save", "torch.save with a valid header"])
def test_a_file_crafted_to_run_a_command_runs_nothing(tmp_path, wrapping):
    marker = tmp_path / "pwned"
    evil = {"format": checkpoint.PAYLOAD_FORMAT, "module_state_dict": RunsCommand(f"touch {marker}")}
    path = tmp_path / "evil.pt"
    if wrapping == "plain pickle":
        path.write_bytes(pickle.dumps(evil))
    elif wrapping == "torch.save":
        torch.save(evil, path)
    else:  # what an attacker who knows the format writes: our header, a correct checksum, a malicious pickle
        buffer = io.BytesIO()
        torch.save(evil, buffer)
        payload = buffer.getvalue()
        path.write_bytes(checkpoint._header(len(payload), hashlib.sha256(payload).digest()) + payload)
    run = make_run(train_steps=1)
    before = full_state(*run)
    with pytest.raises(CheckpointError) as error:
        load(run, path)
    assert str(path) in str(error.value)
    assert ("not a privacy_engine checkpoint" if wrapping != "torch.save with a valid header"
            else "refused to unpickle") in str(error.value)  # fmt: skip
    assert not marker.exists()
    assert_same(full_state(*run), before)


@pytest.mark.parametrize("config", [
    {"mechanism": "gaussian"}, {"mechanism": "bandmf"}, {"mechanism": "gaussian", "grad_sample_mode": "ghost"},
    {"mechanism": "bandmf", "grad_sample_mode": "ghost"}, {"mechanism": "bandmf", "secure_mode": True},
    {"mechanism": "gaussian", "own_generator": True, "optimizer": "adam", "accountant": "pld"},
])  # fmt: skip
def test_every_checkpoint_the_engine_writes_loads_with_weights_only(tmp_path, config):
    run = make_run(**config)
    path = save(run, tmp_path / "run.pt", checkpoint_dict={"epoch": 3, "note": "text"})
    raw = path.read_bytes()
    # Read independently of read_checkpoint: the payload after the 64-byte header is plain torch.save data.
    payload = torch.load(io.BytesIO(raw[64:]), weights_only=True)
    assert payload["epoch"] == 3 and payload["format"] == checkpoint.PAYLOAD_FORMAT
    assert {checkpoint.OPTIMIZER_KEY, checkpoint.LOADER_KEY, checkpoint.ENGINE_KEY} <= set(payload)
    resumed = make_run(**config, seed=2, train_steps=0)
    load(resumed, path)
    train_on(resumed)


def test_a_value_that_is_not_plain_data_is_refused_before_anything_is_written(tmp_path):
    run = make_run(train_steps=1)
    path = save(run, tmp_path / "run.pt")
    before = path.read_bytes()
    with pytest.raises(TypeError, match=r"checkpoint\['extra'\]\['x'\] is a numpy.float64"):
        save(run, path, checkpoint_dict={"extra": {"x": np.float64(1.0)}})
    with pytest.raises(ValueError, match="module_state_dict"):
        save(run, path, checkpoint_dict={"module_state_dict": {}})
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["run.pt"]


# ---------------------------------------------------------------------------------------------- damaged files
def _flip_payload_bit(data):
    data[64 + (len(data) - 64) // 2] ^= 0x10


DAMAGE = {
    "empty": (lambda data: data[:0], "is empty"),
    "truncated": (lambda data: data[: len(data) // 2], "is truncated"),
    "header cut": (lambda data: data[:40], "not a privacy_engine checkpoint"),
    "bit flip in the payload": (lambda data: _flip_payload_bit(data) or data, "damaged"),
    "bit flip in the magic": (lambda data: data.__setitem__(3, data[3] ^ 1) or data, "not a privacy_engine"),
    "bit flip in the version": (lambda data: data.__setitem__(16, data[16] ^ 4) or data, "format version"),
    "bit flip in the length": (lambda data: data.__setitem__(31, data[31] ^ 0x40) or data, "is truncated"),
    "extra bytes": (lambda data: data + b"\0", "extra bytes"),
    "foreign bytes": (lambda data: bytearray(os.urandom(300)), "not a privacy_engine checkpoint"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_file_raises_naming_it_and_changes_nothing(tmp_path, damage):
    source = make_run(mechanism="bandmf", seed=1)
    path = save(source, tmp_path / "run.pt")
    mutate, message = DAMAGE[damage]
    path.write_bytes(bytes(mutate(bytearray(path.read_bytes()))))
    target = make_run(mechanism="bandmf", seed=2)
    before = full_state(*target)
    with pytest.raises(CheckpointError, match=message) as error:
        load(target, path)
    assert str(path) in str(error.value)
    assert_same(full_state(*target), before)


def test_a_file_object_can_hold_a_checkpoint():
    run = make_run(mechanism="bandmf", seed=1)
    buffer = io.BytesIO()
    save(run, buffer)
    buffer.seek(0)
    target = make_run(mechanism="bandmf", seed=2)
    load(target, buffer)
    assert_same(full_state(*target)["noise"], full_state(*run)["noise"])


def test_a_foreign_torch_file_is_named_as_such(tmp_path):
    path = tmp_path / "opacus.pt"
    torch.save({"module_state_dict": make_model().state_dict()}, path)
    with pytest.raises(CheckpointError, match="plain torch.save"):
        read_checkpoint(path)


# ---------------------------------------------------------------------------------------------- atomic save
@pytest.mark.parametrize("failure", [OSError("disk full"), KeyboardInterrupt()])
def test_a_failure_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch, failure):
    run = make_run(train_steps=1)
    path = save(run, tmp_path / "run.pt")
    before = path.read_bytes()
    real_save = torch.save

    def failing_save(obj, file, **kwargs):
        real_save(obj, io.BytesIO())
        file.write(b"partial payload")
        raise failure

    monkeypatch.setattr(checkpoint.torch, "save", failing_save)
    with pytest.raises(type(failure)):
        save(run, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["run.pt"]  # the temporary file is removed
    load(make_run(train_steps=0), path)


@pytest.mark.slow
def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "run.pt"
    previous = {"format": checkpoint.PAYLOAD_FORMAT, "value": torch.arange(10)}
    write_checkpoint(path, previous)
    before = path.read_bytes()
    process = subprocess.Popen([sys.executable, str(WORKER), "slow-save", str(path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=REPO, text=True)  # fmt: skip
    try:
        assert process.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 60
        temporary = []
        # Kill once the temporary file holds more than its header: mid-way through the payload.
        while time.monotonic() < deadline:
            temporary = [tmp_path / n for n in os.listdir(tmp_path) if n.startswith(".run.pt.") and n.endswith(".tmp")]
            if temporary and temporary[0].stat().st_size > 4096:
                break
            time.sleep(0.001)
        assert temporary, "the worker never started writing"
        process.send_signal(signal.SIGKILL)
        stdout, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL
    assert "done" not in stdout  # it died before the rename
    assert path.read_bytes() == before
    assert torch.equal(read_checkpoint(path)["value"], torch.arange(10))


# ---------------------------------------------------------------------------------------------- validate first
def _without(key):
    return lambda payload: payload.pop(key)


def _momentum_of_wrong_shape(payload):
    state = payload[checkpoint.OPTIMIZER_KEY]["state"]
    first = next(iter(state))
    state[first]["momentum_buffer"] = torch.zeros(2, 2)


def _groups_missing_an_example(payload):
    groups = payload[checkpoint.LOADER_KEY]["groups"]
    groups[0] = groups[0][1:]


def _other_coefficients(payload):
    noise = payload[checkpoint.OPTIMIZER_KEY]["privacy_engine.dp_state"]["noise"]
    noise["coefficients"] = [c * 1.5 for c in noise["coefficients"]]


def _history_of_wrong_shape(payload):
    device = payload[checkpoint.OPTIMIZER_KEY]["privacy_engine.dp_state"]["noise"]["devices"][0]
    device["history"] = device["history"][:, :-1]


def _secure_sampling_state(payload):
    payload[checkpoint.LOADER_KEY].update(generator="secure", generator_state=None)


def _accountant_history_damaged(payload):
    payload[checkpoint.ENGINE_KEY]["accountant"]["history"][0]["noise_multiplier"] = -1.0


# (name, source run settings, target run settings, save kwargs, load kwargs, crafted mutation, message)
MISMATCHES = [
    ("secure mode", {}, {"secure_mode": True}, {}, {}, None, "secure_mode"),
    ("accountant kind", {}, {"accountant": "pld"}, {}, {}, None, "accountant"),
    ("accountant history", {}, {}, {}, {}, _accountant_history_damaged, "noise_multiplier"),
    ("mechanism", {"mechanism": "bandmf"}, {}, {}, {}, None, "mechanism='bandmf'"),
    ("number of bands", {"mechanism": "bandmf"}, {"mechanism": "bandmf", "num_bands": 2}, {}, {}, None, "num_bands"),
    # DP-SGD resumed at another sigma is allowed and accounted (tests/test_schedules.py); BandMF's sigma must match.
    ("noise multiplier", {"mechanism": "bandmf"}, {"mechanism": "bandmf", "noise_multiplier": 1.5}, {}, {}, None,
     "noise_multiplier"),
    ("parameter names", {}, {"names": True}, {}, {}, None, "'first.weight'"),
    ("parameter shapes", {}, {"hidden": 7}, {}, {}, None, "shape"),
    ("optimizer class", {}, {"optimizer": "adam"}, {}, {}, None, "saved from a SGD"),
    ("optimizer state shape", {}, {}, {}, {}, _momentum_of_wrong_shape, "momentum_buffer"),
    ("clipping bound", {}, {"max_grad_norm": 1.0}, {}, {}, None, "bounds"),
    ("noise coefficients", {"mechanism": "bandmf"}, {"mechanism": "bandmf"}, {}, {}, _other_coefficients,
     "coefficients"),
    ("noise history", {"mechanism": "bandmf"}, {"mechanism": "bandmf"}, {}, {}, _history_of_wrong_shape, "history"),
    ("loader groups", {"mechanism": "bandmf"}, {"mechanism": "bandmf"}, {}, {}, _groups_missing_an_example, "groups"),
    ("sampling generator kind", {}, {}, {}, {}, _secure_sampling_state, "generator"),
    ("optimizer absent from the file", {}, {}, {"optimizer": False}, {}, None, "optimizer="),
    ("loader absent from the file", {}, {}, {"data_loader": False}, {}, None, "data_loader="),
    ("BandMF file without loader state", {"mechanism": "bandmf"}, {"mechanism": "bandmf"}, {}, {},
     _without(checkpoint.LOADER_KEY), "no loader state"),
    ("BandMF loaded without a loader", {"mechanism": "bandmf"}, {"mechanism": "bandmf"}, {}, {"data_loader": False},
     None, "pass data_loader="),
]  # fmt: skip


@pytest.mark.parametrize("name, source, target, save_kwargs, load_kwargs, mutate, message", MISMATCHES,
                         ids=[m[0] for m in MISMATCHES])  # fmt: skip
def test_a_mismatching_checkpoint_changes_nothing_and_names_the_mismatch(
    tmp_path, name, source, target, save_kwargs, load_kwargs, mutate, message
):
    source_run = make_run(seed=1, **source)
    skip = {key: False for key, value in save_kwargs.items() if value is False}
    engine, model, optimizer, loader = source_run
    save_arguments = {"module": model, "optimizer": optimizer, "data_loader": loader}
    for key in skip:
        save_arguments.pop(key)
    path = tmp_path / "run.pt"
    engine.save_checkpoint(path=path, **save_arguments)
    if mutate is not None:
        path = craft(path, tmp_path / "crafted.pt", mutate)
    target_run = make_run(seed=2, **target)
    before = full_state(*target_run)
    engine, model, optimizer, loader = target_run
    load_arguments = {"module": model, "optimizer": optimizer, "data_loader": loader}
    for key, value in load_kwargs.items():
        if value is False:
            load_arguments.pop(key)
    with pytest.raises(CheckpointError, match=message) as error:
        engine.load_checkpoint(path=path, **load_arguments)
    assert str(path) in str(error.value) and "nothing was restored" in str(error.value)
    assert_same(full_state(*target_run), before)


def test_a_failure_during_the_restore_itself_is_undone(tmp_path):
    source = make_run(mechanism="bandmf", seed=1, train_steps=3)
    path = save(source, tmp_path / "run.pt")
    target = make_run(mechanism="bandmf", seed=2)
    before = full_state(*target)
    model = target[1]
    real_load = model.load_state_dict
    calls = []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return real_load(*args, **kwargs)

    model.load_state_dict = fails_once  # the model is restored last: engine, loader and optimizer are undone
    with pytest.raises(CheckpointError, match="device lost"):
        load(target, path)
    assert_same(full_state(*target), before)


def test_optional_parts_are_restored_only_when_asked_for(tmp_path):
    source = make_run(seed=1, train_steps=3)
    path = save(source, tmp_path / "run.pt")
    engine, model, optimizer, loader = make_run(seed=2)
    steps = optimizer.steps_taken
    with pytest.warns(UserWarning, match="optimizer"):
        engine.load_checkpoint(path=path, module=model)
    assert optimizer.steps_taken == steps
    assert engine.accountant.steps == source[0].accountant.steps
    for a, b in zip(model.parameters(), source[1].parameters()):
        assert torch.equal(a, b)
    train_on((engine, model, optimizer, loader))


class Schedule:
    """A scheduler-like object (Opacus's noise / clipping schedulers have this interface)."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_lr_and_dp_scheduler_states_ride_along(tmp_path):
    engine, model, optimizer, loader = source = make_run(seed=1)
    lr_schedule = torch.optim.lr_scheduler.StepLR(optimizer.original_optimizer, step_size=1, gamma=0.5)
    lr_schedule.step()
    path = save(source, tmp_path / "run.pt", noise_scheduler=Schedule(0.7),
                checkpoint_dict={"lr_scheduler": lr_schedule.state_dict()})  # fmt: skip
    target = make_run(seed=2)  # its optimizer has no LR scheduler yet (no initial_lr in its groups)
    schedule = Schedule(0.1)
    payload = load(target, path, noise_scheduler=schedule)
    assert schedule.value == 0.7
    resumed_schedule = torch.optim.lr_scheduler.StepLR(target[2].original_optimizer, step_size=1, gamma=0.5)
    resumed_schedule.load_state_dict(payload["lr_scheduler"])
    assert target[2].param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 0.05
    train_on(target)
    before = full_state(*target)
    with pytest.raises(CheckpointError, match="grad_clip_scheduler"):
        load(target, path, grad_clip_scheduler=Schedule(1.0))
    assert_same(full_state(*target), before)


def test_the_engine_state_restores_the_noise_plan_into_a_new_engine(tmp_path):
    source = make_run(mechanism="bandmf", seed=1)
    fresh = PrivacyEngine(accountant="rdp")
    fresh.load_state_dict(copy.deepcopy(source[0].state_dict()))
    assert fresh.noise_plan == source[0].noise_plan
    assert fresh.get_epsilon(1e-5) == source[0].get_epsilon(1e-5)


# ---------------------------------------------------------------------------------------------- exact resume
@pytest.fixture(scope="module")
def resumed_in_a_fresh_process(tmp_path_factory):
    """Per configuration: the uninterrupted run's last steps, and what a fresh process saw after loading
    the checkpoint saved mid-run."""
    folder = tmp_path_factory.mktemp("resume")
    uninterrupted, pairs = {}, []
    for config in worker.CONFIGS:
        engine, model, optimizer, criterion, loader = worker.build(config)
        records = worker.train(model, optimizer, criterion, worker.batches(loader),
                               worker.STEPS_BEFORE_SAVE + worker.RESUMED_STEPS)  # fmt: skip
        uninterrupted[config] = {"records": records[worker.STEPS_BEFORE_SAVE:], "epsilon": engine.get_epsilon(worker.DELTA),
                                 "history": engine.accountant.state_dict()["history"]}  # fmt: skip
        engine, model, optimizer, criterion, loader = worker.build(config)
        worker.train(model, optimizer, criterion, worker.batches(loader), worker.STEPS_BEFORE_SAVE)
        engine.save_checkpoint(path=folder / f"{config}.pt", module=model, optimizer=optimizer, data_loader=loader)
        pairs.append(f"{config}={folder / f'{config}.pt'}")
    out = folder / "resumed.pt"
    completed = subprocess.run([sys.executable, str(WORKER), "resume", str(out), *pairs], cwd=REPO,
                               capture_output=True, text=True, timeout=600)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    return uninterrupted, torch.load(out, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(worker.CONFIGS))
def test_a_run_resumed_in_a_fresh_process_is_bit_identical_to_the_uninterrupted_run(resumed_in_a_fresh_process,
                                                                                     config):  # fmt: skip
    uninterrupted, resumed = resumed_in_a_fresh_process
    expected, got = uninterrupted[config], resumed[config]
    assert len(got["records"]) == worker.RESUMED_STEPS
    for step, (a, b) in enumerate(zip(expected["records"], got["records"])):
        assert_same(b, a, f"{config} step {worker.STEPS_BEFORE_SAVE + step}")  # batches, noisy grads, params
    assert got["history"] == expected["history"]
    assert got["epsilon"] == expected["epsilon"]


def _generator_states(optimizer):
    return [g.get_state() for group in optimizer.noise._groups for g in group.generators]


def test_a_resume_continues_after_the_last_released_step_with_the_saved_generators(tmp_path):
    engine, model, optimizer, loader = run = make_run(mechanism="bandmf", seed=1, train_steps=3)
    path = save(run, tmp_path / "run.pt")
    resumed = make_run(mechanism="bandmf", seed=2, train_steps=1)  # stepped: its noise generators exist
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(resumed, path)
    assert resumed[2].noise.step == optimizer.noise.step == 3
    assert resumed[3].state_dict()["next_step"] == 3
    assert resumed[0].accountant.steps == 3
    assert_same(_generator_states(resumed[2]), _generator_states(optimizer))
    train_on(resumed)


@pytest.mark.parametrize("resumed_steps", [0, 1], ids=["resumed-before-any-step", "resumed-after-a-step"])
@pytest.mark.parametrize("mechanism", ["gaussian", "bandmf"])
def test_a_checkpoint_saved_with_a_batch_in_flight_resumes_with_fresh_noise(tmp_path, mechanism, resumed_steps):
    engine, model, optimizer, loader = run = make_run(mechanism=mechanism, seed=1, train_steps=0)
    stream = worker.batches(loader)
    worker.train(model, optimizer, nn.CrossEntropyLoss(), stream, 3)
    inputs, targets = next(stream)  # batch 3 drawn; its step not taken when the checkpoint is written
    path = save(run, tmp_path / "run.pt")
    saved_generators = _generator_states(optimizer)
    # Stepped or not, the resumed run's noise generators are replaced (before a step they do not exist yet).
    resumed = make_run(mechanism=mechanism, seed=2, train_steps=resumed_steps)
    with pytest.warns(UserWarning, match="new generators.*before optimizer.step"):
        load(resumed, path)
    # The batch in flight is skipped, and its noise (the saved generators' next draw) is never used.
    assert resumed[3].state_dict()["next_step"] == 4
    assert resumed[2].noise.step == 3 and resumed[0].accountant.steps == 3
    if resumed_steps:
        assert not any(torch.equal(a, b) for a, b in zip(_generator_states(resumed[2]), saved_generators))
        if mechanism == "bandmf":
            assert torch.equal(resumed[2].noise._groups[0].history, optimizer.noise._groups[0].history)
    else:
        pending = resumed[2].noise.state_dict()["devices"]
        assert not any(torch.equal(a, b) for a, b in zip(pending[0]["generator_states"], saved_generators))
    train_on(resumed, skipped_rows=1 if mechanism == "bandmf" else 0)  # BandMF's row of the skipped batch


@pytest.mark.parametrize("resumed_steps", [0, 1], ids=["resumed-before-any-step", "resumed-after-a-step"])
@pytest.mark.parametrize("grad_sample_mode", ["hooks", "ghost"])
def test_a_checkpoint_restored_without_the_loader_state_resumes_with_fresh_noise(tmp_path, grad_sample_mode,
                                                                                 resumed_steps):  # fmt: skip
    # Opacus's way: save_checkpoint / load_checkpoint with module= and optimizer= only.
    engine, model, optimizer, _ = make_run(seed=1, train_steps=3, grad_sample_mode=grad_sample_mode)
    path = tmp_path / "run.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    resumed = make_run(seed=2, train_steps=resumed_steps, grad_sample_mode=grad_sample_mode)
    with pytest.warns(UserWarning, match="new generators.*loader's sampling state was not restored"):
        resumed[0].load_checkpoint(path=path, module=resumed[1], optimizer=resumed[2])
    assert resumed[2].noise.step == 3
    saved_generators = _generator_states(optimizer)
    if resumed_steps:
        assert not any(torch.equal(a, b) for a, b in zip(_generator_states(resumed[2]), saved_generators))
    else:
        pending = resumed[2].noise.state_dict()["devices"]
        assert not any(torch.equal(a, b) for a, b in zip(pending[0]["generator_states"], saved_generators))
    train_on(resumed)



# ---------------------------------------------------------------------------------------------- transactional steps
def _steps(mechanism, count, shapes=((3, 4), (5,))):
    noises = []
    for _ in range(count):
        tensors = [torch.zeros(s) for s in shapes]
        mechanism.add_noise_(tensors, 1.0, 1.0)
        noises.append(torch.cat([t.flatten() for t in tensors]))
    return noises


def _noise_state(mechanism):
    return {"state": copy.deepcopy(mechanism.state_dict()),
            "generators": [g.get_state() for group in mechanism._groups for g in group.generators]}  # fmt: skip


def test_the_noise_state_carries_layout_restarts():
    noise = BandMFNoise([1.0, 0.5], seed=5)
    _steps(noise, 2)
    noise.restart_layout()  # saved before the first step of the new layout
    resumed = BandMFNoise([1.0, 0.5], seed=5)
    resumed.load_state_dict(copy.deepcopy(noise.state_dict()))
    first_layout = _steps(BandMFNoise([1.0, 0.5], seed=5), 1)[0]
    expected = _steps(noise, 1)[0]
    assert torch.equal(_steps(resumed, 1)[0], expected) and not torch.equal(expected, first_layout)


FACTORIES = {
    "gaussian": lambda: GaussianNoise(seed=3),
    "bandmf": lambda: BandMFNoise([1.0, 0.5, 0.25], seed=3),
    "bandmf secure": lambda: BandMFNoise([1.0, 0.5, 0.25], secure_mode=True),
}
FAILURE_POINTS = ["_fill_standard_noise", "_form_noise", "_add_to_tensors", "on_commit"]


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("point", FAILURE_POINTS)
@pytest.mark.parametrize("kind", list(FACTORIES))
def test_an_exception_inside_a_noise_step_changes_nothing(monkeypatch, kind, point, failure):
    mechanism = FACTORIES[kind]()
    _steps(mechanism, 2)  # history rows and ring position in use
    before = _noise_state(mechanism)
    on_commit = None
    if point == "on_commit":
        def on_commit():
            raise failure("injected")
    else:
        real = getattr(mechanism, point)

        def fails_after_running(*args, **kwargs):
            real(*args, **kwargs)  # the state is as far along as it gets at this point
            raise failure("injected")

        monkeypatch.setattr(mechanism, point, fails_after_running)
    with pytest.raises(failure):
        mechanism.add_noise_([torch.zeros(3, 4), torch.zeros(5)], 1.0, 1.0, on_commit=on_commit)
    monkeypatch.undo()
    assert_same(_noise_state(mechanism), before)
    if kind != "bandmf secure":
        reference = FACTORIES[kind]()
        expected = _steps(reference, 3)[2]
        assert torch.equal(_steps(mechanism, 1)[0], expected)  # the retried step is the step that never failed


@pytest.mark.parametrize("kind", ["gaussian", "bandmf"])
def test_ctrl_c_during_the_commit_completes_the_step_then_raises(monkeypatch, kind):
    mechanism, reference = FACTORIES[kind](), FACTORIES[kind]()
    _steps(mechanism, 2)
    _steps(reference, 3)
    real = mechanism._commit

    def interrupted_commit(*args):
        os.kill(os.getpid(), signal.SIGINT)  # arrives between the commit's statements
        real(*args)

    monkeypatch.setattr(mechanism, "_commit", interrupted_commit)
    with pytest.raises(KeyboardInterrupt):
        _steps(mechanism, 1)
    monkeypatch.undo()
    assert mechanism.step == 3
    assert_same(_noise_state(mechanism)["state"], _noise_state(reference)["state"])
    assert torch.equal(_steps(mechanism, 1)[0], _steps(reference, 1)[0])


@pytest.mark.parametrize("point", ["_fill_standard_noise", "_form_noise", "_add_to_tensors"])
def test_an_exception_inside_the_optimizer_step_leaves_noise_ledger_and_model_as_they_were(monkeypatch, point):
    engine, model, optimizer, loader = make_run(mechanism="bandmf", seed=1, train_steps=2)
    inputs, targets = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(inputs), targets).backward()
    before = (_noise_state(optimizer.noise), copy.deepcopy(engine.state_dict()), optimizer.steps_taken,
              [p.detach().clone() for p in model.parameters()])  # fmt: skip
    real = getattr(optimizer.noise, point)

    def fails(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(optimizer.noise, point, fails)
    with pytest.raises(KeyboardInterrupt):
        optimizer.step()
    after = (_noise_state(optimizer.noise), copy.deepcopy(engine.state_dict()), optimizer.steps_taken,
             [p.detach().clone() for p in model.parameters()])  # fmt: skip
    assert_same(after, before)
    assert all(p.grad is None for p in model.parameters())  # the un-noised clipped sum is not left behind


def test_a_failure_while_recording_the_release_undoes_the_noise_step(monkeypatch):
    engine, model, optimizer, loader = make_run(mechanism="bandmf", seed=1, train_steps=2)
    inputs, targets = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(inputs), targets).backward()
    before = (_noise_state(optimizer.noise), copy.deepcopy(engine.state_dict()), optimizer.steps_taken)

    def interrupted(**kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.accountant, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        optimizer.step()
    monkeypatch.undo()
    assert_same((_noise_state(optimizer.noise), copy.deepcopy(engine.state_dict()), optimizer.steps_taken), before)
