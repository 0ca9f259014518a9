"""Noise and clip-norm schedules (``privacy_engine.training.schedules``, issue 26 part B).

What is specified here: the epsilon of a scheduled run is dp-accounting's composition of the steps that ran
(one ``SelfComposedDpEvent`` of ``PoissonSampled(Gaussian(sigma))`` per run of equal sigma, built here from the
schedule, never read from the engine), hooks and ghost, RDP and PLD; the budget stops at the step the composed
epsilon would pass; a clip schedule clips each release at the C in force (a float64 per-example loop, and the
black-box sensitivity: removing one example moves a noiseless release by exactly that C); a resume in the
middle of a schedule is bit-identical to the uninterrupted run; a checkpoint saved at another sigma resumes and
is accounted at both; what cannot be scheduled (BandMF's sigma, adaptive clipping's C, C with sums waiting) is
refused before anything changes; the Opacus names behave as Opacus's own tests expect.
"""

from __future__ import annotations

import math

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accountants.rdp import DEFAULT_RDP_ORDERS
from privacy_engine import PrivacyBudgetExceeded, PrivacyEngine
from privacy_engine.training.schedules import (
    ExponentialGradClip,
    ExponentialNoise,
    LambdaGradClip,
    LambdaNoise,
    NoiseScheduler,
    StepGradClip,
    StepNoise,
)

DELTA = 1e-5
NUM_EXAMPLES, BATCH_SIZE = 64, 8  # q = 1/8, 8 steps an epoch


def _data(num_examples: int = NUM_EXAMPLES, seed: int = 1) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(num_examples, 5, generator=generator),
                         torch.randint(0, 3, (num_examples,), generator=generator))  # fmt: skip


def _run(*, mode: str = "hooks", accountant: str = "rdp", seed: int = 0, **settings):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    engine = PrivacyEngine(accountant=accountant)
    settings = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, **settings}
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(_data(), batch_size=BATCH_SIZE),
        grad_sample_mode=mode, **settings,
    )  # fmt: skip
    return engine, model, optimizer, loader


def _train(model, optimizer, batches, steps: int, after_step=()) -> None:
    for _ in range(steps):
        x, y = next(batches)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        for scheduler in after_step:
            scheduler.step()


def _composed_event(sigmas: list[float], sample_rate: float) -> dp_accounting.DpEvent:
    """dp-accounting's event of DP-SGD steps at ``sigmas`` (in order): one self-composition per run of equal sigma."""
    runs: list[list] = []
    for sigma in sigmas:
        if runs and runs[-1][0] == sigma:
            runs[-1][1] += 1
        else:
            runs.append([sigma, 1])
    return dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(sigma)), count)
        for sigma, count in runs
    ])  # fmt: skip


def _dp_accounting_epsilon(accountant: str, event: dp_accounting.DpEvent) -> float:
    if accountant == "rdp":
        reference = dp_accounting.rdp.RdpAccountant(orders=list(DEFAULT_RDP_ORDERS))
    else:
        reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    return reference.compose(event).get_epsilon(DELTA)


# ---------------------------------------------------------------------------------------------- accounting
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("accountant", ["rdp", pytest.param("pld", marks=pytest.mark.slow)])
def test_the_epsilon_of_a_noise_schedule_is_dp_accountings_composition_of_the_steps_that_ran(mode, accountant):
    engine, model, optimizer, loader = _run(mode=mode, accountant=accountant, noise_multiplier=1.2)
    factors = [1.0, 1.0, 0.8, 0.8, 1.5, 0.7]
    scheduler = LambdaNoise(optimizer, noise_lambda=lambda t: factors[t])
    _train(model, optimizer, iter(loader), steps=len(factors) - 1, after_step=[scheduler])
    ran = [1.2 * f for f in factors[:-1]]  # the last factor is set after the last step: never used
    expected = _dp_accounting_epsilon(accountant, _composed_event(ran, BATCH_SIZE / NUM_EXAMPLES))
    fixed = _dp_accounting_epsilon(accountant, _composed_event([1.2] * len(ran), BATCH_SIZE / NUM_EXAMPLES))
    assert abs(expected - fixed) > 0.05 * fixed  # the schedule matters: a ledger of sigma_0 only would fail
    assert engine.get_epsilon(DELTA) == pytest.approx(expected, rel=1e-9)
    assert optimizer.noise_multiplier == pytest.approx(1.2 * factors[-1])


