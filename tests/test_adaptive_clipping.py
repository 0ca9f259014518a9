"""Adaptive clipping (Andrew et al. 2021): the clip norm tracks a quantile, the pair (gradient, count) is
accounted as one DP-SGD step at sigma, and it works with both clipping paths, micro-batches and checkpoints."""

from __future__ import annotations

import copy
import importlib
import itertools
import math
import sys
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import PrivacyEngine
from privacy_engine.clipping import AdaptiveClippingOptions, PerSampleGradientClipper, gradient_noise_multiplier
from privacy_engine.noise import BandMFNoise, GaussianNoise
from privacy_engine.training.optimizer import DPOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tutorials"))


def _options(**overrides: float) -> AdaptiveClippingOptions:
    settings = {
        "target_unclipped_quantile": 0.5,
        "clipbound_learning_rate": 0.2,
        "max_clipbound": 100.0,
        "min_clipbound": 1e-3,
        "unclipped_num_std": 0.0,
    }
    settings.update(overrides)
    return AdaptiveClippingOptions(**settings)


def _bare_optimizer(dim: int = 4, *, batch: int = 100, sigma: float = 0.0, seed: int = 0, bandmf: bool = False,
                    rescale: bool = False, **overrides: float):  # fmt: skip
    """A DPOptimizer over one parameter whose per-sample gradients the test sets by hand (lr 0: the parameter
    keeps still, so every step's gradients are the test's). ``bandmf``: BandMF noise (``_BANDS``, seeded);
    ``rescale``: the clipped gradients divided by the clip norm in force (``rescale_to_unit_norm``)."""
    param = nn.Parameter(torch.zeros(dim, dtype=torch.float64))
    noise = None
    if bandmf:  # a given mechanism takes the seed; the count's generator's seed comes from torch's
        noise = BandMFNoise(_BANDS, seed=seed)
        torch.manual_seed(seed)
    clipper = PerSampleGradientClipper([param], 1.0, rescale_to_unit_norm=True) if rescale else None
    optimizer = DPOptimizer(torch.optim.SGD([param], lr=0.0), noise_multiplier=sigma, max_grad_norm=1.0,
                            expected_batch_size=batch, adaptive_clipping=_options(**overrides),
                            noise_seed=None if bandmf else seed, noise=noise, clipper=clipper)  # fmt: skip
    return param, optimizer


_BANDS = (1.0, -0.6, 0.3, 0.1)  # a 4-banded strategy (any positive c_0 works)


def _gradients_with_norms(norms: torch.Tensor, dim: int, generator: torch.Generator) -> torch.Tensor:
    directions = torch.randn(len(norms), dim, dtype=torch.float64, generator=generator)
    return directions / directions.norm(dim=1, keepdim=True) * norms[:, None]


def _release(param: nn.Parameter, optimizer: DPOptimizer, grad_sample: torch.Tensor) -> torch.Tensor:
    """One released step on ``grad_sample``; the released sum (the .grad times the divisor)."""
    param.grad_sample = grad_sample.clone()
    optimizer.step()
    released = param.grad.detach().clone() * optimizer.expected_batch_size
    optimizer.zero_grad()
    return released


# ---------------------------------------------------------------------------------------------- the update
@pytest.mark.parametrize("quantile", [0.3, 0.5, 0.8])
def test_clip_norm_converges_to_the_target_quantile(quantile):
    generator = torch.Generator().manual_seed(1)
    distribution = torch.distributions.LogNormal(0.0, 0.75)
    reference = float(np.quantile(distribution.sample((200_000,)).numpy(), quantile))
    param, optimizer = _bare_optimizer(target_unclipped_quantile=quantile, clipbound_learning_rate=0.2)
    trajectory = []
    torch.manual_seed(2)
    for _ in range(400):
        norms = distribution.sample((100,)).to(torch.float64)
        _release(param, optimizer, _gradients_with_norms(norms, 4, generator))
        trajectory.append(optimizer.clipper.bounds[0])
    settled = float(np.mean(trajectory[-150:]))
    assert settled == pytest.approx(reference, rel=0.05), (settled, reference)


def test_sigma_delta_makes_the_pair_one_gaussian_step_at_sigma():
    for sigma, sigma_b, groups in [(1.0, 2.0, 1), (0.7, 5.0, 1), (1.3, 10.0, 4)]:
        sigma_delta = gradient_noise_multiplier(sigma, sigma_b, num_groups=groups)
        assert sigma_delta > sigma
        assert sigma_delta**-2 + groups * (2 * sigma_b) ** -2 == pytest.approx(sigma**-2, rel=1e-12)
    assert gradient_noise_multiplier(1.0, 2.0) == pytest.approx((1 - 1 / 16) ** -0.5, rel=1e-15)
    assert gradient_noise_multiplier(0.0, 0.0) == 0.0  # no noise anywhere


