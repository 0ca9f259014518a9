"""``grad_sample_mode="auto"``, the default (``privacy_engine.engine.mode_choice``, issue 21 item 7): ghost
for a model with trainable convolutions whose every layer has a sampler, hooks otherwise; named modes
and the Opacus namespace unchanged; the choice logged."""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import GradSampleModule, PrivacyEngine
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.opacus import PrivacyEngine as OpacusPrivacyEngine


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))


class _Scaled(nn.Module):
    """A layer owning a parameter with no registered sampler (the torch.func fallback computes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.scale


def _loader(shape=(2, 4, 4)) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, *shape, generator=generator), torch.randint(0, 3, (16,), generator=generator))
    return DataLoader(data, batch_size=8)


def _make_private(model: nn.Module, loader: DataLoader | None = None, **settings):
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader or _loader(),
                                        noise_multiplier=1.0, max_grad_norm=1.0, **settings)  # fmt: skip


def test_a_cnn_gets_ghost_mode_by_default_and_the_choice_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="privacy_engine.engine.mode_choice"):
        module, _, _ = _make_private(_cnn())
    assert isinstance(module, GhostClippingModule)
    assert "grad_sample_mode='auto' -> 'ghost'" in caplog.text


def test_a_named_mode_is_kept():
    module, _, _ = _make_private(_cnn(), grad_sample_mode="hooks")
    assert isinstance(module, GradSampleModule) and not isinstance(module, GhostClippingModule)


def test_a_model_without_convolutions_keeps_hooks_by_default():
    model = nn.Sequential(nn.Flatten(), nn.Linear(32, 3))
    module, _, _ = _make_private(model)
    assert isinstance(module, GradSampleModule) and not isinstance(module, GhostClippingModule)


def test_a_layer_without_a_sampler_keeps_hooks_by_default(caplog):
    with caplog.at_level(logging.INFO, logger="privacy_engine.engine.mode_choice"):
        module, _, _ = _make_private(nn.Sequential(_cnn(), _Scaled()))
    assert not isinstance(module, GhostClippingModule)
    assert "_Scaled" in caplog.text


def test_per_layer_clipping_keeps_hooks_by_default():
    module, _, _ = _make_private(_cnn(), clipping="per_layer")
    assert not isinstance(module, GhostClippingModule)


def test_the_opacus_namespace_keeps_opacus_default_of_hooks():
    model = _cnn()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = OpacusPrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                  data_loader=_loader(), noise_multiplier=1.0, max_grad_norm=1.0)  # fmt: skip
    assert len(made) == 3 and not isinstance(made[0], GhostClippingModule)


def _one_step(mode):
    torch.manual_seed(0)
    model = _cnn().double()
    loader = DataLoader(TensorDataset(*(t.double() if t.is_floating_point() else t for t in _loader().dataset.tensors)),
                        batch_size=8)  # fmt: skip
    settings = {} if mode is None else {"grad_sample_mode": mode}
    module, optimizer, private_loader = _make_private(model, loader, poisson_sampling=False, noise_seed=3, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs, targets = next(iter(private_loader))
    nn.functional.cross_entropy(module(inputs), targets).backward()
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_the_default_mode_releases_what_hooks_mode_releases():
    for chosen, hooks in zip(_one_step(None), _one_step("hooks")):
        torch.testing.assert_close(chosen, hooks, rtol=1e-10, atol=1e-12)
