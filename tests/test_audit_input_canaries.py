"""``make_private(audit=AuditConfig(kind="input", ...))``: input canaries appended to the dataset the private loader
samples (``privacy_engine.auditing.input_canaries``), scored by the trained model's loss, reported as gradient
canaries are (``engine.audit_report()``)."""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, IterableDataset, SubsetRandomSampler, TensorDataset

from accountants import make_accountant
from privacy_engine import PrivacyEngine
from privacy_engine.auditing import AuditBoundWarning, AuditConfig, CanaryDataset, InputCanaries
from privacy_engine.auditing import input_canaries as input_canaries_module
from privacy_engine.engine import plan as plan_module
from privacy_engine.engine.options import options_from

FEATURES, CLASSES = 50, 10


def real_data(examples=200, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(examples, FEATURES, generator=generator),
                         torch.randint(0, CLASSES, (examples,), generator=generator))  # fmt: skip


def make_run(*, audit, dataset=None, batch_size=100, sigma=1.0, accountant="rdp", lr=2.0, seed=0, engine=None,
             loader=None, **settings):  # fmt: skip
    """(engine, model, optimizer, loader) of a linear classifier on random data; the same for one seed."""
    torch.manual_seed(seed)
    model = nn.Linear(FEATURES, CLASSES)
    engine = engine or PrivacyEngine(accountant=accountant)
    settings.setdefault("noise_seed", seed + 1)
    if loader is None:
        loader = DataLoader(real_data() if dataset is None else dataset, batch_size=batch_size)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), data_loader=loader,
        noise_multiplier=sigma, max_grad_norm=1.0, audit=audit, **settings,
    )  # fmt: skip
    return engine, model, optimizer, loader


def train(run, steps):
    _, model, optimizer, loader = run
    stream = (batch for _ in range(1000) for batch in loader)
    for _ in range(steps):
        inputs, targets = next(stream)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()


def audit(num_canaries=200, **fields):
    return AuditConfig(num_canaries=num_canaries, kind="input", num_classes=CLASSES, **fields)


# ---------------------------------------------------------------------------------------- the dataset
def test_the_loaders_dataset_holds_the_real_examples_then_exactly_the_included_canaries():
    real = real_data()
    _, _, optimizer, loader = make_run(audit=audit(seed=4), dataset=real)
    canaries = optimizer.canaries
    assert isinstance(canaries, InputCanaries) and isinstance(loader.dataset, CanaryDataset)
    included = canaries.included_indices
    assert 0 < len(included) < 200 and len(loader.dataset) == len(real) + len(included)
    for i in range(len(real)):
        assert all(torch.equal(a, b) for a, b in zip(loader.dataset[i], real[i]))
    appended = [loader.dataset[len(real) + r] for r in range(len(included))]
    for (features, label), j in zip(appended, included):
        # The seeded canary: an N(0, 1) input shaped as the data's, a label in range; none from the data.
        expected = canaries.example(j)
        assert torch.equal(features, expected[0]) and int(label) == int(expected[1]) and 0 <= int(label) < CLASSES
        assert features.shape == real[0][0].shape and features.dtype == real[0][0].dtype
    excluded = [canaries.example(j)[0] for j in range(200) if j not in set(included)]
    assert not any(torch.equal(x, f) for x in excluded for f, _ in appended)
    # Drawn from the seed alone: another build with the same seed appends the same canaries.
    again = make_run(audit=audit(seed=4), dataset=real, seed=7)[2].canaries
    assert torch.equal(again.included, canaries.included) and torch.equal(again.example(3)[0], canaries.example(3)[0])


def test_the_sample_rate_the_steps_and_the_accounting_use_the_enlarged_dataset():
    engine, _, optimizer, loader = run = make_run(audit=audit(seed=1), batch_size=100)
    enlarged = 200 + int(optimizer.canaries.included.sum())
    assert len(loader.dataset) == enlarged
    assert optimizer.sample_rate == pytest.approx(100 / enlarged, rel=1e-12) == loader.sample_rate
    assert engine.noise_plan.sample_rate == optimizer.sample_rate
    assert optimizer.expected_batch_size == pytest.approx(100.0)
    assert len(loader) == round(enlarged / 100)
    train(run, 5)
    reference = make_accountant("rdp")
    reference.step(noise_multiplier=1.0, sample_rate=100 / enlarged, num_steps=5)
    assert optimizer.canaries.steps_scored == 5
    assert engine.get_epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9)


def test_a_calibrated_run_is_calibrated_for_the_enlarged_dataset():
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, CLASSES)
    engine = PrivacyEngine(accountant="rdp")
    _, optimizer, _ = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(real_data(), batch_size=50), target_epsilon=4.0, target_delta=1e-5, epochs=2,
        max_grad_norm=1.0, audit=audit(seed=2),
    )  # fmt: skip
    enlarged = 200 + int(optimizer.canaries.included.sum())
    assert optimizer.sample_rate == pytest.approx(50 / enlarged)
    reference = make_accountant("rdp")
    reference.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=50 / enlarged,
                   num_steps=2 * round(enlarged / 50))  # fmt: skip
    assert reference.get_epsilon(1e-5) == pytest.approx(4.0, abs=0.05)