def test_the_noise_is_drawn_at_the_sigma_in_force_at_each_release():
    _engine, model, optimizer, loader = _run(noise_multiplier=1.0, max_grad_norm=0.5)
    scheduler = StepNoise(optimizer, step_size=1, gamma=3.0)
    stds = []
    original = optimizer.noise.add_noise_

    def spy(tensors, noise_multiplier, max_grad_norm, **kwargs):
        stds.append(noise_multiplier * max_grad_norm)
        return original(tensors, noise_multiplier, max_grad_norm, **kwargs)

    optimizer.noise.add_noise_ = spy
    _train(model, optimizer, iter(loader), steps=3, after_step=[scheduler])
    assert stds == pytest.approx([0.5, 1.5, 4.5])


def test_the_budget_stops_at_the_step_where_the_composed_epsilon_would_pass_it():
    sigmas = [1.0 * 0.5**t for t in range(4)]
    sample_rate = BATCH_SIZE / NUM_EXAMPLES
    after = [_dp_accounting_epsilon("rdp", _composed_event(sigmas[: k + 1], sample_rate)) for k in range(4)]
    budget = (after[2] + after[3]) / 2  # steps 0-2 fit, step 3 does not
    engine, model, optimizer, loader = _run(noise_multiplier=1.0, max_epsilon=budget, target_delta=DELTA)
    scheduler = ExponentialNoise(optimizer, gamma=0.5)
    batches = iter(loader)
    _train(model, optimizer, batches, steps=3, after_step=[scheduler])
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyBudgetExceeded):
        _train(model, optimizer, batches, steps=1)
    assert engine.accountant.steps == 3
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert engine.get_epsilon(DELTA) == pytest.approx(after[2], rel=1e-12)


# ---------------------------------------------------------------------------------------------- clipping
def _per_example_clipped_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, bound: float) -> list[torch.Tensor]:
    """sum_i clip(g_i, bound) by an ordinary loop over examples (float64), the definition."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.mse_loss(model(x[i : i + 1]), y[i : i + 1], reduction="sum").backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        factor = bound / max(float(norm), bound)
        total = [t + factor * g for t, g in zip(total, grads)]
    return total


def _noiseless_releases(dataset: TensorDataset, mode: str, factors: list[float]) -> list[list[torch.Tensor]]:
    """The clipped sums released at each step, noise off, every example in every batch (q = 1), lr 0."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(dataset, batch_size=len(dataset)), noise_multiplier=0.0, max_grad_norm=2.0,
        grad_sample_mode=mode, loss_reduction="sum",
    )  # fmt: skip
    scheduler = LambdaGradClip(optimizer, scheduler_function=lambda t: factors[t % len(factors)])
    releases = []
    optimizer.attach_step_hook(lambda opt: releases.append([p.grad.detach().clone() for p in opt.params]))
    for _ in factors:
        x, y = next(iter(loader))  # q = 1: one batch an epoch
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y, reduction="sum").backward()
        optimizer.step()
        scheduler.step()
    return releases


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_clip_schedule_clips_each_release_at_the_bound_in_force(mode):
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(6, 3, generator=generator, dtype=torch.float64)
    x[-1] *= 300.0  # an example whose gradient norm is far above every bound (squared error grows with x)
    y = torch.randn(6, 2, generator=generator, dtype=torch.float64)
    factors = [1.0, 0.15, 1.7, 0.02]  # C_t = 2 * factor
    with_all = _noiseless_releases(TensorDataset(x, y), mode, factors)
    without_last = _noiseless_releases(TensorDataset(x[:-1], y[:-1]), mode, factors)
    torch.manual_seed(3)
    reference_model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    for step, factor in enumerate(factors):
        bound = 2.0 * factor
        expected = _per_example_clipped_sum(reference_model, x, y, bound)
        for released, wanted in zip(with_all[step], expected):
            torch.testing.assert_close(released, wanted, rtol=1e-9, atol=1e-12)
        # Black box: removing one example moves the (noiseless) release by at most the C in force; this
        # example's gradient is far above it, so by exactly C.
        moved = math.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(with_all[step], without_last[step])))
        assert moved <= bound * (1 + 1e-9)
        assert moved == pytest.approx(bound, rel=1e-6)


