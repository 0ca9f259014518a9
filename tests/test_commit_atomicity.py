"""A noise step's commit is all or nothing against any exception (issue 27, item 2).

The commit (BandMF history row, the accountant's record through ``on_commit``, ring position, step
index) is interrupted at each of its points by each kind of exception, raised either by the code there
or by a signal handler (SIGINT's ``KeyboardInterrupt``, a SIGTERM handler's ``SystemExit``, a SIGALRM
handler's ``TimeoutError``). Afterwards the step happened whole or not at all, and a run that goes on
(retrying a step that did not happen, through a save / load of the state) releases bit for bit what an
uninterrupted run releases.
"""

from __future__ import annotations

import dataclasses
import signal

import pytest
import torch

from privacy_engine.interrupts import deferred_signals
from privacy_engine.noise import BandMFNoise, GaussianNoise
from privacy_engine.noise import mechanism as mechanism_module

SHAPES = [(3, 4), (5,)]
STEPS = 6
INTERRUPTED_STEP = 2
SIGMA, CLIP = 1.3, 0.7

MECHANISMS = {
    "gaussian": lambda: GaussianNoise(seed=11, prefetch=False),
    "bandmf": lambda: BandMFNoise([1.0, -0.6, 0.3], seed=11, prefetch=False),
    "bandmf-prefetch": lambda: BandMFNoise([1.0, -0.6, 0.3], seed=11, prefetch=True),
}
POINTS = ["start", "history_written", "counters_computed", "on_commit", "committed"]
EXCEPTIONS = {
    "SystemExit": SystemExit,
    "TimeoutError": TimeoutError,
    "KeyboardInterrupt": KeyboardInterrupt,
    "RuntimeError": RuntimeError,
}
SIGNALS = {"SystemExit": signal.SIGTERM, "TimeoutError": signal.SIGALRM, "KeyboardInterrupt": signal.SIGINT}