@pytest.mark.parametrize("sigma, sigma_b, groups", [(1.0, 0.5, 1), (1.0, 0.4, 1), (1.0, 0.0, 1), (1.0, 1.0, 4)])
def test_a_count_noise_too_small_for_sigma_is_refused(sigma, sigma_b, groups):
    with pytest.raises(ValueError, match="unclipped_num_std"):
        gradient_noise_multiplier(sigma, sigma_b, num_groups=groups)


def test_the_optimizer_refuses_a_count_noise_too_small_for_sigma():
    with pytest.raises(ValueError, match="unclipped_num_std"):
        _bare_optimizer(sigma=1.0, unclipped_num_std=0.5)


def test_the_gradient_is_noised_at_sigma_delta_times_the_clip_norm_in_force():
    dim, batch = 20_000, 10
    param, optimizer = _bare_optimizer(dim, batch=batch, sigma=1.0, unclipped_num_std=2.0, seed=3)
    clip_norm = optimizer.clipper.bounds[0]
    released = _release(param, optimizer, torch.zeros(batch, dim, dtype=torch.float64))
    expected = gradient_noise_multiplier(1.0, 2.0) * clip_norm
    assert float(released.std()) == pytest.approx(expected, rel=0.03)
    assert optimizer.noise_multiplier == 1.0  # what the accountant records


# ---------------------------------------------------------------------------------------------- normalised release
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_rescaled_release_is_each_clipped_gradient_divided_by_the_clip_norm_in_force(clipping):
    """rescale_to_unit_norm: against a float64 per-example loop over steps whose clip norms move, the released
    sum is sum_i clip(g_i, C_t) / ||C_t|| (per layer: each slice clipped at its own C_{t,g}, all divided by
    the total bound in force) and the next norms follow the geometric update of the centred counts."""
    eta, gamma, batch, steps = 0.4, 0.5, 9, 6
    generator = torch.Generator().manual_seed(11)
    params = [nn.Parameter(torch.zeros(3, dtype=torch.float64)), nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))]
    initial = [1.0] if clipping == "flat" else [1.0, 0.5]
    clipper = PerSampleGradientClipper(params, initial[0] if clipping == "flat" else initial, clipping=clipping,
                                       rescale_to_unit_norm=True)  # fmt: skip
    optimizer = DPOptimizer(torch.optim.SGD(params, lr=0.0), noise_multiplier=0.0, max_grad_norm=clipper.config.max_grad_norm,
                            expected_batch_size=batch, clipping=clipping, clipper=clipper, noise_seed=0,
                            adaptive_clipping=_options(clipbound_learning_rate=eta, target_unclipped_quantile=gamma))  # fmt: skip
    groups = [[0, 1]] if clipping == "flat" else [[0], [1]]
    clip_norms = list(initial)
    for step in range(steps):
        assert optimizer.clipper.bounds == pytest.approx(tuple(clip_norms), rel=1e-12)
        scale = math.exp(step / 3 - 1)  # the norms' scale drifts, so the clip norms move both ways
        per_sample = [torch.randn(batch, *p.shape, dtype=torch.float64, generator=generator) * scale for p in params]
        expected = [torch.zeros_like(p) for p in params]
        counts = [0.0] * len(groups)
        total_bound = math.sqrt(sum(c * c for c in clip_norms))
        for i in range(batch):
            for g, members in enumerate(groups):
                norm = math.sqrt(sum(float(per_sample[k][i].pow(2).sum()) for k in members))
                factor = min(1.0, clip_norms[g] / norm) / total_bound
                counts[g] += (1.0 if norm <= clip_norms[g] else 0.0) - 0.5
                for k in members:
                    expected[k] += factor * per_sample[k][i]
        for param, grads in zip(params, per_sample):
            param.grad_sample = grads.clone()
        optimizer.step()
        for param, reference in zip(params, expected):
            torch.testing.assert_close(param.grad * batch, reference, rtol=1e-12, atol=1e-14)
        optimizer.zero_grad()
        clip_norms = [
            min(max(c * math.exp(-eta * (n / batch + 0.5 - gamma)), 1e-3), 100.0) for c, n in zip(clip_norms, counts)
        ]
    assert optimizer.clipper.bounds == pytest.approx(tuple(clip_norms), rel=1e-12)
    assert len({round(c, 12) for c in clip_norms}) == len(clip_norms) and clip_norms != initial