def test_a_bandmf_run_takes_a_clip_schedule_and_its_epsilon_does_not_depend_on_c():
    settings = {"noise_mechanism": "bandmf", "num_bands": 2, "total_steps": 8, "accountant": "pld"}
    engine, model, optimizer, loader = _run(**settings)
    scheduler = StepGradClip(optimizer, step_size=2, gamma=0.5)
    _train(model, optimizer, iter(loader), steps=6, after_step=[scheduler])
    assert optimizer.max_grad_norm == pytest.approx(0.125)
    assert optimizer.noise.clip_norm_may_change is True
    fixed_engine, fixed_model, fixed_optimizer, fixed_loader = _run(**settings)
    _train(fixed_model, fixed_optimizer, iter(fixed_loader), steps=6)
    assert engine.get_epsilon(DELTA) == fixed_engine.get_epsilon(DELTA)


def test_a_per_layer_clip_schedule_splits_the_total_bound_over_the_groups():
    _engine, model, optimizer, loader = _run(clipping="per_layer", max_grad_norm=2.0)
    groups = optimizer.clipper.num_groups
    scheduler = ExponentialGradClip(optimizer, gamma=0.5)
    scheduler.step()
    assert optimizer.clipper.bounds == pytest.approx((1.0 / math.sqrt(groups),) * groups)
    assert optimizer.max_grad_norm == pytest.approx(1.0) and optimizer.clipper.sensitivity == pytest.approx(1.0)
    _train(model, optimizer, iter(loader), steps=1)


def test_a_scheduled_bound_survives_a_parameter_being_unfrozen():
    _engine, model, optimizer, loader = _run()
    first = next(model.parameters())
    first.requires_grad_(False)
    batches = iter(loader)
    _train(model, optimizer, batches, steps=1)
    optimizer.max_grad_norm = 0.25
    before = optimizer.clipper
    first.requires_grad_(True)  # the clipper is rebuilt over the new set at the next step
    _train(model, optimizer, batches, steps=1)
    assert optimizer.clipper is not before and len(optimizer.clipper.params) == len(before.params) + 1
    assert optimizer.clipper.bounds == (0.25,) and optimizer.max_grad_norm == 0.25


# ---------------------------------------------------------------------------------------------- refusals
def test_a_noise_schedule_with_bandmf_is_refused_before_anything_changes():
    _engine, _model, optimizer, _loader = _run(noise_mechanism="bandmf", num_bands=2, total_steps=8)
    scheduler = ExponentialNoise(optimizer, gamma=0.5)  # counter 0 keeps sigma: accepted
    with pytest.raises(ValueError, match="noise_multiplier cannot change.*correlated"):
        scheduler.step()
    assert optimizer.noise_multiplier == 1.0 and scheduler.last_epoch == 0


@pytest.mark.slow  # truncated sampling's make_private composes PLDs per group size (~10 s here)
def test_a_noise_schedule_under_truncated_sampling_is_refused():
    _engine, _model, optimizer, _loader = _run(max_batch_size=12, accountant="pld")
    with pytest.raises(ValueError, match="truncated sampling"):
        optimizer.noise_multiplier = 0.5
    assert optimizer.noise_multiplier == 1.0


def test_a_clip_schedule_with_adaptive_clipping_is_refused():
    _engine, _model, optimizer, _loader = _run(
        clipping="adaptive", target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0,
        min_clipbound=0.01, unclipped_num_std=5.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="adaptive clipping"):
        optimizer.max_grad_norm = 0.5


def test_changing_c_while_clipped_sums_wait_is_refused_and_changes_nothing():
    _engine, model, optimizer, loader = _run(mode="ghost")
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()  # ghost clipping has clipped at C = 1 already
    with pytest.raises(ValueError, match="clipped sums wait"):
        optimizer.max_grad_norm = 0.1
    assert optimizer.max_grad_norm == 1.0 and optimizer.clipper.bounds == (1.0,)
    optimizer.step()