def gradients(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def clean_run(make) -> list[list[torch.Tensor]]:
    noise, released = make(), []
    for step in range(STEPS):
        tensors = gradients(step)
        noise.add_noise_(tensors, SIGMA, CLIP)
        released.append(tensors)
    return released


def snapshot(noise) -> dict:
    noise._wait_for_draws_ahead()
    state = noise.state_dict()
    state["ring_position"] = getattr(noise, "_ring_position", None)
    return state


def assert_same_state(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_state(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.fixture
def raising_signal_handlers():
    """SIGTERM -> SystemExit and SIGALRM -> TimeoutError, as a preemptible cluster's job installs them."""

    def on_sigterm(signum, frame):
        raise SystemExit(143)

    def on_sigalrm(signum, frame):
        raise TimeoutError("step took too long")

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, on_sigterm),
                signal.SIGALRM: signal.signal(signal.SIGALRM, on_sigalrm),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}  # fmt: skip
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("delivery", ["raised", "signal"])
@pytest.mark.parametrize("exception_name", list(EXCEPTIONS))
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("mechanism_name", list(MECHANISMS))
def test_an_interrupted_commit_happens_whole_or_not_at_all_and_the_run_continues_bit_for_bit(
    mechanism_name, point, exception_name, delivery, monkeypatch, raising_signal_handlers
):
    if delivery == "signal" and exception_name not in SIGNALS:
        pytest.skip("no signal raises an arbitrary exception")
    exception_type = EXCEPTIONS[exception_name]
    expected = clean_run(MECHANISMS[mechanism_name])
    armed = [False]

    def interrupt() -> None:
        armed[0] = False
        if delivery == "signal":
            signal.raise_signal(SIGNALS[exception_name])
        else:
            raise exception_type("injected")

    def commit_point(name: str) -> None:
        if armed[0] and name == point:
            interrupt()

    monkeypatch.setattr(mechanism_module, "_commit_point", commit_point)
    noise, ledger, released = MECHANISMS[mechanism_name](), [], []

    def record(step: int) -> None:
        if armed[0] and point == "on_commit":
            interrupt()  # the accountant raises before it records: nothing recorded
        ledger.append(step)

    step, interrupted = 0, False
    while step < STEPS:
        tensors = gradients(step)
        if step == INTERRUPTED_STEP and not interrupted:
            interrupted = True
            before = snapshot(noise)
            armed[0] = True
            with pytest.raises(exception_type):
                noise.add_noise_(tensors, SIGMA, CLIP, on_commit=lambda step=step: record(step))
            assert not armed[0], "the interruption point was never reached"
            happened = delivery == "signal" or point == "committed"
            if happened:
                assert noise.step == step + 1 and ledger == list(range(step + 1))
                released.append(tensors)
                step += 1
            else:
                assert noise.step == step and ledger == list(range(step))
                assert_same_state(snapshot(noise), before)
            # Resume from a saved state in a new mechanism, as after a preemption.
            state = noise.state_dict()
            noise = MECHANISMS[mechanism_name]()
            noise.load_state_dict(state)
            continue
        noise.add_noise_(tensors, SIGMA, CLIP, on_commit=lambda step=step: record(step))
        released.append(tensors)
        step += 1
    assert ledger == list(range(STEPS)) and noise.step == STEPS
    for got, want in zip(released, expected):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_an_uninterrupted_commit_is_unchanged_by_the_commit_points():
    noise = BandMFNoise([1.0, -0.6, 0.3], seed=11, prefetch=False)
    points = []
    original = mechanism_module._commit_point
    try:
        mechanism_module._commit_point = points.append
        noise.add_noise_(gradients(0), SIGMA, CLIP, on_commit=lambda: points.append("on_commit"))
    finally:
        mechanism_module._commit_point = original
    assert points == ["start", "history_written", "counters_computed", "on_commit", "committed"]


def test_deferred_signals_runs_the_handler_after_the_block(raising_signal_handlers):
    done = []
    with pytest.raises(SystemExit), deferred_signals():
        signal.raise_signal(signal.SIGTERM)
        done.append("after the signal")
    assert done == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_nested_deferral_delivers_at_the_end_of_the_outer_block(raising_signal_handlers):
    done = []
    with pytest.raises(TimeoutError), deferred_signals():
        with deferred_signals():
            signal.raise_signal(signal.SIGALRM)
        done.append("outer block went on")
    assert done == ["outer block went on"]


def test_a_signal_is_not_dropped_when_the_block_raises(raising_signal_handlers):
    with pytest.raises(SystemExit) as caught, deferred_signals():
        signal.raise_signal(signal.SIGTERM)
        raise ValueError("the block failed")
    assert isinstance(caught.value.__context__, ValueError)


# ------------------------------------------------------------------------------ through the engine
def private_run(mechanism: str):
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from privacy_engine import PrivacyEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    data = torch.Generator().manual_seed(1234)
    dataset = TensorDataset(torch.randn(40, 6, generator=data), torch.randint(0, 3, (40,), generator=data))
    engine = PrivacyEngine(accountant="rdp")
    extra = {"noise_mechanism": "bandmf", "num_bands": 3, "total_steps": 16} if mechanism == "bandmf" else {}
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        data_loader=DataLoader(dataset, batch_size=5), noise_multiplier=1.0, max_grad_norm=0.5, noise_seed=7,
        **extra,
    )  # fmt: skip
    return engine, model, optimizer, loader


def train_steps(run, stream, steps: int) -> list[list[torch.Tensor]]:
    from torch import nn

    _, model, optimizer, _ = run
    params = []
    for _ in range(steps):
        inputs, targets = next(stream)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return params


def stream_of(loader):
    while True:
        yield from loader


@pytest.mark.parametrize("exception_name", list(SIGNALS))
@pytest.mark.parametrize("mechanism_name", ["gaussian", "bandmf"])
def test_a_signal_during_an_engine_steps_commit_lets_the_step_finish_and_a_resume_matches_the_clean_run(
    mechanism_name, exception_name, monkeypatch, raising_signal_handlers, tmp_path
):
    clean = private_run(mechanism_name)
    expected = train_steps(clean, stream_of(clean[3]), 6)

    run = private_run(mechanism_name)
    engine, model, optimizer, loader = run
    stream = stream_of(loader)
    got = train_steps(run, stream, 2)
    armed = [True]

    def commit_point(name: str) -> None:
        if armed[0] and name == "history_written":
            armed[0] = False
            signal.raise_signal(SIGNALS[exception_name])

    monkeypatch.setattr(mechanism_module, "_commit_point", commit_point)
    with pytest.raises(EXCEPTIONS[exception_name]):
        train_steps(run, stream, 1)
    assert not armed[0]
    # The step happened whole: recorded once, noise advanced, parameters updated (as in the clean run).
    assert engine.accountant.steps == optimizer.noise.step == optimizer.steps_taken == 3
    got.append([p.detach().clone() for p in model.parameters()])
    engine.save_checkpoint(path=tmp_path / "run.pt", module=model, optimizer=optimizer, data_loader=loader)

    resumed = private_run(mechanism_name)
    resumed[0].load_checkpoint(path=tmp_path / "run.pt", module=resumed[1], optimizer=resumed[2],
                               data_loader=resumed[3])  # fmt: skip
    got += train_steps(resumed, stream_of(resumed[3]), 3)
    assert resumed[0].accountant.steps == 6
    for step, (a, b) in enumerate(zip(got, expected)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step} differs from the clean run"