def test_rescaled_noise_is_sigma_delta_whatever_the_clip_norm():
    """rescale_to_unit_norm: the sensitivity is 1, so the noise std is sigma_delta at every step, while the
    clip norm in force moves (zero gradients: every example unclipped, the norm shrinks)."""
    dim, batch = 20_000, 10
    param, optimizer = _bare_optimizer(dim, batch=batch, sigma=1.0, unclipped_num_std=2.0, seed=3, rescale=True,
                                       clipbound_learning_rate=1.0)  # fmt: skip
    norms_in_force = []
    for _ in range(3):
        norms_in_force.append(optimizer.clipper.bounds[0])
        released = _release(param, optimizer, torch.zeros(batch, dim, dtype=torch.float64))
        assert float(released.std()) == pytest.approx(gradient_noise_multiplier(1.0, 2.0), rel=0.03)
    assert norms_in_force[2] < 0.5 * norms_in_force[0]
    assert optimizer.clipper.sensitivity == 1.0 and optimizer.noise_multiplier == 1.0


# ---------------------------------------------------------------------------------------------- accounting
@pytest.mark.parametrize("rescale", [False, True])
def test_epsilon_equals_dp_accountings_dpsgd_at_sigma(rescale):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 6), torch.randint(0, 2, (256,)))
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))
    engine = PrivacyEngine(accountant="rdp")
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=32),
        noise_multiplier=1.1, max_grad_norm=1.0, clipping="adaptive", target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2, max_clipbound=10.0, min_clipbound=0.01, unclipped_num_std=1.6, noise_seed=0,
        rescale_to_unit_norm=rescale,
    )  # fmt: skip
    steps = 0
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()
        steps += 1
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(32 / 256, dp_accounting.GaussianDpEvent(1.1)), steps)
    assert engine.get_epsilon(1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("rescale", [False, True])
def test_removing_one_example_moves_the_sum_by_at_most_c_and_the_count_by_one_half(rescale):
    """Black box: the released sum moves by at most the clip norm in force (1 when rescaled to unit norm)."""
    generator = torch.Generator().manual_seed(4)
    norms = torch.tensor([0.2, 0.7, 1.0, 1.5, 3.0, 40.0, 0.0, 0.99], dtype=torch.float64)
    grads = _gradients_with_norms(norms, 5, generator)
    grads[6] = 0.0
    eta, gamma, batch = 0.2, 0.5, 8

    def release(rows):
        param, optimizer = _bare_optimizer(5, batch=batch, max_clipbound=1000.0, min_clipbound=1e-6, rescale=rescale)
        clip_norm = optimizer.clipper.bounds[0]
        released = _release(param, optimizer, grads[rows])
        after = optimizer.clipper.bounds[0]
        # The released count, from the update C' = C exp(-eta (count / m + 1/2 - gamma)) (noise off).
        count = (-math.log(after / clip_norm) / eta - 0.5 + gamma) * batch
        return released, count, clip_norm

    released, count, clip_norm = release(list(range(len(norms))))
    for removed in range(len(norms)):
        kept = [i for i in range(len(norms)) if i != removed]
        neighbour, neighbour_count, _ = release(kept)
        assert float((released - neighbour).norm()) <= (1.0 if rescale else clip_norm) * (1 + 1e-12)
        assert abs(count - neighbour_count) == pytest.approx(0.5, abs=1e-9)


# ---------------------------------------------------------------------------------------------- paths
def _train(grad_sample_mode: str, clipping: str = "adaptive", steps: int = 6, rescale: bool = False):
    torch.manual_seed(5)
    data = TensorDataset(torch.randn(128, 6, dtype=torch.float64), torch.randint(0, 3, (128,)))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    engine = PrivacyEngine()
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=DataLoader(data, batch_size=16),
        noise_multiplier=1.0, max_grad_norm=0.05 if clipping == "adaptive" else [0.03, 0.04], clipping=clipping,
        target_unclipped_quantile=0.6, clipbound_learning_rate=0.5, max_clipbound=10.0, min_clipbound=0.001,
        unclipped_num_std=4.0, noise_seed=7, grad_sample_mode=grad_sample_mode, rescale_to_unit_norm=rescale,
    )  # fmt: skip
    trajectory = []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()
        trajectory.append(optimizer.clipper.bounds)
    return trajectory, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("clipping", ["adaptive", "per_layer_adaptive"])
