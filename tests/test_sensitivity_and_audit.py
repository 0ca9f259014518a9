"""Black-box checks of what a step releases, over modes, clippings and loops.

- Sensitivity: remove one example, noise off: the released clipped sum moves by at most C.
- Canary audit: with noise on, the noise of each release has the promised scale (sigma * C, or for
  BandMF the strategy's fresh draws z_t = sum_j c_j x_{t-j} at sigma * C * ||c||), a canary moves the
  release by exactly its clipped contribution, and the empirical epsilon lower bound from a
  distinguishing test stays below the epsilon the accountant reports.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import beta
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import PrivacyEngine, VirtualSteps

CLIP = 1.0
N = 12


class TwoBranches(nn.Module):
    """Two layers reading the same input: two clipping groups for per-layer clipping."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.a = nn.Linear(features, 3)
        self.b = nn.Linear(features, 3)

    def forward(self, x):
        return torch.tanh(self.a(x)) * 1.5 + self.b(x)


def dataset(drop: int | None = None) -> TensorDataset:
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(N, 5, generator=generator, dtype=torch.float64) * 4
    y = torch.randint(0, 3, (N,), generator=generator)
    keep = [i for i in range(N) if i != drop]
    return TensorDataset(x[keep], y[keep])


def released_sum(mode, clipping, loop, drop):
    """The clipped sum one step releases (noise off), as (parameter change) * expected batch size / lr."""
    torch.manual_seed(0)
    model = TwoBranches(5).double()
    if loop == "unfreezing":
        model.b.weight.requires_grad_(False)
    data = dataset(drop)
    # q = 1: every example is in every batch, so removing one changes no other example's draw.
    loader = DataLoader(data, batch_size=len(data))
    engine = PrivacyEngine()
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader, noise_multiplier=0.0,
        max_grad_norm=CLIP, clipping=clipping, grad_sample_mode=mode, poisson_sampling=True,
    )  # fmt: skip
    wrapped, optimizer, private_loader = out
    private_loader.batch_sampler.steps = 2  # q = 1 gives one batch an epoch; the skipping loop needs two
    if loop == "unfreezing":
        model.b.weight.requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]

    def loss(x, y):
        return nn.functional.cross_entropy(wrapped(x), y)

    if loop == "virtual steps":
        with VirtualSteps(data_loader=private_loader, max_physical_batch_size=5, optimizer=optimizer) as batches:
            for x, y in batches:
                optimizer.zero_grad()
                loss(x, y).backward()
                optimizer.step()
                if not optimizer._in_logical_step:
                    break
    else:
        for index, (x, y) in enumerate(private_loader):
            if loop == "skip first batch" and index == 0:
                continue
            optimizer.zero_grad()
            if loop == "two backwards":
                for xs, ys in zip(x.split(7), y.split(7)):
                    loss(xs, ys).backward()
            else:
                loss(x, y).backward()
            optimizer.step()
            break
    scale = private_loader.expected_batch_size
    return torch.cat([(b - p.detach()).flatten() * scale for b, p in zip(before, model.parameters())])


