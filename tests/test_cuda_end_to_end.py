"""End-to-end private training on a CUDA device (skipped where there is no GPU).

Each test runs ``make_private`` and a few steps with the model on the GPU, and checks that the
released update equals the same computation on the CPU (noise off), or that noise lands on the
parameters' device with the right scale (noise on).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import PrivacyEngine

pytestmark = pytest.mark.cuda


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(3, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 8, 6),
        nn.LayerNorm(6),
        nn.Linear(6, 3),
    )


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 8, generator=generator)
    y = torch.randint(0, 3, (64,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def _train(device: str, mode: str, noise_multiplier: float, mechanism: str = "gaussian") -> nn.Module:
    model = _model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine(accountant="rdp")
    extra = {"num_bands": 2, "total_steps": 8} if mechanism == "bandmf" else {}
    out = engine.make_private(
        module=model, optimizer=optimizer, data_loader=_loader(), noise_multiplier=noise_multiplier,
        max_grad_norm=0.5, grad_sample_mode=mode, noise_seed=3, noise_generator=None,
        noise_mechanism=mechanism, **extra,
    )  # fmt: skip
    wrapped, dp_optimizer, loader = out
    loader.batch_sampler.generator = torch.Generator().manual_seed(2)
    for step, (x, y) in enumerate(loader):
        dp_optimizer.zero_grad()
        nn.functional.cross_entropy(wrapped(x.to(device)), y.to(device)).backward()
        dp_optimizer.step()
        if step == 2:
            break
    assert engine.get_epsilon(1e-5) > 0
    return model


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
def test_noise_free_update_on_cuda_equals_cpu(mode):
    on_gpu = _train("cuda", mode, 0.0)
    on_cpu = _train("cpu", mode, 0.0)
    for (name, gpu_param), cpu_param in zip(on_gpu.named_parameters(), on_cpu.parameters()):
        assert gpu_param.is_cuda, name
        torch.testing.assert_close(gpu_param.detach().cpu(), cpu_param.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mechanism", ["gaussian", "bandmf"])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_noisy_training_runs_on_cuda(mode, mechanism):
    before = copy.deepcopy(_model())
    after = _train("cuda", mode, 1.0, mechanism)
    moved = [float((a.detach().cpu() - b.detach()).abs().max()) for a, b in zip(after.parameters(), before.parameters())]
    assert all(m > 0 for m in moved)
    assert all(torch.isfinite(p).all() for p in after.parameters())
