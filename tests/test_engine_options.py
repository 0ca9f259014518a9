"""PrivacyOptions: make_private's settings in one frozen object, each checked with an error that names
it; the entry points take them as keywords and show them in their signatures; grad_scaler is attached."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine.engine import PrivacyEngine, PrivacyOptions
from privacy_engine.opacus import PrivacyEngine as OpacusPrivacyEngine
from tests.conftest import module_fingerprint


def make_setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
    return model, optimizer, DataLoader(dataset, batch_size=8)


def test_options_are_frozen_and_keyword_only():
    options = PrivacyOptions(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.noise_multiplier = 2.0
    with pytest.raises(TypeError):
        PrivacyOptions(1.0, 1.0)


@pytest.mark.parametrize(
    ("settings", "error", "field"),
    [
        ({"noise_multiplier": -1.0}, ValueError, "noise_multiplier"),
        ({"noise_multiplier": math.inf}, ValueError, "noise_multiplier"),
        ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
        ({"clipping": "adaptive"}, ValueError, "clipping"),
        ({"batch_first": 1}, TypeError, "batch_first"),
        ({"noise_seed": -1}, ValueError, "noise_seed"),
        ({"noise_mechanism": "bandmf", "num_bands": 0, "total_steps": 4}, ValueError, "num_bands"),
        ({"max_batch_size": 0}, ValueError, "max_batch_size"),
        ({"max_epsilon": 1.0}, ValueError, "target_delta"),
        ({"grad_scaler": object()}, TypeError, "grad_scaler"),
    ],
)
def test_a_bad_setting_is_refused_by_name(settings, error, field):
    with pytest.raises(error, match=field):
        PrivacyOptions(**{"noise_multiplier": 1.0, "max_grad_norm": 1.0, **settings})


def test_an_unknown_keyword_is_refused_by_name_before_anything_is_wrapped():
    model, optimizer, loader = make_setup()
    before = module_fingerprint(model)
    with pytest.raises(TypeError, match="noise_multiplyer"):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplyer=1.0,
                                     max_grad_norm=1.0)  # fmt: skip
    with pytest.raises(TypeError, match="epochs"):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                                     max_grad_norm=1.0, epochs=2)  # fmt: skip
    assert module_fingerprint(model) == before
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())


def test_a_missing_setting_is_named():
    model, optimizer, loader = make_setup()
    with pytest.raises(TypeError, match="noise_multiplier"):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=1.0)


@pytest.mark.parametrize("engine_class", [PrivacyEngine, OpacusPrivacyEngine])
def test_signatures_show_the_settings(engine_class):
    made = inspect.signature(engine_class.make_private).parameters
    calibrated = inspect.signature(engine_class.make_private_with_epsilon).parameters
    for name in ("noise_multiplier", "max_grad_norm", "grad_scaler", "noise_mechanism", "max_epsilon"):
        assert made[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert made["noise_multiplier"].default is inspect.Parameter.empty and made["clipping"].default == "flat"
    assert "noise_multiplier" not in calibrated and "epochs" not in made
    assert calibrated["target_epsilon"].default is inspect.Parameter.empty


def test_grad_scaler_is_attached_to_the_private_optimizer():
    model, optimizer, loader = make_setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    _, private_optimizer, _ = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        grad_scaler=scaler,
    )  # fmt: skip
    assert private_optimizer.clipper.grad_scaler is scaler
    _, plain_optimizer, _ = PrivacyEngine().make_private(*make_setup(), noise_multiplier=1.0, max_grad_norm=1.0)
    assert plain_optimizer.clipper.grad_scaler is None
