"""``make_private(audit=AuditConfig(...))`` and ``engine.audit_report()``: one-run auditing with gradient canaries
added to the clipped sums before the noise (``privacy_engine.auditing.canaries``, ``training.canary_slot``)."""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import PrivacyEngine
from privacy_engine.auditing import AuditBoundWarning, AuditConfig, AuditReport, GradientCanaries
from privacy_engine.auditing import canaries as canaries_module
from privacy_engine.training.virtual_steps import VirtualSteps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tutorials"))


def make_run(*, audit=None, sigma=1.0, examples=48, batch_size=12, features=6, classes=3, mode="hooks",
             mechanism="gaussian", dtype=torch.float32, lr=0.0, seed=0, engine=None, **settings):  # fmt: skip
    """(engine, model, optimizer, loader) of a small linear model; the same data and batches for one seed."""
    torch.manual_seed(seed)
    x = torch.randn(examples, features, dtype=dtype)
    y = torch.randint(0, classes, (examples,))
    model = nn.Linear(features, classes).to(dtype)
    engine = engine or PrivacyEngine()
    if mechanism == "bandmf":
        settings = {"noise_mechanism": "bandmf", "num_bands": 2, "total_steps": 8, **settings}
    settings.setdefault("noise_seed", seed + 1)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size), noise_multiplier=sigma,
        max_grad_norm=1.0, grad_sample_mode=mode, audit=audit, **settings,
    )  # fmt: skip
    return engine, model, optimizer, loader


def train(run, steps, *, on_release=None):
    """``steps`` steps over the loader's stream; ``on_release(optimizer)`` sees each release (a step hook)."""
    _, model, optimizer, loader = run
    if on_release is not None:
        optimizer.attach_step_hook(on_release)
    stream = (batch for _ in range(100) for batch in loader)
    for _ in range(steps):
        inputs, targets = next(stream)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()


def released(run, steps):
    """The released gradients (flat, float64) of ``steps`` steps."""
    out = []
    train(run, steps, on_release=lambda opt: out.append(torch.cat([p.grad.reshape(-1) for p in opt.params]).double()))
    return out


# ---------------------------------------------------------------------------------------- the release
@pytest.mark.parametrize("mode,mechanism", [("hooks", "gaussian"), ("ghost", "gaussian"), ("hooks", "bandmf")])
def test_the_release_with_canaries_is_the_release_without_plus_the_included_canaries(mode, mechanism):
    # Noise off, float64: release_with - release_without = sum over included canaries of the step's group taking
    # part of C u_j, divided by the expected batch size as the examples' sum is.
    audit = AuditConfig(num_canaries=12, seed=5)
    kwargs = {"sigma": 0.0, "mode": mode, "mechanism": mechanism, "dtype": torch.float64}
    without = released(make_run(**kwargs), 4)
    run = make_run(audit=audit, **kwargs)
    canaries = run[2].canaries
    num_groups = 2 if mechanism == "bandmf" else 1
    assert canaries.num_groups == num_groups
    expected = []

    def before_release(step):
        # The step's participations, read before the release (they are fixed until it is scored).
        counts = canaries.participations(run[2].sample_rate, group=step % num_groups)
        counts = counts.numpy()
        in_group = (canaries.groups.numpy() == step % num_groups) & canaries.included.numpy()
        assert np.all(counts[~in_group] == 0)  # only included canaries of the step's cyclic group
        directions = canaries._directions.double().numpy()
        expected.append(sum(c * directions[j] for j, c in enumerate(counts)) * 1.0 / run[2].expected_batch_size)

    with_canaries = []
    hook = lambda opt: with_canaries.append(torch.cat([p.grad.reshape(-1) for p in opt.params]).double())
    run[2].attach_step_hook(hook)
    _, model, optimizer, loader = run
    stream = (batch for _ in range(100) for batch in loader)
    for step in range(4):
        inputs, targets = next(stream)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        before_release(step)
        optimizer.step()
    assert canaries.steps_scored == 4
    assert any(np.abs(e).sum() > 0 for e in expected)
    for got, base, extra in zip(with_canaries, without, expected):
        np.testing.assert_allclose((got - base).numpy(), extra, atol=1e-6)  # directions are float32