# ------------------------------------------------------------------- the optimizer's record of a step
class _DrawsRaisingOnce(tuple):
    """A release's draws whose first iteration inside the commit raises (``interrupt``), as any statement of
    the optimizer's bookkeeping of the release could. Iterations before the commit (the checks) pass."""

    interrupt = None

    def __iter__(self):
        if _DrawsRaisingOnce.interrupt is not None:
            interrupt, _DrawsRaisingOnce.interrupt = _DrawsRaisingOnce.interrupt, None
            interrupt()
        return super().__iter__()


def _record_counters(engine, optimizer) -> tuple:
    contract = optimizer.contract
    return (engine.accountant.steps, optimizer.steps_taken, optimizer.noise.step, contract.last_released_step,
            tuple(id(draw) for draw in contract._released_draws))  # fmt: skip


@pytest.mark.parametrize("delivery", ["raised", "signal"])
@pytest.mark.parametrize("exception_name", list(EXCEPTIONS))
@pytest.mark.parametrize("site", ["release bookkeeping", "accountant"])
@pytest.mark.parametrize("mechanism_name", ["gaussian", "bandmf"])
def test_an_interrupted_record_counts_the_step_everywhere_or_nowhere_and_the_run_goes_on_as_a_clean_one(
    mechanism_name, site, exception_name, delivery, monkeypatch, raising_signal_handlers
):
    """The optimizer's ``record()`` (inside the noise commit) writes the accountant's step, ``steps_taken`` and
    the step contract's released draws: interrupted in its bookkeeping of the release or in the accountant,
    all of them advance or none does, and training on (the batch abandoned when its step did not happen)
    gives bit for bit the parameters of a run that never drew the interruption."""
    if delivery == "signal" and exception_name not in SIGNALS:
        pytest.skip("no signal raises an arbitrary exception")
    from privacy_engine.training import step_contract

    def interrupt() -> None:
        if delivery == "signal":
            signal.raise_signal(SIGNALS[exception_name])
        else:
            raise EXCEPTIONS[exception_name]("injected")

    run = private_run(mechanism_name)
    engine, model, optimizer, loader = run
    stream = stream_of(loader)
    got = train_steps(run, stream, 2)
    pending = [False]
    if site == "release bookkeeping":
        close = step_contract.StepContract.close
        monkeypatch.setattr(step_contract.StepContract, "close",
                            lambda self: dataclasses.replace(close(self), draws=_DrawsRaisingOnce(close(self).draws)))
        arm = lambda: setattr(_DrawsRaisingOnce, "interrupt", interrupt)
    else:
        accountant_step = engine.accountant.step

        def step_raising_once(**kwargs):
            if pending[0]:
                pending[0] = False
                interrupt()  # before the accountant records anything; a signal is held until the commit ends
            accountant_step(**kwargs)

        monkeypatch.setattr(engine.accountant, "step", step_raising_once)
        arm = lambda: pending.__setitem__(0, True)
    monkeypatch.setattr(mechanism_module, "_commit_point", lambda name: name == "counters_computed" and arm())

    before = _record_counters(engine, optimizer)
    inputs, targets = next(stream)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()
    with pytest.raises(EXCEPTIONS[exception_name]):
        optimizer.step()
    monkeypatch.setattr(mechanism_module, "_commit_point", lambda name: None)
    assert _DrawsRaisingOnce.interrupt is None and not pending[0], "the interruption point was never reached"
    after = _record_counters(engine, optimizer)
    happened = delivery == "signal"
    if happened:
        assert after[:3] == tuple(count + 1 for count in before[:3])
        assert after[3] == 2 and after[4][: len(before[4])] == before[4] and len(after[4]) == len(before[4]) + 1
        got.append([p.detach().clone() for p in model.parameters()])
    else:
        assert after == before
    got += train_steps(run, stream, 3)

    clean = private_run(mechanism_name)
    clean_stream = stream_of(clean[3])
    expected = train_steps(clean, clean_stream, 2)
    if not happened:
        next(clean_stream)  # the batch of the step that did not happen: drawn, never released
    expected += train_steps(clean, clean_stream, len(got) - 2)
    assert engine.accountant.steps == clean[0].accountant.steps == optimizer.noise.step
    assert optimizer.steps_taken == clean[2].steps_taken == len(got)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step} differs from the clean run"