def test_hooks_and_ghost_follow_the_same_clip_norms_and_updates(clipping, rescale):
    hooks_norms, hooks_params = _train("hooks", clipping, rescale=rescale)
    ghost_norms, ghost_params = _train("ghost", clipping, rescale=rescale)
    assert len(hooks_norms) == 6 and len(set(hooks_norms)) > 1  # the clip norm moved
    np.testing.assert_allclose(np.array(hooks_norms), np.array(ghost_norms), rtol=1e-12)
    for a, b in zip(hooks_params, ghost_params):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_micro_batches_of_one_logical_batch_equal_the_whole_batch():
    generator = torch.Generator().manual_seed(8)
    norms = torch.distributions.LogNormal(0.0, 1.0).sample((12,)).to(torch.float64)
    grads = _gradients_with_norms(norms, 3, generator)
    whole_param, whole = _bare_optimizer(3, batch=12, sigma=1.0, unclipped_num_std=3.0, seed=9)
    released_whole = _release(whole_param, whole, grads)
    split_param, split = _bare_optimizer(3, batch=12, sigma=1.0, unclipped_num_std=3.0, seed=9)
    for part, last in ((grads[:5], False), (grads[5:], True)):
        split_param.grad_sample = part.clone()
        split.signal_skip_step(do_skip=not last)
        split.step()
    released_split = split_param.grad.detach().clone() * 12
    assert split.clipper.bounds == whole.clipper.bounds
    torch.testing.assert_close(released_split, released_whole, rtol=1e-14, atol=1e-14)


def test_a_checkpoint_resumes_bit_identically_even_between_micro_batches():
    generator = torch.Generator().manual_seed(10)
    batches = [_gradients_with_norms(torch.rand(8, dtype=torch.float64) * 3, 3, generator) for _ in range(6)]

    def run(param, optimizer, indices, save_at=None):
        out = []
        for index in indices:
            param.grad_sample = batches[index][:4].clone()
            optimizer.signal_skip_step(do_skip=True)
            optimizer.step()
            if index == save_at:
                return out, copy.deepcopy(optimizer.state_dict())  # saved between micro-batches
            param.grad_sample = batches[index][4:].clone()
            optimizer.step()
            out.append((optimizer.clipper.bounds, param.grad.detach().clone()))
        return out, None

    param, optimizer = _bare_optimizer(3, batch=8, sigma=1.0, unclipped_num_std=2.0, seed=11)
    straight, _ = run(param, optimizer, range(6))
    param, optimizer = _bare_optimizer(3, batch=8, sigma=1.0, unclipped_num_std=2.0, seed=11)
    first, saved = run(param, optimizer, range(6), save_at=3)
    resumed_param, resumed = _bare_optimizer(3, batch=8, sigma=1.0, unclipped_num_std=2.0, seed=99)
    resumed.load_state_dict(saved)
    resumed_param.grad_sample = batches[3][4:].clone()
    resumed.step()
    rest = [(resumed.clipper.bounds, resumed_param.grad.detach().clone())]
    more, _ = run(resumed_param, resumed, [4, 5])
    for (norms_a, grad_a), (norms_b, grad_b) in zip(straight, first + rest + more, strict=True):
        assert norms_a == norms_b
        assert torch.equal(grad_a, grad_b)


def test_a_checkpoint_with_other_adaptive_options_is_refused():
    _, optimizer = _bare_optimizer(3, sigma=1.0, unclipped_num_std=2.0)
    _, other = _bare_optimizer(3, sigma=1.0, unclipped_num_std=3.0)
    with pytest.raises(ValueError, match="adaptive clipping"):
        other.load_state_dict(optimizer.state_dict())


# ---------------------------------------------------------------------------------------------- BandMF
@pytest.mark.parametrize("rescale", [False, True])
def test_bandmf_rows_are_the_fixed_runs_unit_rows_times_sigma_delta_and_the_clip_norm_in_force(rescale):
    """Noise only (zero gradients): the released row t is sigma_delta * C_t * u_t (rescaled to unit norm:
    sigma_delta * u_t, the sensitivity staying 1), with u_t the unit row of a fixed-C BandMF run of the same
    seed (the history stays in one scale; the count's draws do not touch it)."""
    dim, batch, steps = 50, 10, 9
    param, adaptive = _bare_optimizer(dim, batch=batch, sigma=1.0, unclipped_num_std=2.0, seed=4, bandmf=True,
                                      target_unclipped_quantile=0.3, clipbound_learning_rate=0.5,
                                      rescale=rescale)  # fmt: skip
    sigma_delta = adaptive.gradient_noise_multiplier
    assert adaptive.noise.clip_norm_may_change
    fixed_param = nn.Parameter(torch.zeros(dim, dtype=torch.float64))
    fixed = DPOptimizer(torch.optim.SGD([fixed_param], lr=0.0), noise_multiplier=sigma_delta, max_grad_norm=2.5,
                        expected_batch_size=batch, noise=BandMFNoise(_BANDS, seed=4))  # fmt: skip
    assert not fixed.noise.clip_norm_may_change
    norms_in_force = []
    for _ in range(steps):
        clip_norm = adaptive.clipper.bounds[0]
        norms_in_force.append(clip_norm)
        released = _release(param, adaptive, torch.zeros(batch, dim, dtype=torch.float64))
        reference = _release(fixed_param, fixed, torch.zeros(batch, dim, dtype=torch.float64))
        scale = 1.0 if rescale else clip_norm
        torch.testing.assert_close(released / (sigma_delta * scale), reference / (sigma_delta * 2.5),
                                   rtol=1e-12, atol=1e-12)  # fmt: skip
    assert len(set(norms_in_force)) == steps  # the clip norm moved at every step (all examples unclipped)