def test_without_an_audit_the_optimizer_has_no_canaries_and_its_state_no_canary_entry():
    _, _, optimizer, _ = make_run()
    assert optimizer.canaries is None
    assert "canaries" not in optimizer.state_dict()["privacy_engine.dp_state"]


# ---------------------------------------------------------------------------------------- the bound
def audited_full_batch_run(sigma, *, num_canaries=1000, scale_canaries=1.0, scale_noise=1.0, seed=0):
    """One step with q = 1 (the whole dataset), 1000 canaries in 4010 dimensions; the engine after it."""
    run = make_run(audit=AuditConfig(num_canaries=num_canaries, seed=seed), sigma=sigma, examples=32,
                   batch_size=32, features=400, classes=10, seed=seed)  # fmt: skip
    engine, _, optimizer, loader = run
    loader.batch_sampler.steps = 1
    if scale_canaries != 1.0:  # a deliberately broken run: each canary counts as more than one example
        canaries = optimizer.canaries
        gradient = canaries.canary_gradient
        canaries.canary_gradient = lambda *a, **k: scale_canaries * gradient(*a, **k)
    if scale_noise != 1.0:  # a deliberately broken run: less noise than the accountant records
        add_noise = optimizer.noise.add_noise_
        optimizer.noise.add_noise_ = lambda t, sigma, c, **k: add_noise(t, sigma * scale_noise, c, **k)
    train(run, 1)
    return engine


def test_the_one_run_bound_stays_below_the_accountant_and_rises_as_sigma_falls():
    bounds = []
    for sigma in (2.0, 1.0, 0.5):
        with warnings.catch_warnings():
            warnings.simplefilter("error", AuditBoundWarning)
            report = audited_full_batch_run(sigma).audit_report()
        assert 0 <= report.epsilon_lower_bound < report.claimed_epsilon, report
        assert report.steps == 1 and report.num_canaries == 1000
        bounds.append(report.epsilon_lower_bound)
    assert 0.2 < bounds[0] < bounds[1] < bounds[2], bounds


@pytest.mark.parametrize("broken", ["canary scaled 3x", "noise scaled down 10x"])
def test_a_broken_run_triggers_the_warning(broken):
    # Honest, sigma = 2: bound 0.34 for a claimed 1.99. Canary 3x: about 1.97 for 1.99; noise / 10 at sigma = 4:
    # about 2.6 for a claimed 0.93. Both pass the default factor 0.8.
    if broken == "canary scaled 3x":
        engine = audited_full_batch_run(2.0, scale_canaries=3.0)
    else:
        engine = audited_full_batch_run(4.0, scale_noise=0.1)
    with pytest.warns(AuditBoundWarning, match="lower bound"):
        report = engine.audit_report()
    assert report.close_to_claim and "WARNING" in str(report)


# ---------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("mechanism", ["gaussian", "bandmf"])
def test_a_resumed_run_gives_the_report_of_the_uninterrupted_run(tmp_path, mechanism):
    audit = AuditConfig(num_canaries=40)  # seed drawn from torch's generator, restored from the checkpoint
    whole = make_run(audit=audit, mechanism=mechanism, lr=0.1, seed=3)
    train(whole, 6)
    first = make_run(audit=audit, mechanism=mechanism, lr=0.1, seed=3)
    train(first, 3)
    engine, model, optimizer, loader = first
    engine.save_checkpoint(path=tmp_path / "run.pt", module=model, optimizer=optimizer, data_loader=loader)
    # Built with another seed: other canary seed and inclusion, other data; the checkpoint restores the canaries,
    # the data is set back to the saved run's (a checkpoint holds no dataset).
    resumed = make_run(audit=audit, mechanism=mechanism, lr=0.1, seed=9)
    resumed[0].load_checkpoint(
        path=tmp_path / "run.pt", module=resumed[1], optimizer=resumed[2], data_loader=resumed[3]
    )
    resumed[3].dataset.tensors = loader.dataset.tensors
    train(resumed, 3)
    a, b = whole[2].canaries, resumed[2].canaries
    assert torch.equal(a.scores, b.scores) and torch.equal(a.included, b.included) and a.seed == b.seed
    assert whole[0].audit_report() == resumed[0].audit_report()