@pytest.mark.parametrize("loop", ["plain", "two backwards", "virtual steps", "unfreezing", "skip first batch"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
def test_removing_one_example_moves_the_release_by_at_most_the_clip_norm(mode, clipping, loop):
    full = released_sum(mode, clipping, loop, drop=None)
    assert float(full.norm()) > 2 * CLIP  # several examples contribute: the test can fail
    for drop in (0, 7):
        fewer = released_sum(mode, clipping, loop, drop=drop)
        assert float((full - fewer).norm()) <= CLIP * (1 + 1e-6)


# ---------------------------------------------------------------------------------------------- audit
DIM = 4
CANARY = torch.tensor([3.0, -4.0, 0.0, 0.0], dtype=torch.float64)  # norm 5 > C: clipped to C
DIRECTION = CANARY / CANARY.norm()
SIGMA = 1.0


def mechanism_run(mechanism: str, canary: bool, steps: int, seed: int):
    """Releases (clipped sum + noise) of `steps` steps of a linear model whose only non-zero gradient is
    the canary's; returns (array (steps, params), engine)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(DIM, 1, bias=False), nn.Linear(1, 1, bias=False)).double()
    # a linear "loss" whose per-example gradient w.r.t. the first layer is x (second layer fixed to 1)
    with torch.no_grad():
        model[1].weight.fill_(1.0)
    model[1].weight.requires_grad_(False)
    x = torch.zeros(N, DIM, dtype=torch.float64)
    if canary:
        x[0] = CANARY
    loader = DataLoader(TensorDataset(x), batch_size=N if mechanism != "bandmf" else N // 2)
    kwargs = {}
    mode, clipping = "hooks", "flat"
    if mechanism == "ghost":
        mode = "ghost"
    if mechanism == "per-layer":
        clipping = "per_layer"
    if mechanism == "truncated":
        kwargs = {"max_batch_size": N}
    if mechanism == "bandmf":
        kwargs = {"noise_mechanism": "bandmf", "num_bands": 2, "total_steps": steps}
    engine = PrivacyEngine()
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD([model[0].weight], lr=1.0), data_loader=loader,
        noise_multiplier=SIGMA, max_grad_norm=CLIP, clipping=clipping, grad_sample_mode=mode, loss_reduction="sum",
        noise_seed=seed, noise_generator=None, **kwargs,
    )  # fmt: skip
    wrapped, optimizer, private_loader = out
    private_loader.batch_sampler.steps = steps
    releases = []
    batches = VirtualSteps(data_loader=private_loader, max_physical_batch_size=5, optimizer=optimizer) \
        if mechanism == "virtual steps" else private_loader  # fmt: skip
    for (xb,) in batches:
        before = model[0].weight.detach().clone()
        optimizer.zero_grad()
        wrapped(xb).sum().backward()
        optimizer.step()
        if mechanism == "virtual steps" and optimizer._in_logical_step:
            continue
        releases.append((before - model[0].weight.detach()).flatten().numpy())
    return np.array(releases), engine, optimizer


def epsilon_lower_bound(scores_out: np.ndarray, scores_in: np.ndarray, delta: float, confidence=0.95) -> float:
    """Largest epsilon certified by a threshold test on the scores (Clopper-Pearson bounds)."""
    best = 0.0
    n_out, n_in = len(scores_out), len(scores_in)
    alpha = (1 - confidence) / 2
    for threshold in np.quantile(scores_out, np.linspace(0.5, 0.999, 40)):
        false_positives = int((scores_out > threshold).sum())
        true_positives = int((scores_in > threshold).sum())
        fpr_high = beta.ppf(1 - alpha, false_positives + 1, n_out - false_positives) if false_positives < n_out else 1
        tpr_low = beta.ppf(alpha, true_positives, n_in - true_positives + 1) if true_positives > 0 else 0
        if tpr_low - delta > 0 and fpr_high > 0:
            best = max(best, math.log((tpr_low - delta) / fpr_high))
    return best


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", ["dp-sgd", "ghost", "per-layer", "virtual steps", "truncated", "bandmf"])
def test_canary_audit(mechanism):
    steps = 300
    out_world, engine, optimizer = mechanism_run(mechanism, canary=False, steps=steps, seed=1)
    in_world, _, _ = mechanism_run(mechanism, canary=True, steps=steps, seed=2)
    if mechanism == "bandmf":
        # Undo the correlation: z_t = sum_j c_j x_{t-j} are the fresh draws, std sigma * C * ||c||.
        c = np.asarray(optimizer.noise.coefficients)
        fresh = np.array([sum(c[j] * out_world[t - j] for j in range(len(c)) if t - j >= 0) for t in range(steps)])
        std, expected_std = fresh[len(c):].std(), SIGMA * CLIP * np.linalg.norm(c)
    else:
        std, expected_std = out_world.std(), SIGMA * CLIP
    assert std == pytest.approx(expected_std, rel=0.06)
    assert abs(out_world.mean()) < 4 * expected_std / math.sqrt(out_world.size)
    # The canary (in its group's steps, for BandMF) moves the release by exactly C along its direction.
    shift = (in_world - out_world.mean(0)) @ DIRECTION.numpy()
    if mechanism == "bandmf":
        c = np.asarray(optimizer.noise.coefficients)
        fresh_in = np.array([sum(c[j] * in_world[t - j] for j in range(len(c)) if t - j >= 0) for t in range(steps)])
        shift = fresh_in[len(c):] @ DIRECTION.numpy()
        # C x_t has the canary's clipped gradient C in the rows of its group's steps (every other step)
        mean_shift = shift.mean() * 2 / float(np.sum(c))
    else:
        mean_shift = shift.mean()
    assert mean_shift == pytest.approx(CLIP, rel=0.15)
    # An attacker seeing one release: the test certifies no more than the accounted epsilon of one step.
    scores_out = out_world @ DIRECTION.numpy()
    scores_in = in_world @ DIRECTION.numpy()
    one_step = PrivacyEngine().accountant
    one_step.step(noise_multiplier=SIGMA, sample_rate=1.0)
    assert epsilon_lower_bound(scores_out, scores_in, 1e-5) < one_step.get_epsilon(1e-5)