@pytest.mark.parametrize("value, error", [(-1.0, ValueError), (float("nan"), ValueError), ("1", TypeError)])
def test_an_invalid_scheduled_value_is_refused(value, error):
    _engine, _model, optimizer, _loader = _run()
    with pytest.raises(error, match="noise_multiplier"):
        optimizer.noise_multiplier = value
    with pytest.raises(error, match="max_grad_norm"):
        optimizer.max_grad_norm = value
    assert optimizer.noise_multiplier == 1.0 and optimizer.max_grad_norm == 1.0


# ---------------------------------------------------------------------------------------------- checkpoints
def test_a_resume_in_the_middle_of_a_schedule_is_bit_identical_to_the_uninterrupted_run(tmp_path):
    def schedulers(optimizer):
        return StepNoise(optimizer, step_size=2, gamma=0.7), ExponentialGradClip(optimizer, gamma=0.8)

    engine, model, optimizer, loader = _run(mode="ghost", accountant="pld")
    noise, clip = schedulers(optimizer)
    batches = iter(loader)
    _train(model, optimizer, batches, steps=3, after_step=[noise, clip])
    path = tmp_path / "run.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer, data_loader=loader,
                           noise_scheduler=noise, grad_clip_scheduler=clip)  # fmt: skip
    _train(model, optimizer, batches, steps=3, after_step=[noise, clip])

    resumed = _run(mode="ghost", accountant="pld", seed=0)
    r_engine, r_model, r_optimizer, r_loader = resumed
    r_noise, r_clip = schedulers(r_optimizer)
    torch.manual_seed(12345)  # the global generator's state must not matter after a resume
    r_engine.load_checkpoint(path=path, module=r_model, optimizer=r_optimizer, data_loader=r_loader,
                             noise_scheduler=r_noise, grad_clip_scheduler=r_clip)  # fmt: skip
    assert (r_optimizer.noise_multiplier, r_optimizer.max_grad_norm) == (0.7, pytest.approx(0.8**3))
    _train(r_model, r_optimizer, iter(r_loader), steps=3, after_step=[r_noise, r_clip])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), r_model.parameters()))
    assert r_engine.accountant.history == engine.accountant.history
    assert (r_optimizer.noise_multiplier, r_optimizer.max_grad_norm) == (optimizer.noise_multiplier, optimizer.max_grad_norm)
    assert r_noise.state_dict() == noise.state_dict() and r_clip.state_dict() == clip.state_dict()


@pytest.mark.parametrize("accountant", ["rdp", pytest.param("pld", marks=pytest.mark.slow)])
def test_a_checkpoint_saved_at_another_sigma_resumes_and_is_accounted_at_both(tmp_path, accountant):
    engine, model, optimizer, loader = _run(accountant=accountant, noise_multiplier=1.0)
    batches = iter(loader)
    _train(model, optimizer, batches, steps=3)
    path = tmp_path / "run.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer, data_loader=loader)

    r_engine, r_model, r_optimizer, r_loader = _run(accountant=accountant, noise_multiplier=2.5)
    r_engine.load_checkpoint(path=path, module=r_model, optimizer=r_optimizer, data_loader=r_loader)
    assert r_optimizer.noise_multiplier == 2.5
    _train(r_model, r_optimizer, iter(r_loader), steps=2)
    expected = _dp_accounting_epsilon(accountant, _composed_event([1.0] * 3 + [2.5] * 2, BATCH_SIZE / NUM_EXAMPLES))
    assert r_engine.get_epsilon(DELTA) == pytest.approx(expected, rel=1e-9)
    assert r_engine.noise_plan.noise_multiplier == 2.5


@pytest.mark.slow  # as above
def test_a_truncated_run_saved_at_another_sigma_is_refused(tmp_path):
    engine, model, optimizer, loader = _run(max_batch_size=12, accountant="pld", noise_multiplier=1.0)
    _train(model, optimizer, iter(loader), steps=1)
    path = tmp_path / "run.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer, data_loader=loader)
    r_engine, r_model, r_optimizer, r_loader = _run(max_batch_size=12, accountant="pld", noise_multiplier=1.5)
    with pytest.raises(Exception, match="noise_multiplier"):
        r_engine.load_checkpoint(path=path, module=r_model, optimizer=r_optimizer, data_loader=r_loader)
    assert r_engine.accountant.steps == 0 and r_optimizer.noise_multiplier == 1.5