def test_bandmf_with_a_fixed_clip_norm_adds_the_same_bits_with_the_switch_on_and_refuses_a_change_off():
    def run(switch, scales, prefetch=False):
        noise = BandMFNoise(_BANDS, seed=6, column_normalize_for_steps=len(scales), prefetch=prefetch)
        noise.clip_norm_may_change = switch
        out = []
        for scale in scales:
            tensors = [torch.zeros(7), torch.zeros(2, 3, dtype=torch.float64)]
            noise.add_noise_(tensors, 1.3, scale)
            out.append(tensors)
        return noise, out

    _, off = run(False, [0.7] * 6)
    _, on = run(True, [0.7] * 6)
    for a, b in zip(off, on, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # A changed clip norm: the same unit rows (column normalisation's row scales included), rescaled.
    _, changed = run(True, [0.7, 1.4, 0.35, 0.0, 0.7, 2.1])
    _, drawn_ahead = run(True, [0.7, 1.4, 0.35, 0.0, 0.7, 2.1], prefetch=True)  # the next draw made in the background
    for a, b in zip(changed, drawn_ahead, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for a, b, scale in zip(off, changed, [0.7, 1.4, 0.35, 0.0, 0.7, 2.1], strict=True):
        torch.testing.assert_close(b[1], a[1] * (scale / 0.7), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(b[0], a[0] * (scale / 0.7), rtol=1e-5, atol=1e-7)  # float32
    noise, _ = run(False, [0.7])
    with pytest.raises(ValueError, match="same noise_multiplier"):
        noise.add_noise_([torch.zeros(7), torch.zeros(2, 3, dtype=torch.float64)], 1.3, 1.4)
    assert noise.step == 1
    zero, _ = run(True, [0.0])  # a first step without noise fixes no scale to rescale from
    with pytest.raises(ValueError, match="same noise_multiplier"):
        zero.add_noise_([torch.zeros(7), torch.zeros(2, 3, dtype=torch.float64)], 1.3, 1.4)


def _bandmf_engine(grad_sample_mode="hooks", accountant="rdp", clipping="adaptive"):
    torch.manual_seed(5)
    data = TensorDataset(torch.randn(96, 6, dtype=torch.float64), torch.randint(0, 3, (96,)))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    engine = PrivacyEngine(accountant=accountant)
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=1.0, max_grad_norm=0.05 if clipping == "adaptive" else [0.03, 0.04], clipping=clipping,
        target_unclipped_quantile=0.6, clipbound_learning_rate=0.5, max_clipbound=10.0, min_clipbound=0.001,
        unclipped_num_std=4.0, noise_seed=7, grad_sample_mode=grad_sample_mode, noise_mechanism="bandmf",
        num_bands=3, total_steps=24,
    )  # fmt: skip
    return engine, model, module, optimizer, loader


def _steps(module, optimizer, batches, count):
    trajectory = []
    for step, (x, y) in enumerate(batches):
        if step == count:
            break
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()
        trajectory.append(optimizer.clipper.bounds)
    return trajectory


@pytest.mark.parametrize("clipping", ["adaptive", "per_layer_adaptive"])
def test_bandmf_with_adaptive_clipping_trains_alike_in_hooks_and_ghost_and_costs_bandmfs_event_at_sigma(clipping):
    results = {}
    for mode in ("hooks", "ghost"):
        engine, model, module, optimizer, loader = _bandmf_engine(mode, clipping=clipping)
        assert type(optimizer.noise).__name__ == "BandMFNoise" and optimizer.num_bands == 3
        trajectory = _steps(module, optimizer, itertools.chain(loader, loader), 24)  # two epochs
        results[mode] = (trajectory, [p.detach().clone() for p in model.parameters()], engine.get_epsilon(1e-5))
        steps, sample_rate = engine.accountant.steps, loader.sample_rate
    (hooks_norms, hooks_params, hooks_eps), (ghost_norms, ghost_params, ghost_eps) = results["hooks"], results["ghost"]
    assert len(hooks_norms) == 24 and len(set(hooks_norms)) > 1  # the clip norm moved
    np.testing.assert_allclose(np.array(hooks_norms), np.array(ghost_norms), rtol=1e-12)
    for a, b in zip(hooks_params, ghost_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # One BandMF event at sigma (not sigma_delta): ceil(steps / b) participations of a Poisson-sampled Gaussian.
    assert steps == 24 and sample_rate == pytest.approx(3 * 8 / 96)
    reference = dp_accounting.rdp.RdpAccountant()
    reference.compose(dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(1.0)), 8)
    assert hooks_eps == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9) and ghost_eps == hooks_eps


def test_bandmf_with_adaptive_clipping_resumes_bit_identically_from_a_checkpoint(tmp_path):
    engine, model, module, optimizer, loader = _bandmf_engine()
    batches = iter(loader)
    _steps(module, optimizer, [next(batches) for _ in range(5)], 5)
    engine.save_checkpoint(path=tmp_path / "run.pt", module=module, optimizer=optimizer, data_loader=loader)
    straight = _steps(module, optimizer, batches, 7)  # the rest of the epoch
    straight_params = [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(123)  # another initialisation and count seed: the checkpoint restores both
    resumed_engine, resumed_model, resumed_module, resumed_optimizer, resumed_loader = _bandmf_engine()
    resumed_engine.load_checkpoint(path=tmp_path / "run.pt", module=resumed_module, optimizer=resumed_optimizer,
                                   data_loader=resumed_loader)  # fmt: skip
    assert resumed_optimizer.noise.clip_norm_may_change
    resumed = _steps(resumed_module, resumed_optimizer, resumed_loader, 7)
    assert resumed == straight and len(set(straight)) > 1
    for a, b in zip(straight_params, resumed_model.parameters(), strict=True):
        assert torch.equal(a, b.detach())
    assert resumed_engine.get_epsilon(1e-5) == engine.get_epsilon(1e-5)


def test_a_bare_bandmf_optimizer_resumes_bit_identically_with_a_moving_clip_norm():
    generator = torch.Generator().manual_seed(12)
    batches = [_gradients_with_norms(torch.rand(8, dtype=torch.float64) * 3, 3, generator) for _ in range(8)]

    def run(param, optimizer, indices):
        return [(_release(param, optimizer, batches[i]), optimizer.clipper.bounds) for i in indices]

    param, optimizer = _bare_optimizer(3, batch=8, sigma=1.0, unclipped_num_std=2.0, seed=13, bandmf=True)
    straight = run(param, optimizer, range(8))
    param, optimizer = _bare_optimizer(3, batch=8, sigma=1.0, unclipped_num_std=2.0, seed=13, bandmf=True)
    first = run(param, optimizer, range(3))
    saved = copy.deepcopy(optimizer.state_dict())
    resumed_param, resumed = _bare_optimizer(3, batch=8, sigma=1.0, unclipped_num_std=2.0, seed=99, bandmf=True)
    resumed.load_state_dict(saved)
    assert resumed.noise.clip_norm_may_change
    rest = run(resumed_param, resumed, range(3, 8))
    assert len({norms for _, norms in straight}) == 8
    for (grad_a, norms_a), (grad_b, norms_b) in zip(straight, first + rest, strict=True):
        assert norms_a == norms_b and torch.equal(grad_a, grad_b)


@pytest.mark.parametrize("point", ["history_written", "counters_computed"])
def test_a_failed_bandmf_commit_changes_nothing_and_the_run_goes_on_as_a_clean_one(monkeypatch, point):
    from privacy_engine.noise import mechanism

    generator = torch.Generator().manual_seed(14)
    batches = [_gradients_with_norms(torch.rand(8, dtype=torch.float64) * 3, 3, generator) for _ in range(6)]
    param, clean = _bare_optimizer(3, batch=8, sigma=1.0, unclipped_num_std=2.0, seed=15, bandmf=True)
    expected = [(_release(param, clean, b), clean.clipper.bounds) for b in batches]
    param, optimizer = _bare_optimizer(3, batch=8, sigma=1.0, unclipped_num_std=2.0, seed=15, bandmf=True)
    got = [(_release(param, optimizer, b), optimizer.clipper.bounds) for b in batches[:3]]

    def fail(name):
        if name == point:
            raise RuntimeError("injected")

    monkeypatch.setattr(mechanism, "_commit_point", fail)
    bounds = optimizer.clipper.bounds
    with pytest.raises(RuntimeError, match="injected"):
        _release(param, optimizer, batches[3])
    assert optimizer.clipper.bounds == bounds and optimizer.noise.step == 3 and optimizer.steps_taken == 3
    monkeypatch.undo()
    optimizer.zero_grad()
    got += [(_release(param, optimizer, b), optimizer.clipper.bounds) for b in batches[3:]]
    for (grad_a, norms_a), (grad_b, norms_b) in zip(expected, got, strict=True):
        assert norms_a == norms_b and torch.equal(grad_a, grad_b)


def test_a_correlated_mechanism_without_the_clip_norm_switch_is_refused():
    from accountants.events import EventSpec

    class Correlated(GaussianNoise):
        def privacy_event(self) -> EventSpec:
            return EventSpec(num_bands=3)

    param = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="clip_norm_may_change"):
        DPOptimizer(torch.optim.SGD([param], lr=0.0), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4,
                    adaptive_clipping=_options(unclipped_num_std=2.0), noise=Correlated(seed=0))  # fmt: skip


# ---------------------------------------------------------------------------------------------- options
_VALID = {
    "target_unclipped_quantile": 0.5,
    "clipbound_learning_rate": 0.2,
    "max_clipbound": 10.0,
    "min_clipbound": 0.01,
    "unclipped_num_std": 2.0,
}


@pytest.mark.parametrize(
    "name, value",
    [("target_unclipped_quantile", 1.5), ("target_unclipped_quantile", -0.1), ("clipbound_learning_rate", -1.0),
     ("clipbound_learning_rate", math.inf), ("max_clipbound", math.inf), ("min_clipbound", -1.0),
     ("max_clipbound", 0.005), ("unclipped_num_std", -1.0), ("unclipped_num_std", math.nan)],
)  # fmt: skip
def test_invalid_options_are_refused_naming_the_argument(name, value):
    with pytest.raises(ValueError, match=name):
        AdaptiveClippingOptions(**{**_VALID, name: value})


def test_make_private_refuses_missing_options_misplaced_options_and_an_initial_norm_out_of_range():
    model = nn.Linear(3, 2)
    loader = DataLoader(TensorDataset(torch.randn(20, 3), torch.randint(0, 2, (20,))), batch_size=5)

    def make(**settings):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=loader, noise_multiplier=1.0, **settings)  # fmt: skip

    with pytest.raises(ValueError, match="unclipped_num_std"):
        make(max_grad_norm=1.0, clipping="adaptive", **{k: v for k, v in _VALID.items() if k != "unclipped_num_std"})
    with pytest.raises(ValueError, match="target_unclipped_quantile"):
        make(max_grad_norm=1.0, clipping="flat", target_unclipped_quantile=0.5)
    with pytest.raises(ValueError, match="max_grad_norm"):
        make(max_grad_norm=20.0, clipping="adaptive", **_VALID)
    with pytest.raises(ValueError, match="unclipped_num_std"):
        make(max_grad_norm=1.0, clipping="adaptive", **{**_VALID, "unclipped_num_std": 0.5})


