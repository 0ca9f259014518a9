"""The sampler registry: plugins found through the ``privacy_engine.grad_samplers`` entry point group,
last-wins registration, exact-type lookup, and argument checks."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch
from conftest import assert_matches_reference, per_example_reference
from torch import nn

import grad_samplers
from grad_samplers import ENTRY_POINT_GROUP, grad_sampler_for, register_grad_sampler
from grad_samplers.linear import linear_grad_sample
from privacy_engine import GradSampleModule

DOUBLE = torch.float64

PLUGIN_SOURCE = '''
"""A third-party layer and its grad sampler, registered on import."""
import torch
from torch import nn

from grad_samplers import register_grad_sampler

CALLS = []


class ScaledShift(nn.Module):
    """y = x * scale + shift, elementwise over the last dimension."""

    def __init__(self, features):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, features))
        self.shift = nn.Parameter(torch.zeros(features))

    def forward(self, x):
        return x * self.scale + self.shift


@register_grad_sampler(ScaledShift)
def scaled_shift_grad_sample(layer, activations, backprops):
    CALLS.append(tuple(backprops.shape))
    inputs = activations[0]
    batch_size = backprops.shape[0]
    per_sample = {}
    if layer.scale.requires_grad:
        per_sample[layer.scale] = (inputs * backprops).reshape(batch_size, -1, inputs.shape[-1]).sum(1)
    if layer.shift.requires_grad:
        per_sample[layer.shift] = backprops.reshape(batch_size, -1, backprops.shape[-1]).sum(1)
    return per_sample
'''

CALLABLE_PLUGIN_SOURCE = '''
"""A plugin whose entry point is a function: registering happens when it is called."""
from torch import nn

from grad_samplers import register_grad_sampler

REGISTERED = []


class Doubler(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def register():
    from grad_samplers.linear import linear_grad_sample

    def doubler_grad_sample(layer, activations, backprops):
        return linear_grad_sample(layer, activations, 2 * backprops)

    register_grad_sampler(Doubler)(doubler_grad_sample)
    REGISTERED.append(True)
'''


OVERRIDE_PLUGIN_SOURCE = '''
"""A plugin that replaces the built-in nn.Linear sampler with a counting wrapper."""
from torch import nn

from grad_samplers import register_grad_sampler
from grad_samplers.linear import linear_grad_sample

CALLS = []


@register_grad_sampler(nn.Linear)
def counting_linear_grad_sample(layer, activations, backprops):
    CALLS.append(layer)
    return linear_grad_sample(layer, activations, backprops)
'''


def install_distribution(root, name: str, modules: dict, entry_points: dict) -> None:
    """Write a minimal installed distribution (its modules and a ``.dist-info``) under ``root``."""
    for module_name, source in modules.items():
        (root / f"{module_name}.py").write_text(textwrap.dedent(source))
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = [f"[{ENTRY_POINT_GROUP}]"] + [f"{key} = {value}" for key, value in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture
def plugin_path(tmp_path, monkeypatch, restore_sampler_registry):
    """A directory on sys.path for test distributions; their modules are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for module_name in ("pe_test_plugin", "pe_test_callable_plugin", "pe_test_broken_plugin", "pe_test_override"):
        sys.modules.pop(module_name, None)
    importlib.invalidate_caches()


def test_entry_point_plugin_registers_a_sampler_that_gradsamplemodule_uses(plugin_path):
    install_distribution(
        plugin_path, "pe_test_plugin", {"pe_test_plugin": PLUGIN_SOURCE}, {"scaled_shift": "pe_test_plugin"}
    )
    importlib.invalidate_caches()
    grad_samplers.load_plugins(reload=True)
    plugin = sys.modules["pe_test_plugin"]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), plugin.ScaledShift(3), nn.Tanh(), nn.Linear(3, 2)).to(DOUBLE)
    assert grad_sampler_for(model[1]) is plugin.scaled_shift_grad_sample
    x, y = torch.randn(5, 2, 4, dtype=DOUBLE), torch.randn(5, 2, 2, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: ((out - y[i : i + 1]) ** 2).sum())

    wrapped = GradSampleModule(model, loss_reduction="sum")
    ((wrapped(x) - y) ** 2).sum().backward()
    assert plugin.CALLS == [(5, 2, 3)]  # the plugin's sampler ran, once, on the whole batch
    assert_matches_reference(model, reference)