def test_a_split_loader_samples_its_split_and_every_included_canary():
    real = real_data()
    split = DataLoader(real, batch_size=50, sampler=SubsetRandomSampler(range(0, 200, 2)))
    _, _, optimizer, loader = make_run(audit=audit(seed=3), loader=split)
    k = int(optimizer.canaries.included.sum())
    drawable = set(loader.batch_sampler.indices.tolist())
    assert drawable == set(range(0, 200, 2)) | set(range(200, 200 + k))
    assert optimizer.sample_rate == pytest.approx(50 / (100 + k))


# ---------------------------------------------------------------------------------------- the bound
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_the_bound_stays_below_the_accountant_and_finds_the_canaries(mode):
    run = make_run(audit=audit(seed=1), sigma=1.0, grad_sample_mode=mode)
    train(run, 15)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AuditBoundWarning)
        report = run[0].audit_report()
    assert report.kind == "input" and report.steps == 15 and report.num_canaries == 200
    assert 0.2 < report.epsilon_lower_bound < report.claimed_epsilon, report
    assert "(input)" in str(report)


def test_a_canary_counted_fifty_times_gives_a_higher_bound_and_the_warning():
    # A deliberately broken run: each included canary is 50 examples (49 copies already in the data), so it
    # weighs 50 clipped gradients, which the accountant does not know. (Weighting a canary x50 in the loss
    # would not break anything: per-example clipping bounds its gradient at C whatever the weight.)
    sigma, seed = 4.0, 1
    honest = make_run(audit=audit(seed=seed), sigma=sigma)
    train(honest, 15)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AuditBoundWarning)
        honest_report = honest[0].audit_report()
    same = InputCanaries(200, seed, example_like=real_data()[0], num_classes=CLASSES)
    copies = [same.example(j) for j in same.included_indices] * 49
    broken = make_run(audit=audit(seed=seed), sigma=sigma, dataset=ConcatDataset([real_data(), copies]),
                      batch_size=1800)  # fmt: skip
    assert torch.equal(broken[2].canaries.included, same.included)
    train(broken, 15)
    with pytest.warns(AuditBoundWarning, match="lower bound"):
        broken_report = broken[0].audit_report()
    assert honest_report.epsilon_lower_bound < 0.5 * honest_report.claimed_epsilon
    assert broken_report.epsilon_lower_bound > max(1.0, 3 * honest_report.epsilon_lower_bound), (
        honest_report, broken_report)  # fmt: skip
    assert broken_report.close_to_claim


# ---------------------------------------------------------------------------------------- the user's canaries
def test_canary_fn_and_score_fn_are_the_users():
    def canary_fn(index):
        return torch.full((FEATURES,), float(index)), torch.tensor(index % CLASSES)

    seen = []

    def score_fn(model, example):
        seen.append(float(example[0][0]))
        return float(example[0][0])  # the index: a score that knows nothing of the training

    config = AuditConfig(num_canaries=20, kind="input", canary_fn=canary_fn, score_fn=score_fn, seed=0)
    run = make_run(audit=config)
    canaries = run[2].canaries
    for r, j in enumerate(canaries.included_indices):
        assert torch.equal(run[3].dataset[200 + r][0], canary_fn(j)[0])
    train(run, 2)
    report = run[0].audit_report()
    assert seen == [float(j) for j in range(20)] and canaries.scores.tolist() == [float(j) for j in range(20)]
    assert report.num_included == len(canaries.included_indices)


# ---------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("mechanism", ["gaussian", "bandmf"])
def test_a_resumed_run_gives_the_report_of_the_uninterrupted_run(tmp_path, mechanism):
    config = audit(num_canaries=40)  # seed drawn from torch's generator: the same for the same torch seed
    settings = {"noise_mechanism": "bandmf", "num_bands": 2, "total_steps": 8} if mechanism == "bandmf" else {}
    build = lambda: make_run(audit=config, batch_size=40, lr=0.1, seed=3, **settings)
    whole = build()
    train(whole, 6)
    first = build()
    train(first, 3)
    engine, model, optimizer, loader = first
    engine.save_checkpoint(path=tmp_path / "run.pt", module=model, optimizer=optimizer, data_loader=loader)
    resumed = build()
    resumed[0].load_checkpoint(path=tmp_path / "run.pt", module=resumed[1], optimizer=resumed[2],
                               data_loader=resumed[3])  # fmt: skip
    train(resumed, 3)
    a, b = whole[2].canaries, resumed[2].canaries
    assert torch.equal(a.included, b.included) and a.seed == b.seed and b.steps_scored == 6
    assert all(torch.equal(p, q) for p, q in zip(whole[1].parameters(), resumed[1].parameters()))
    assert whole[0].audit_report() == resumed[0].audit_report()