# ---------------------------------------------------------------------------------------------- Opacus
def test_the_opacus_adaclip_optimizer_trains():
    from privacy_engine.opacus import PrivacyEngine as OpacusEngine
    from privacy_engine.opacus.optimizers import AdaClipDPOptimizer, get_optimizer_class

    assert get_optimizer_class("adaptive", distributed=False) is AdaClipDPOptimizer
    torch.manual_seed(13)
    data = TensorDataset(torch.randn(128, 4), torch.randint(0, 2, (128,)))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    engine = OpacusEngine()
    module, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=16),
        noise_multiplier=1.0, max_grad_norm=1.0, clipping="adaptive", **_VALID,
    )  # fmt: skip
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()
    assert optimizer.clipper.bounds[0] != 1.0 and 0 < engine.get_epsilon(1e-5) < math.inf
    assert isinstance(optimizer, AdaClipDPOptimizer) and optimizer.max_grad_norm == optimizer.clipper.bounds[0]

    bare = nn.Parameter(torch.zeros(3))
    noiseless = AdaClipDPOptimizer(torch.optim.SGD([bare], lr=0.1), noise_multiplier=0.0, max_grad_norm=1.0,
                                   expected_batch_size=4, **{**_VALID, "unclipped_num_std": 0.0})  # fmt: skip
    bare.grad_sample = torch.full((4, 3), 10.0)  # every example clipped: the clip norm grows
    noiseless.step()
    assert noiseless.max_grad_norm == pytest.approx(math.exp(0.2 * 0.5))
    adaclip = AdaClipDPOptimizer(torch.optim.SGD([bare], lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                                 expected_batch_size=4, generator=torch.Generator().manual_seed(0), **_VALID)  # fmt: skip
    assert adaclip.noise_multiplier == 1.0  # recorded; the gradient's is sigma_delta
    assert adaclip.gradient_noise_multiplier == pytest.approx(gradient_noise_multiplier(1.0, 2.0))
    with pytest.raises(ValueError, match="unclipped_num_std"):
        AdaClipDPOptimizer(torch.optim.SGD([bare], lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                           expected_batch_size=4, **{**_VALID, "unclipped_num_std": 0.5})  # fmt: skip


# ---------------------------------------------------------------------------------------------- DDP
def _ddp_worker(rank: int, world_size: int, grads: torch.Tensor, noisy: bool, out: str,
                bandmf: bool = False) -> None:  # fmt: skip
    import torch.distributed as dist

    from privacy_engine.training import distributed

    # A file store (no probed port that another process could take in between), and a barrier before the
    # group is destroyed, so that no rank tears gloo down while the other still talks to it.
    dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=rank, world_size=world_size)
    try:
        sigma, sigma_b = (1.0, 3.0) if noisy else (0.0, 0.0)
        param, optimizer = _bare_optimizer(3, batch=len(grads), sigma=sigma, unclipped_num_std=sigma_b, seed=21,
                                           bandmf=bandmf)  # fmt: skip
        distributed.configure(optimizer, distributed.current_job(None, 60.0, "test"))
        half = len(grads) // 2
        trajectory, grads_released = [], []
        for _ in range(3):
            param.grad_sample = grads[rank * half : (rank + 1) * half].clone()
            optimizer.step()
            trajectory.append(optimizer.clipper.bounds)
            grads_released.append(param.grad.detach().clone())
            optimizer.zero_grad()
        torch.save({"trajectory": trajectory, "param": param.detach().clone(), "grads": grads_released},
                   f"{out}.{rank}")  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes (a few seconds each on 2 cores)
@pytest.mark.parametrize("noisy, bandmf", [(False, False), (True, False), (True, True)])
def test_ddp_releases_one_count_summed_over_the_ranks(tmp_path, noisy, bandmf):
    import torch.multiprocessing as mp

    generator = torch.Generator().manual_seed(20)
    grads = _gradients_with_norms(torch.rand(16, dtype=torch.float64, generator=generator) * 3, 3, generator)
    out = str(tmp_path / "result")
    mp.spawn(_ddp_worker, args=(2, grads, noisy, out, bandmf), nprocs=2, join=True)
    rank0, rank1 = (torch.load(f"{out}.{rank}") for rank in (0, 1))
    assert rank0["trajectory"] == rank1["trajectory"]  # one noised count, the same on every rank
    assert torch.equal(rank0["param"], rank1["param"])
    # The summed count is the union batch's count plus one noise draw (rank 0's): one process on all 16 rows
    # with the same seed follows the same clip norms (up to the order of a float64 sum).
    sigma, sigma_b = (1.0, 3.0) if noisy else (0.0, 0.0)
    param, optimizer = _bare_optimizer(3, batch=16, sigma=sigma, unclipped_num_std=sigma_b, seed=21, bandmf=bandmf)
    single, released = [], []
    for _ in range(3):
        released.append(_release(param, optimizer, grads) / 16)
        single.append(optimizer.clipper.bounds)
    np.testing.assert_allclose(np.array(single), np.array(rank0["trajectory"]), rtol=1e-12)
    if bandmf:  # rank 0's BandMF rows, rescaled by the same clip norms: what one process releases
        for a, b, c in zip(released, rank0["grads"], rank1["grads"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
            assert torch.equal(b, c)
    assert len({norms for norms in single}) == 3  # the clip norm moved at every step


def test_secure_mode_draws_the_count_noise_from_the_os_and_never_saves_its_state():
    def make():
        param = nn.Parameter(torch.zeros(3, dtype=torch.float64))
        optimizer = DPOptimizer(torch.optim.SGD([param], lr=0.0), noise_multiplier=1.0, max_grad_norm=1.0,
                                expected_batch_size=4, adaptive_clipping=_options(unclipped_num_std=2.0),
                                secure_mode=True)  # fmt: skip
        return param, optimizer

    param, optimizer = make()
    _release(param, optimizer, torch.ones(4, 3, dtype=torch.float64))
    state = optimizer.state_dict()
    assert state["privacy_engine.dp_state"]["clipper"]["adaptive"]["generator"] is None
    _, resumed = make()
    resumed.load_state_dict(state)
    assert resumed.clipper.bounds == optimizer.clipper.bounds
    with pytest.raises(ValueError, match="secure"):
        DPOptimizer(torch.optim.SGD([param], lr=0.0), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4,
                    adaptive_clipping=_options(unclipped_num_std=2.0), secure_mode=True, noise_seed=1)  # fmt: skip


# ---------------------------------------------------------------------------------------------- the tutorial
@pytest.mark.slow
def test_the_adaptive_clipping_tutorial_runs_in_its_quick_mode(capsys):
    tutorial = importlib.import_module("adaptive_clipping_digits")
    summary = tutorial.main(["--quick"])
    row = summary[4.0]
    assert row["epsilon"] <= 4.0 + 1e-9  # both sides calibrated to the same target, not past it
    assert row["fixed C"] == 1.0 and row["fixed"] > 0.6 and row["adaptive from 0.1"] > 0.6  # chance: 0.1
    assert "worst gap" in capsys.readouterr().out