def test_a_checkpoint_with_canaries_is_refused_by_a_run_without_an_audit(tmp_path):
    engine, model, optimizer, loader = make_run(audit=AuditConfig(num_canaries=8))
    train((engine, model, optimizer, loader), 1)
    engine.save_checkpoint(path=tmp_path / "run.pt", module=model, optimizer=optimizer, data_loader=loader)
    plain = make_run()
    with pytest.raises(ValueError, match="audit"):
        plain[0].load_checkpoint(path=tmp_path / "run.pt", module=plain[1], optimizer=plain[2], data_loader=plain[3])


# ---------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "settings,error,match",
    [
        ({"poisson_sampling": False}, ValueError, "poisson_sampling"),
        ({"max_batch_size": 8}, ValueError, "max_batch_size"),
    ],
)
def test_an_audit_that_could_not_be_exact_is_refused(settings, error, match):
    with pytest.raises(error, match=match):
        make_run(audit=AuditConfig(num_canaries=8), **settings)


def test_audit_config_refuses_bad_fields():
    # Input canaries' fields: tests/test_audit_input_canaries.py.
    for bad in ({"num_canaries": 1}, {"num_canaries": 10, "confidence": 1.0}, {"num_canaries": 10, "delta": 0.0},
                {"num_canaries": 10, "warn_factor": 0.0}, {"num_canaries": 10, "directions": "x"},
                {"num_canaries": 10, "kind": "x"}, {"num_canaries": 10, "seed": -1}):  # fmt: skip
        with pytest.raises(ValueError):
            AuditConfig(**bad)
    with pytest.raises(TypeError, match="AuditConfig"):
        make_run(audit={"num_canaries": 10})
    with pytest.raises(RuntimeError, match="audit"):
        make_run()[0].audit_report()


# ---------------------------------------------------------------------------------------- secure mode
def test_secure_mode_draws_the_canaries_from_the_os(monkeypatch):
    calls = []
    real = canaries_module.secure_uniform
    monkeypatch.setattr(canaries_module, "secure_uniform", lambda n: calls.append(n) or real(n))
    engine = PrivacyEngine(secure_mode=True)
    with pytest.raises(ValueError, match="seed"):
        make_run(audit=AuditConfig(num_canaries=8, seed=1), engine=engine, noise_seed=None)
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    data = DataLoader(TensorDataset(torch.randn(48, 6), torch.randint(0, 3, (48,))), batch_size=12)
    run = (engine, *engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                        data_loader=data, noise_multiplier=1.0, max_grad_norm=1.0,
                                        audit=AuditConfig(num_canaries=200)))  # fmt: skip
    assert calls == [200]  # inclusion
    train(run, 2)
    assert calls == [200, 200, 200]  # one draw per canary per release
    same_seed = [GradientCanaries(200, 10, seed=4, secure_mode=True).included for _ in range(2)]
    assert not torch.equal(*same_seed)  # not a function of the seed (equal with probability 2**-200)


# ---------------------------------------------------------------------------------------- the report
def test_the_report_prints_a_table_and_plots_only_with_matplotlib(tmp_path):
    engine, *_ = run = make_run(audit=AuditConfig(num_canaries=20, seed=1, confidence=0.9, delta=1e-6))
    train(run, 2)
    report = engine.audit_report()
    assert isinstance(report, AuditReport) and report.confidence == 0.9 and report.delta == 1e-6
    assert report.claimed_epsilon == engine.get_epsilon(1e-6) and report.steps == 2
    text = str(report)
    assert "one-run epsilon lower bound (90%)" in text and "accountant's epsilon" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert report.plot(tmp_path / "audit.png") is False and not (tmp_path / "audit.png").exists()
    else:
        assert report.plot(tmp_path / "audit.png") is True and (tmp_path / "audit.png").stat().st_size > 0


