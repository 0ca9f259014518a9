"""The engine's paths with the model on a CUDA device (skipped where there is no GPU).

Every check compares with a reference computed on the CPU: the per-example loop in float64 for the
clipped sums of every layer family (ghost and materialised paths), the loop contract's plain-loop clipped
sums for a batch moved with ``.to("cuda")``, the dense ``C^{-1} Z`` for BLT noise, and the uninterrupted
run for a checkpoint resumed on the GPU. Noise on the GPU is checked by its moments and its seeding.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import PrivacyEngine
from privacy_engine.noise import BLTNoise, GaussianNoise
from privacy_engine.noise.blt import BLTStrategy
from tests.test_ghost_clipping import (
    CASES,
    assert_relatively_close,
    ghost_clipped_sum,
    materialised_clipped_sum,
    reference_clipped_sum,
)
from tests.test_grad_scaler import backward_and_step
from tests.test_loop_contract import FEATURES, clipped_sum, loss_of, make_data, make_model, private, snapshot

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


def _on_cuda(model, inputs, target):
    return copy.deepcopy(model).to(CUDA), tuple(x.to(CUDA) for x in inputs), target.to(CUDA)


# ---------------------------------------------------------------------------------------------- per-example sums
@pytest.mark.parametrize("case", sorted(CASES))
def test_ghost_clipped_sums_on_cuda_equal_the_cpu_float64_loop(case):
    model, inputs, target = CASES[case]()
    expected, expected_norms, scales = reference_clipped_sum(model, inputs, target)
    sums, norms = ghost_clipped_sum(*_on_cuda(model, inputs, target))
    assert set(sums) == set(expected)
    torch.testing.assert_close(norms[:, 0].cpu(), expected_norms, rtol=1e-9, atol=0)
    for name in expected:
        assert sums[name].is_cuda, name
        assert_relatively_close(sums[name].cpu(), expected[name], 1e-9, name, scales[name])


@pytest.mark.parametrize("case", sorted(CASES))
def test_materialised_clipped_sums_on_cuda_equal_the_cpu_float64_loop(case):
    model, inputs, target = CASES[case]()
    expected, _, scales = reference_clipped_sum(model, inputs, target)
    sums, _ = materialised_clipped_sum(*_on_cuda(model, inputs, target))
    for name in expected:
        assert sums[name].is_cuda, name
        assert_relatively_close(sums[name].cpu(), expected[name], 1e-9, name, scales[name])


# ---------------------------------------------------------------------------------------------- the loop contract
def _to_cuda_run(mode, **kwargs):
    """The loop contract's run (float64 MLP, batch 8, C = 0.5, noise off, lr 1) with the model on the GPU
    before ``make_private`` and the loader's batches on the CPU."""
    return private(mode, model=make_model().to(CUDA), **kwargs)


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
def test_a_batch_moved_to_cuda_is_that_batch(mode):
    engine, model, wrapped, optimizer, loader = _to_cuda_run(mode)
    x, y = next(iter(loader))
    before = [p.detach().cpu().clone() for p in model.parameters()]
    expected = clipped_sum(model, x, y, 0.5)
    loss_of(wrapped, x.to(CUDA), y.to(CUDA)).backward()
    optimizer.step()
    for b, p, s in zip(before, model.parameters(), expected):
        assert p.is_cuda
        torch.testing.assert_close(p.detach().cpu(), b - s / 8.0, rtol=1e-9, atol=1e-12)
    assert engine.accountant.steps == 1


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_cuda_tensor_not_drawn_by_the_loader_is_refused_before_anything_changes(mode):
    engine, model, wrapped, optimizer, loader = _to_cuda_run(mode)
    x, y = next(iter(loader))
    forged = torch.randn_like(x, device=CUDA)  # the batch's size and dtype, not its rows
    before = snapshot(model)
    loss_of(wrapped, forged, y.to(CUDA)).backward()
    with pytest.raises(RuntimeError):
        optimizer.step()
    assert engine.accountant.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