def test_a_scheduler_state_is_plain_data_that_loads_with_weights_only(tmp_path):
    _engine, _model, optimizer, _loader = _run()
    scheduler = LambdaNoise(optimizer, noise_lambda=lambda t: 1.0 + t)
    scheduler.step()
    torch.save(scheduler.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    assert state == {"last_epoch": 1, "base_noise_multiplier": 1.0}
    with pytest.raises(ValueError, match="not plain data"):
        scheduler.load_state_dict({"noise_lambda": print})


def test_a_subclass_of_the_base_scheduler_sets_what_it_computes():
    class Halving(NoiseScheduler):
        def get_noise_multiplier(self):
            return 4.0 / 2**self.last_epoch

    _engine, _model, optimizer, _loader = _run()
    scheduler = Halving(optimizer)
    assert optimizer.noise_multiplier == 4.0
    scheduler.step()
    assert optimizer.noise_multiplier == 2.0 and scheduler.state_dict() == {"last_epoch": 1}


# ---------------------------------------------------------------------------------------------- Opacus's names
def _opacus_run():
    from privacy_engine.opacus import PrivacyEngine as OpacusPrivacyEngine

    model = nn.Linear(10, 10)
    engine = OpacusPrivacyEngine()
    return engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(torch.randn(100, 10)), batch_size=10), noise_multiplier=1.0,
        max_grad_norm=1.0,
    )  # fmt: skip


def test_opacus_noise_schedulers_set_what_opacus_sets():
    from privacy_engine.opacus.schedulers import ExponentialNoise as OExp
    from privacy_engine.opacus.schedulers import LambdaNoise as OLambda
    from privacy_engine.opacus.schedulers import StepNoise as OStep

    _, optimizer, _ = _opacus_run()
    scheduler = OExp(optimizer, gamma=0.99)
    assert optimizer.noise_multiplier == 1.0
    scheduler.step()
    assert optimizer.noise_multiplier == 0.99
    _, optimizer, _ = _opacus_run()
    scheduler = OStep(optimizer, step_size=2, gamma=0.1)
    seen = [optimizer.noise_multiplier]
    for _ in range(4):
        scheduler.step()
        seen.append(optimizer.noise_multiplier)
    assert seen == [1.0, 1.0, 0.1, 0.1, 0.1**2]
    _, optimizer, _ = _opacus_run()
    scheduler = OLambda(optimizer, noise_lambda=lambda epoch: 1 - epoch / 10)
    scheduler.step()
    assert optimizer.noise_multiplier == 0.9


def test_opacus_grad_clip_schedulers_set_what_opacus_sets():
    from privacy_engine.opacus.schedulers import ExponentialGradClip as OExp
    from privacy_engine.opacus.schedulers import LambdaGradClip as OLambda
    from privacy_engine.opacus.schedulers import StepGradClip as OStep
    from privacy_engine.opacus.schedulers import _GradClipScheduler, _NoiseScheduler

    _, optimizer, _ = _opacus_run()
    scheduler = OExp(optimizer, gamma=0.99)
    assert optimizer.max_grad_norm == 1.0
    scheduler.step()
    assert optimizer.max_grad_norm == 0.99 and optimizer.clipper.bounds == (0.99,)
    _, optimizer, _ = _opacus_run()
    scheduler = OStep(optimizer, step_size=2, gamma=0.1)
    seen = [optimizer.max_grad_norm]
    for _ in range(4):
        scheduler.step()
        seen.append(optimizer.max_grad_norm)
    assert seen == [1.0, 1.0, 0.1, 0.1, 0.1**2]
    _, optimizer, _ = _opacus_run()
    scheduler = OLambda(optimizer, scheduler_function=lambda epoch: 1 - epoch / 10)
    scheduler.step()
    assert optimizer.max_grad_norm == 0.9
    with pytest.raises(ValueError, match="max_grad_norm"):
        OExp(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), gamma=0.5)  # not a DPOptimizer
    assert issubclass(OExp, _GradClipScheduler) and not issubclass(OExp, _NoiseScheduler)


def test_opacus_module_paths_of_the_schedulers_import():
    from privacy_engine.opacus.schedulers.grad_clip_scheduler import StepGradClip as A
    from privacy_engine.opacus.schedulers.noise_scheduler import StepNoise as B

    assert A is StepGradClip and B is StepNoise
