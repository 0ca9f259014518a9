"""Reproducibility as a PyTorch user expects it (issue 26 part B), secure mode unchanged.

* ``torch.manual_seed`` called after ``make_private`` makes a run repeat exactly: the noise seed and the
  Poisson sampler's seed are drawn from torch's global generator at the first step / first batch, not when
  the optimizer and the loader are built (before, both were drawn at ``make_private``, so whatever used the
  global generator between ``make_private`` and training changed the run).
* A ``DataLoader(generator=g)`` drives the Poisson sampling (as in Opacus): same ``g`` state, same batches,
  whatever the global generator does.
* Secure mode: OS randomness only, for the noise and the sampling, even with a seeded global generator or a
  ``generator=`` on the loader; no seed in any state.
* A checkpoint saved before the first step (seed not drawn yet) resumes as the uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import PrivacyEngine
from privacy_engine.noise.secure_random import is_secure_generator

NUM_EXAMPLES, BATCH_SIZE = 48, 8


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(NUM_EXAMPLES, 5, generator=generator),
                         torch.randint(0, 3, (NUM_EXAMPLES,), generator=generator))  # fmt: skip


def _initial_weights() -> dict[str, torch.Tensor]:
    with torch.random.fork_rng():  # leaves the global generator as it was: the tests decide its state
        torch.manual_seed(99)
        return nn.Sequential(nn.Linear(5, 6), nn.Dropout(0.3), nn.Linear(6, 3)).state_dict()


def _private(mode: str = "hooks", *, secure_mode: bool = False, loader_generator: torch.Generator | None = None,
             dropout: float = 0.3, **settings):  # fmt: skip
    model = nn.Sequential(nn.Linear(5, 6), nn.Dropout(dropout), nn.Linear(6, 3))
    model.load_state_dict(_initial_weights())
    engine = PrivacyEngine(secure_mode=secure_mode)
    loader = DataLoader(_dataset(), batch_size=BATCH_SIZE, generator=loader_generator)
    return engine, *engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode, **settings,
    )  # fmt: skip


def _steps(model, optimizer, batches, count: int) -> None:
    """``count`` private steps on the next batches of the iterator ``batches``."""
    for _ in range(count):
        x, y = next(batches)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def _train(model, optimizer, loader, steps: int = 4) -> tuple[list[torch.Tensor], list[int]]:
    """Parameters after ``steps`` steps and the batch sizes seen."""
    sizes = []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        sizes.append(len(x))
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], sizes


def _batch_indices(loader, steps: int = 5) -> list[list[int]]:
    batches = iter(loader.batch_sampler)
    return [next(batches) for _ in range(steps)]


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_manual_seed_after_make_private_repeats_a_run_exactly(mode):
    runs = []
    for seed_before in (1, 2):  # different global generator states when make_private runs
        torch.manual_seed(seed_before)
        torch.rand(seed_before * 7)  # and different use of it before
        _engine, model, optimizer, loader = _private(mode)
        torch.manual_seed(0)
        runs.append(_train(model, optimizer, loader))
    (first, first_sizes), (second, second_sizes) = runs
    assert first_sizes == second_sizes
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_manual_seed_after_make_private_repeats_an_adaptive_clipping_run():
    adaptive = {"clipping": "adaptive", "target_unclipped_quantile": 0.5, "clipbound_learning_rate": 0.5,
                "max_clipbound": 10.0, "min_clipbound": 0.01, "unclipped_num_std": 5.0}  # fmt: skip
    runs = []
    for seed_before in (1, 2):
        torch.manual_seed(seed_before)
        _engine, model, optimizer, loader = _private(**adaptive)
        torch.manual_seed(0)
        parameters, _ = _train(model, optimizer, loader)
        runs.append((parameters, optimizer.clipper.bounds))
    (first, first_norms), (second, second_norms) = runs
    assert first_norms == second_norms and first_norms != (1.0,)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_another_manual_seed_after_make_private_gives_another_run():
    results = []
    for seed in (0, 1):
        _engine, model, optimizer, loader = _private()
        torch.manual_seed(seed)
        results.append(_train(model, optimizer, loader)[0])
    assert not all(torch.equal(a, b) for a, b in zip(*results))


def test_an_explicit_noise_seed_still_fixes_the_noise_whatever_the_global_generator():
    noises = []
    for seed in (0, 1):
        _engine, _model, optimizer, _loader = _private(noise_seed=123)
        torch.manual_seed(seed)
        zeros = [torch.zeros_like(p) for p in optimizer.params]
        optimizer.noise.add_noise_(zeros, 1.0, 1.0)
        noises.append(zeros)
    assert all(torch.equal(a, b) for a, b in zip(*noises))


def test_the_dataloader_generator_drives_the_poisson_sampling():
    indices = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        *_, loader = _private(loader_generator=torch.Generator().manual_seed(5))
        torch.manual_seed(global_seed + 10)
        indices.append(_batch_indices(loader))
    assert indices[0] == indices[1]  # the global generator does not matter
    *_, loader = _private(loader_generator=torch.Generator().manual_seed(6))
    assert _batch_indices(loader) != indices[0]  # the loader's generator does
    generator = torch.Generator().manual_seed(5)
    *_, loader = _private(loader_generator=generator)
    # The sampler keeps its own generator, seeded by one draw from the loader's at the first batch: the
    # DataLoader iterators' own draws from that generator never shift the batches (a resume stays exact).
    assert loader.batch_sampler.generator is not generator
    generator.manual_seed(5)  # a manual_seed after make_private counts (the draw happens at the first batch)
    assert _batch_indices(loader) == indices[0]


def test_a_mid_epoch_resume_with_a_loader_generator_is_exact(tmp_path):
    engine, model, optimizer, loader = _private(dropout=0.0, loader_generator=torch.Generator().manual_seed(5))
    batches = iter(loader)
    _steps(model, optimizer, batches, 2)
    path = tmp_path / "mid.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer, data_loader=loader)
    _steps(model, optimizer, batches, 2)

    # A fresh process: the same code, so a loader generator seeded as before (its state differs from the
    # first run's at the checkpoint: the first run's iterators drew from it).
    r_engine, r_model, r_optimizer, r_loader = _private(dropout=0.0, loader_generator=torch.Generator().manual_seed(5))
    r_engine.load_checkpoint(path=path, module=r_model, optimizer=r_optimizer, data_loader=r_loader)
    r_batches = iter(r_loader)
    _steps(r_model, r_optimizer, r_batches, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), r_model.parameters()))


def test_a_checkpoint_saved_before_the_first_step_resumes_as_the_uninterrupted_run(tmp_path):
    torch.manual_seed(3)
    engine, model, optimizer, loader = _private()
    path = tmp_path / "start.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer, data_loader=loader)
    assert optimizer.noise.state_dict()["seed"] is None  # not drawn yet
    assert loader.state_dict()["seed_pending"] is True
    torch.manual_seed(4)
    reference, _ = _train(model, optimizer, loader)

    r_engine, r_model, r_optimizer, r_loader = _private()
    r_engine.load_checkpoint(path=path, module=r_model, optimizer=r_optimizer, data_loader=r_loader)
    torch.manual_seed(4)
    resumed, _ = _train(r_model, r_optimizer, r_loader)
    assert all(torch.equal(a, b) for a, b in zip(reference, resumed))


def test_a_resume_after_the_first_step_ignores_the_global_generator(tmp_path):
    torch.manual_seed(3)
    engine, model, optimizer, loader = _private(dropout=0.0)  # no dropout: every draw of the run is the engine's
    batches = iter(loader)
    _steps(model, optimizer, batches, 2)
    path = tmp_path / "mid.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer, data_loader=loader)
    assert isinstance(optimizer.noise.state_dict()["seed"], int) and "seed_pending" not in loader.state_dict()
    _steps(model, optimizer, batches, 2)

    r_engine, r_model, r_optimizer, r_loader = _private(dropout=0.0)
    r_engine.load_checkpoint(path=path, module=r_model, optimizer=r_optimizer, data_loader=r_loader)
    torch.manual_seed(777)
    r_batches = iter(r_loader)
    _steps(r_model, r_optimizer, r_batches, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), r_model.parameters()))


def test_secure_mode_draws_from_the_os_whatever_the_seeds():
    noises, samplers = [], []
    for _ in range(2):
        torch.manual_seed(0)
        _engine, _model, optimizer, loader = _private(secure_mode=True, loader_generator=torch.Generator().manual_seed(5))
        torch.manual_seed(0)
        zeros = [torch.zeros_like(p) for p in optimizer.params]
        optimizer.noise.add_noise_(zeros, 1.0, 1.0)
        noises.append(zeros)
        samplers.append(loader.batch_sampler.generator)
        state = optimizer.noise.state_dict()
        assert state["seed"] is None and all(d["generator_states"] is None for d in state["devices"])
    assert not any(torch.equal(a, b) for a, b in zip(*noises))
    assert all(is_secure_generator(g) for g in samplers)
    with pytest.raises(ValueError, match="seed"):
        _private(secure_mode=True, noise_seed=1)