def test_removing_one_example_moves_the_cuda_release_by_at_most_c(mode):
    # Black box: noise off, q = 1 (every example in every batch, so removing one changes no other draw);
    # the released clipped sum is (parameter change) x expected batch size / lr.
    data = make_data(10)

    def released(rows):
        model = make_model().to(CUDA)
        dataset = TensorDataset(*(t[rows] for t in data.tensors))
        engine = PrivacyEngine()
        wrapped, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
            data_loader=DataLoader(dataset, batch_size=len(dataset)), max_grad_norm=0.5, grad_sample_mode=mode,
            poisson_sampling=True,
        )  # fmt: skip
        before = [p.detach().clone() for p in model.parameters()]
        x, y = next(iter(loader))
        loss_of(wrapped, x.to(CUDA), y.to(CUDA)).backward()
        optimizer.step()
        assert engine.accountant.steps == 1
        scale = loader.expected_batch_size
        return torch.cat([(b - p.detach()).flatten() * scale for p, b in zip(model.parameters(), before)])

    full = released(list(range(10)))
    assert full.is_cuda and float(full.norm()) > 1.0  # several examples contribute: the test can fail
    for removed in (0, 4, 9):
        moved = float((full - released([i for i in range(10) if i != removed])).norm())
        assert 0 < moved <= 0.5 * (1 + 1e-9)


def test_micro_batches_of_a_cuda_copy_release_the_whole_batch_once():
    engine, model, wrapped, optimizer, loader = _to_cuda_run("hooks")
    x, y = next(iter(loader))
    before = [p.detach().cpu().clone() for p in model.parameters()]
    expected = clipped_sum(model, x, y, 0.5)
    for xs, ys in zip(x.to(CUDA).split(3), y.to(CUDA).split(3)):
        loss_of(wrapped, xs, ys).backward()
    optimizer.step()
    for b, p, s in zip(before, model.parameters(), expected):
        torch.testing.assert_close(p.detach().cpu(), b - s / 8.0, rtol=1e-9, atol=1e-12)
    assert engine.accountant.history[0].batches_per_step == 1


# ---------------------------------------------------------------------------------------------- noise
@pytest.mark.parametrize("stream", ["mt19937", "counter-v1"])
def test_gaussian_noise_on_cuda_has_the_stated_moments_and_repeats_with_its_seed(stream):
    def draw(seed):
        tensors = [torch.zeros(400_000, device=CUDA), torch.zeros(600_000, device=CUDA)]
        GaussianNoise(seed=seed, noise_stream=stream).add_noise_(tensors, 1.5, 2.0)
        return torch.cat(tensors)

    noise = draw(3)
    assert noise.is_cuda
    assert abs(float(noise.mean())) < 5 * 3.0 / 1000  # std 3, 1e6 draws: 5 standard errors
    assert abs(float(noise.std()) / 3.0 - 1) < 5 * (0.5 / 1e6) ** 0.5
    assert torch.equal(noise, draw(3))
    assert not torch.equal(noise, draw(4))


