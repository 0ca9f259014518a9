"""Each setting is checked once, by its function in ``privacy_engine.settings_checks``: every way a
setting enters (``make_private``'s options, a hand-built ``DPOptimizer``, ``ClippingConfig``, a noise
mechanism's ``add_noise_``) refuses a bad value with the same message. Settings that cannot affect
privacy are grouped as ``PerformanceFlags``. The Opacus namespace is built on the core, which never
imports it: it constructs its own classes and reads accountant names from the core's one table."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accountants import make_accountant
from privacy_engine import ClippingConfig, DPOptimizer, GaussianNoise, PrivacyOptions
from privacy_engine.clipping import clip_factors
from privacy_engine.engine import typed_settings
from privacy_engine.engine.options import ACCOUNTANT_ALIASES, PerformanceFlags


def _message(call) -> str:
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return str(info.value)


def _optimizer(**settings) -> DPOptimizer:
    model = nn.Linear(3, 2)
    arguments = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "expected_batch_size": 4, **settings}
    return DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **arguments)


@pytest.mark.parametrize("noise_multiplier", [-1.0, math.nan, math.inf, True, "1.0"])
def test_a_bad_noise_multiplier_gets_one_message_from_every_entry_point(noise_multiplier):
    messages = {
        _message(lambda: PrivacyOptions(noise_multiplier=noise_multiplier, max_grad_norm=1.0)),
        _message(lambda: _optimizer(noise_multiplier=noise_multiplier)),
        _message(lambda: GaussianNoise(seed=0).add_noise_([torch.zeros(2)], noise_multiplier, 1.0)),
    }
    assert len(messages) == 1
    assert re.match(r"noise_multiplier must be ", messages.pop())


@pytest.mark.parametrize("max_grad_norm", [-1.0, math.nan, "1.0", False])
def test_a_bad_max_grad_norm_gets_one_message_from_every_entry_point(max_grad_norm):
    messages = {
        _message(lambda: PrivacyOptions(noise_multiplier=1.0, max_grad_norm=max_grad_norm)),
        _message(lambda: _optimizer(max_grad_norm=max_grad_norm)),
        _message(lambda: ClippingConfig(max_grad_norm=max_grad_norm)),
        _message(lambda: clip_factors(torch.ones(2), max_grad_norm)),
        _message(lambda: GaussianNoise(seed=0).add_noise_([torch.zeros(2)], 1.0, max_grad_norm)),
    }
    assert len(messages) == 1
    assert messages.pop().startswith("max_grad_norm must be ")


def test_noise_on_unclipped_gradients_gets_one_message_from_every_entry_point():
    messages = {
        _message(lambda: PrivacyOptions(noise_multiplier=1.0, max_grad_norm=math.inf)),
        _message(lambda: _optimizer(max_grad_norm=math.inf)),
        _message(lambda: GaussianNoise(seed=0).add_noise_([torch.zeros(2)], 1.0, math.inf)),
    }
    assert len(messages) == 1
    assert "max_grad_norm is inf" in messages.pop()


def test_the_engine_alone_refuses_a_zero_bound():
    """make_private trains nothing with C = 0 and refuses it; the clipper itself accepts it (all zeros)."""
    with pytest.raises(ValueError, match=r"max_grad_norm must be > 0"):
        PrivacyOptions(noise_multiplier=1.0, max_grad_norm=0.0)
    assert ClippingConfig(max_grad_norm=0.0).max_grad_norm == 0.0


@pytest.mark.parametrize("loss_reduction", ["none", None])
def test_a_bad_loss_reduction_gets_one_message(loss_reduction):
    messages = {
        _message(lambda: PrivacyOptions(noise_multiplier=1.0, max_grad_norm=1.0, loss_reduction=loss_reduction)),
        _message(lambda: _optimizer(loss_reduction=loss_reduction)),
    }
    assert len(messages) == 1 and messages.pop().startswith("loss_reduction must be one of")


def test_rescale_to_unit_norm_needs_a_finite_positive_bound_wherever_it_is_given():
    messages = {
        _message(lambda: PrivacyOptions(noise_multiplier=0.0, max_grad_norm=math.inf, rescale_to_unit_norm=True)),
        _message(lambda: ClippingConfig(max_grad_norm=0.0, rescale_to_unit_norm=True)),
        _message(lambda: clip_factors(torch.ones(2), 0.0, rescale_to_unit_norm=True)),
    }
    assert all(message.startswith("rescale_to_unit_norm needs a finite max_grad_norm > 0") for message in messages)


def test_performance_flags_are_the_settings_that_cannot_affect_privacy():
    options = PrivacyOptions(noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost")
    assert options.performance == PerformanceFlags(grad_sample_mode="ghost")
    flags = {field.name for field in dataclasses.fields(PerformanceFlags)}
    assert flags <= {field.name for field in dataclasses.fields(PrivacyOptions)}
    assert set(typed_settings.PerformanceSettings.__optional_keys__) == flags
    with pytest.raises(ValueError, match="grad_sample_mode must be one of"):
        PrivacyOptions(noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="fast")


def test_a_per_layer_list_is_kept_as_a_tuple_of_floats():
    options = PrivacyOptions(noise_multiplier=1.0, max_grad_norm=[1, 2.0], clipping="per_layer")
    assert options.max_grad_norm == (1.0, 2.0) and all(type(bound) is float for bound in options.max_grad_norm)


# ---------------------------------------------------------------------------------------------- the Opacus namespace
@pytest.mark.slow  # a fresh interpreter importing torch and the package: seconds on 2 cores
def test_the_core_never_imports_the_opacus_namespace():
    code = (
        "import sys, privacy_engine, privacy_engine.engine, privacy_engine.training.distributed; "
        "print(sorted(m for m in sys.modules if m.startswith('privacy_engine.opacus')))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


@pytest.mark.parametrize("mode", ["hooks", "ghost", "no_op"])
def test_the_opacus_namespace_builds_its_own_classes(mode):
    """No change of class after the fact: make_private constructs the namespace's subclasses."""
    from privacy_engine.opacus import PrivacyEngine as OpacusPrivacyEngine
    from privacy_engine.opacus.grad_sample import get_gsm_class
    from privacy_engine.opacus.optimizers import DPOptimizer as OpacusDPOptimizer

    model = nn.Linear(3, 2)
    loader = DataLoader(TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,))), batch_size=4)
    made = OpacusPrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                              data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                                              grad_sample_mode=mode)  # fmt: skip
    assert type(made[0]) is get_gsm_class(mode) and type(made[1]) is OpacusDPOptimizer


@pytest.mark.parametrize("name", sorted(ACCOUNTANT_ALIASES))
def test_every_accountant_name_means_the_same_in_both_namespaces(name):
    from privacy_engine.opacus.accountants import create_accountant

    assert create_accountant(name).name == make_accountant(ACCOUNTANT_ALIASES[name]).name