def test_a_checkpoint_of_other_input_canaries_is_refused(tmp_path):
    # The loader's dataset was built with this run's canaries: a checkpoint of others is refused, before anything
    # is restored. Seeds 6 and 12 include 19 of 40 canaries each (the same sample rate): the canaries' check names
    # the seed to pass; seed 5 includes 17 (another sample rate): the noise plan's check refuses first.
    engine, model, optimizer, loader = run = make_run(audit=audit(num_canaries=40, seed=6))
    train(run, 1)
    engine.save_checkpoint(path=tmp_path / "run.pt", module=model, optimizer=optimizer, data_loader=loader)
    for other_seed, match in ((12, r"AuditConfig\(seed=6"), (5, "sample_rate")):
        other = make_run(audit=audit(num_canaries=40, seed=other_seed))
        before = [p.detach().clone() for p in other[1].parameters()]
        with pytest.raises(ValueError, match=match):
            other[0].load_checkpoint(path=tmp_path / "run.pt", module=other[1], optimizer=other[2],
                                     data_loader=other[3])  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(before, other[1].parameters()))
    # The state of gradient canaries of the same size: the canaries' kind.
    gradient_state = make_run(audit=AuditConfig(num_canaries=40, seed=6))[2].canaries.state_dict()
    with pytest.raises(ValueError, match="kind='gradient'"):
        optimizer.canaries.check_state_dict(gradient_state)


def test_the_canaries_state_is_plain_data():
    canaries = make_run(audit=audit(num_canaries=12, seed=2))[2].canaries
    state = canaries.state_dict()
    assert state["kind"] == "input" and state["seed"] == 2 and state["included"].dtype == torch.bool
    assert set(state) == {"kind", "num_canaries", "seed", "included", "steps_scored"}


# ---------------------------------------------------------------------------------------- refusals
class Stream(IterableDataset):
    def __iter__(self):
        yield from real_data()


def test_an_input_audit_that_could_not_be_exact_is_refused():
    with pytest.raises(TypeError, match="data_loader.dataset"):
        make_run(audit=audit(num_canaries=8), loader=DataLoader(Stream(), batch_size=10))
    with pytest.raises(ValueError, match="poisson_sampling"):
        make_run(audit=audit(num_canaries=8), poisson_sampling=False)
    with pytest.raises(ValueError, match="max_batch_size"):
        make_run(audit=audit(num_canaries=8), max_batch_size=120, accountant="pld")
    tokens = TensorDataset(torch.randint(0, 5, (20, 4)), torch.randint(0, 2, (20,)))
    with pytest.raises(ValueError, match="canary_fn"):
        make_run(audit=audit(num_canaries=8), loader=DataLoader(tokens, batch_size=5))
    options = options_from("make_private", {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "audit": audit(8)})
    with pytest.raises(ValueError, match='kind="input".*DDP'):
        plan_module._with_input_canaries(DataLoader(real_data(), batch_size=10), options, secure_mode=False,
                                         job=object())  # fmt: skip


def test_audit_config_checks_the_input_fields():
    with pytest.raises(ValueError, match="num_classes"):
        AuditConfig(num_canaries=10, kind="input")
    with pytest.raises(ValueError, match="num_classes"):
        AuditConfig(num_canaries=10, kind="input", num_classes=1)
    with pytest.raises(ValueError, match="canary_fn must be callable"):
        AuditConfig(num_canaries=10, kind="input", canary_fn=3)
    with pytest.raises(ValueError, match="num_classes is for input canaries"):
        AuditConfig(num_canaries=10, num_classes=10)
    assert AuditConfig(num_canaries=10, kind="input", canary_fn=lambda j: j).num_classes is None


# ---------------------------------------------------------------------------------------- secure mode
def test_secure_mode_draws_the_inclusion_from_the_os_and_refuses_a_seed(monkeypatch):
    calls = []
    real = input_canaries_module.secure_uniform
    monkeypatch.setattr(input_canaries_module, "secure_uniform", lambda n: calls.append(n) or real(n))
    engine = PrivacyEngine(secure_mode=True, accountant="rdp")
    with pytest.raises(ValueError, match="seed"):
        make_run(audit=audit(num_canaries=8, seed=1), engine=engine, noise_seed=None)
    run = make_run(audit=audit(num_canaries=200), engine=engine, noise_seed=None)
    assert calls == [200]
    assert len(run[3].dataset) == 200 + int(run[2].canaries.included.sum())
    same_seed = [InputCanaries(200, 4, example_like=real_data()[0], num_classes=3, secure_mode=True).included
                 for _ in range(2)]  # fmt: skip
    assert not torch.equal(*same_seed)  # not a function of the seed (equal with probability 2**-200)
    assert math.isfinite(run[0].get_epsilon(1e-5))


# ---------------------------------------------------------------------------------------- the tutorial
def test_the_auditing_tutorial_runs_input_canaries_in_its_quick_mode(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tutorials"))
    tutorial = importlib.import_module("auditing_digits")
    reports = tutorial.main(["--quick", "--kind", "input"])
    assert [r.kind for r in reports] == ["input", "input"]
    assert all(0 <= r.epsilon_lower_bound < r.claimed_epsilon for r in reports)
    assert "200 input canaries" in capsys.readouterr().out