def test_blt_noise_on_cuda_equals_the_dense_inverse_of_c_times_the_same_draws():
    strategy = BLTStrategy(buf_decay=(0.95, 0.6, 0.2), output_scale=(0.25, 0.2, 0.1))
    steps = 12
    mechanism = BLTNoise(strategy, min_sep=3, total_steps=steps, seed=5)
    gaussian = GaussianNoise(seed=5)

    def rows(source):
        out = []
        for _ in range(steps):
            tensors = [torch.zeros(3, 4, dtype=torch.float64, device=CUDA), torch.zeros(5, dtype=torch.float64, device=CUDA)]
            source.add_noise_(tensors, 1.3, 0.7)
            out.append(torch.cat([t.flatten() for t in tensors]).cpu())
        return torch.stack(out).numpy()

    released = rows(mechanism)
    expected = np.linalg.solve(strategy.materialize(steps), rows(gaussian) * mechanism.sensitivity)
    np.testing.assert_allclose(released, expected, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------- precision
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_fp16_autocast_with_a_grad_scaler_on_cuda_is_within_fp16_error_of_float32(mode):
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(64, 6, generator=generator), torch.randint(0, 3, (64,), generator=generator))

    def train(autocast):
        torch.manual_seed(11)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(CUDA)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12) if autocast else None
        engine = PrivacyEngine(accountant="rdp")
        wrapped, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), noise_multiplier=0.0,
            data_loader=DataLoader(data, batch_size=16), max_grad_norm=1.0, grad_sample_mode=mode, grad_scaler=scaler,
        )  # fmt: skip
        loader.batch_sampler.generator = torch.Generator().manual_seed(2)
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
                loss = nn.functional.cross_entropy(wrapped(x.to(CUDA)).float(), y.to(CUDA))
            backward_and_step(loss, optimizer, scaler)
            optimizer.zero_grad()
        return torch.cat([p.detach().flatten() for p in model.parameters()]), engine.accountant.steps

    reference, steps = train(False)
    mixed, mixed_steps = train(True)
    assert mixed_steps == steps > 0
    assert float((mixed - reference).norm()) <= 2e-2 * float(reference.norm())


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_bf16_autocast_on_cuda_is_within_bf16_error_of_the_float64_clipped_sum(mode):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    model = copy.deepcopy(reference).float().to(CUDA)
    dataset = TensorDataset(*(t.float() if t.is_floating_point() else t for t in make_data().tensors))
    engine, model, wrapped, optimizer, loader = private(mode, model=model, dataset=dataset)
    x, y = next(iter(loader))
    expected = clipped_sum_of(reference, x.double(), y)
    before = [p.detach().double().cpu().clone() for p in model.parameters()]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(wrapped(x.to(CUDA)).float(), y.to(CUDA))
    loss.backward()
    optimizer.step()
    update = torch.cat([(b - p.detach().double().cpu()).flatten() * 8.0 for p, b in zip(model.parameters(), before)])
    assert float((update - expected).norm()) <= 3e-2 * max(float(expected.norm()), 1e-12)


def clipped_sum_of(model, x, y, clip=0.5):
    params = list(model.parameters())
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for i in range(len(x)):
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), params)
        flat = torch.cat([g.flatten() for g in grads])
        total += flat * min(1.0, clip / float(flat.norm()))
    return total


# ---------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("mechanism", ["gaussian", "bandmf"])
def test_a_cuda_run_resumed_from_a_checkpoint_continues_bit_for_bit(tmp_path, mechanism):
    generator = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(96, 6, generator=generator), torch.randint(0, 3, (96,), generator=generator))
    extra = {"num_bands": 2, "total_steps": 12} if mechanism == "bandmf" else {}

    def run():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(CUDA)
        engine = PrivacyEngine(accountant="rdp")
        wrapped, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01), noise_multiplier=1.0,
            data_loader=DataLoader(data, batch_size=16, generator=torch.Generator().manual_seed(1)),
            max_grad_norm=1.0, grad_sample_mode="ghost", noise_seed=9, noise_mechanism=mechanism, **extra,
        )  # fmt: skip
        return engine, model, wrapped, optimizer, loader

    def train(parts, steps):
        engine, model, wrapped, optimizer, loader = parts
        done = 0
        while done < steps:
            for x, y in loader:
                nn.functional.cross_entropy(wrapped(x.to(CUDA)), y.to(CUDA)).backward()
                optimizer.step()
                optimizer.zero_grad()
                done += 1
                if done == steps:
                    return

    whole = run()
    train(whole, 6)
    first = run()
    train(first, 3)
    engine, model, _, optimizer, loader = first
    engine.save_checkpoint(path=tmp_path / "run.pt", module=model, optimizer=optimizer, data_loader=loader)
    resumed = run()
    engine, model, _, optimizer, loader = resumed
    engine.load_checkpoint(path=tmp_path / "run.pt", module=model, optimizer=optimizer, data_loader=loader)
    assert all(p.is_cuda for p in model.parameters())
    train(resumed, 3)
    for a, b in zip(whole[1].parameters(), resumed[1].parameters()):
        assert torch.equal(a, b)
    assert whole[0].get_epsilon(1e-5) == resumed[0].get_epsilon(1e-5)