def test_callable_entry_point_is_called_once_loaded(plugin_path):
    install_distribution(
        plugin_path,
        "pe_test_callable_plugin",
        {"pe_test_callable_plugin": CALLABLE_PLUGIN_SOURCE},
        {"doubler": "pe_test_callable_plugin:register"},
    )
    importlib.invalidate_caches()
    grad_samplers.load_plugins(reload=True)
    plugin = sys.modules["pe_test_callable_plugin"]
    assert plugin.REGISTERED == [True]

    torch.manual_seed(0)
    model = nn.Sequential(plugin.Doubler(4, 3)).to(DOUBLE)
    assert grad_sampler_for(model[0]) is not None
    x = torch.randn(3, 4, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: (out**2).sum())
    wrapped = GradSampleModule(model, loss_reduction="sum")
    (wrapped(x) ** 2).sum().backward()
    assert_matches_reference(model, reference)


BROKEN_PLUGINS = {
    "import_fails": ("raise ImportError('missing dependency')\n", "pe_test_broken_plugin"),
    "call_fails": ("def register():\n    raise ImportError('missing dependency')\n", "pe_test_broken_plugin:register"),
}


@pytest.mark.parametrize("failure", sorted(BROKEN_PLUGINS))
def test_broken_plugin_warns_and_does_not_block_others(plugin_path, failure):
    source, entry_point = BROKEN_PLUGINS[failure]
    # One distribution, the broken entry point first: the good one after it must still load.
    install_distribution(
        plugin_path,
        "pe_test_plugins",
        {"pe_test_broken_plugin": source, "pe_test_plugin": PLUGIN_SOURCE},
        {"broken": entry_point, "scaled_shift": "pe_test_plugin"},
    )
    importlib.invalidate_caches()
    with pytest.warns(UserWarning, match="'broken'.*missing dependency"):
        grad_samplers.load_plugins(reload=True)
    plugin = sys.modules["pe_test_plugin"]
    assert grad_sampler_for(plugin.ScaledShift(2)) is plugin.scaled_shift_grad_sample


def test_registering_a_covered_type_overrides_the_builtin(restore_sampler_registry):
    calls = []

    def spying_linear_grad_sample(layer, activations, backprops):
        calls.append(layer)
        return linear_grad_sample(layer, activations, backprops)

    assert grad_sampler_for(nn.Linear(2, 2)) is linear_grad_sample
    register_grad_sampler(nn.Linear)(spying_linear_grad_sample)
    assert grad_sampler_for(nn.Linear(2, 2)) is spying_linear_grad_sample

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(DOUBLE)
    x = torch.randn(3, 4, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: (out**2).sum())
    wrapped = GradSampleModule(model, loss_reduction="sum")
    (wrapped(x) ** 2).sum().backward()
    assert calls == [model[2], model[0]]  # backward order
    assert_matches_reference(model, reference)


def test_plugin_registering_a_builtin_type_overrides_it(plugin_path):
    install_distribution(
        plugin_path, "pe_test_override", {"pe_test_override": OVERRIDE_PLUGIN_SOURCE}, {"linear": "pe_test_override"}
    )
    importlib.invalidate_caches()
    grad_samplers.load_plugins(reload=True)
    plugin = sys.modules["pe_test_override"]
    assert grad_sampler_for(nn.Linear(2, 2)) is plugin.counting_linear_grad_sample

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).to(DOUBLE)
    x = torch.randn(3, 4, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: (out**2).sum())
    wrapped = GradSampleModule(model, loss_reduction="sum")
    (wrapped(x) ** 2).sum().backward()
    assert plugin.CALLS == [model[0]]
    assert_matches_reference(model, reference)


def test_lookup_is_by_exact_type():
    class MyLinear(nn.Linear):
        pass

    assert grad_sampler_for(nn.Linear(2, 2)) is linear_grad_sample
    assert grad_sampler_for(MyLinear(2, 2)) is None


@pytest.mark.parametrize("bad", [(), (int,), (nn.Linear(2, 2),)], ids=["nothing", "not_a_module_type", "instance"])
def test_register_rejects_non_module_types(bad):
    with pytest.raises(TypeError, match="register_grad_sampler"):
        register_grad_sampler(*bad)