def test_virtual_steps_add_the_canaries_once_per_release():
    _, model, optimizer, loader = make_run(audit=AuditConfig(num_canaries=10, seed=2), batch_size=24)
    with VirtualSteps(data_loader=loader, max_physical_batch_size=5, optimizer=optimizer) as batches:
        for x, y in batches:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    assert optimizer.canaries.steps_scored == optimizer.steps_taken == len(loader)


# ---------------------------------------------------------------------------------------- the tutorial
def test_the_auditing_tutorial_runs_in_its_quick_mode(capsys):
    tutorial = importlib.import_module("auditing_digits")
    reports = tutorial.main(["--quick"])
    assert [r.epsilon_lower_bound < r.claimed_epsilon for r in reports] == [True, True]
    assert "lower bound (95%)" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------- adaptive clipping
def test_an_adaptive_clipping_run_adds_canaries_at_the_clip_norm_in_force_and_stays_below_its_epsilon():
    # Canaries scaled to the adaptive clip norm of their step (not the initial one); the bound of the audited run
    # stays below the accountant's epsilon (the pair gradient + count is accounted as one DP-SGD step at sigma).
    adaptive = {"clipping": "adaptive", "target_unclipped_quantile": 0.5, "clipbound_learning_rate": 0.5,
                "max_clipbound": 10.0, "min_clipbound": 0.01, "unclipped_num_std": 40.0}  # fmt: skip
    run = make_run(audit=AuditConfig(num_canaries=12, seed=5), sigma=0.0, dtype=torch.float64, lr=0.1, **adaptive)
    _, _, optimizer, _ = run
    seen = []
    gradient = optimizer.canaries.canary_gradient

    def spy(sample_rate, clip_norm, **kwargs):
        seen.append((clip_norm, float(optimizer.clipper.adaptive.clip_norms[0])))
        return gradient(sample_rate, clip_norm, **kwargs)

    optimizer.canaries.canary_gradient = spy
    train(run, 4)
    assert len(seen) == 4
    assert all(clip_norm == pytest.approx(in_force, rel=1e-12) for clip_norm, in_force in seen), seen
    assert len({round(clip_norm, 9) for clip_norm, _ in seen}) > 1, "the clip norm should move under adaptive clipping"

    sigma_run = make_run(audit=AuditConfig(num_canaries=1000, seed=0), sigma=1.0, examples=32, batch_size=32,
                         features=400, classes=10, **adaptive)  # fmt: skip
    sigma_run[3].batch_sampler.steps = 1
    train(sigma_run, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AuditBoundWarning)
        report = sigma_run[0].audit_report()
    assert 0 <= report.epsilon_lower_bound < report.claimed_epsilon, report


def test_a_rescaled_adaptive_run_adds_unit_canaries_while_its_clip_norm_moves():
    # rescale_to_unit_norm: the release is in units of the clip norm in force, so a canary (one more example)
    # is scaled to the sensitivity 1 at every step, whatever the clip norm is.
    adaptive = {"clipping": "adaptive", "target_unclipped_quantile": 0.5, "clipbound_learning_rate": 0.5,
                "max_clipbound": 10.0, "min_clipbound": 0.01, "unclipped_num_std": 40.0, "rescale_to_unit_norm": True}  # fmt: skip
    run = make_run(audit=AuditConfig(num_canaries=12, seed=5), sigma=0.0, dtype=torch.float64, lr=0.1, **adaptive)
    _, _, optimizer, _ = run
    seen = []
    gradient = optimizer.canaries.canary_gradient

    def spy(sample_rate, clip_norm, **kwargs):
        seen.append((clip_norm, float(optimizer.clipper.adaptive.clip_norms[0])))
        return gradient(sample_rate, clip_norm, **kwargs)

    optimizer.canaries.canary_gradient = spy
    train(run, 4)
    assert [clip_norm for clip_norm, _ in seen] == [1.0] * 4
    assert len({round(in_force, 9) for _, in_force in seen}) > 1, "the clip norm should move under adaptive clipping"
