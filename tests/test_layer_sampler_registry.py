"""One ``LayerSampler`` per layer family: its forms sit in one registered object; the one-form decorators
(Opacus's function form) fill one form and keep the others; the per-form tables of earlier versions are
views of the one table."""

from __future__ import annotations

import pytest
from torch import nn

from grad_samplers import (
    LayerSampler,
    grad_sampler_for,
    layer_sampler_for,
    norm_sampler_for,
    register_layer_sampler,
    register_norm_sampler,
    weighted_sum_sampler_for,
)
from grad_samplers.conv import CONV_SAMPLER, conv_grad_sample, conv_norm_sample, conv_weighted_sum
from grad_samplers.linear import LINEAR_SAMPLER, linear_grad_sample, linear_norm_sample


def _replacement_grad_sample(layer, activations, backprops):
    return linear_grad_sample(layer, activations, backprops)


def test_a_family_registers_one_object_for_all_its_types():
    samplers = {layer_sampler_for(layer) for layer in (nn.Conv1d(1, 1, 1), nn.Conv2d(1, 1, 1), nn.Conv3d(1, 1, 1))}
    assert samplers == {CONV_SAMPLER}
    assert (CONV_SAMPLER.grad_sample, CONV_SAMPLER.norm_sample, CONV_SAMPLER.weighted_sum) == (
        conv_grad_sample,
        conv_norm_sample,
        conv_weighted_sum,
    )
    assert grad_sampler_for(nn.Conv2d(1, 1, 1)) is conv_grad_sample


def test_registering_a_layer_sampler_replaces_every_form(restore_sampler_registry):
    register_layer_sampler(LayerSampler(grad_sample=_replacement_grad_sample), nn.Linear)
    layer = nn.Linear(2, 2)
    assert grad_sampler_for(layer) is _replacement_grad_sample
    assert norm_sampler_for(layer) is None  # fast clipping then materialises through the new grad_sample
    assert weighted_sum_sampler_for(layer) is None


def test_one_form_decorator_keeps_the_other_forms(restore_sampler_registry):
    register_norm_sampler(nn.Linear)(linear_norm_sample)
    sampler = layer_sampler_for(nn.Linear(2, 2))
    assert sampler.grad_sample is linear_grad_sample
    assert sampler.norm_sample is linear_norm_sample
    assert sampler.weighted_sum is LINEAR_SAMPLER.weighted_sum


def test_types_may_be_given_in_one_list_as_opacus_writes_them(restore_sampler_registry):
    class A(nn.Linear):
        pass

    class B(nn.Linear):
        pass

    sampler = register_layer_sampler(LayerSampler(grad_sample=_replacement_grad_sample), [A, B])
    assert layer_sampler_for(A(1, 1)) is sampler and layer_sampler_for(B(1, 1)) is sampler


def test_per_form_tables_are_views_of_the_one_table(restore_sampler_registry):
    registry = restore_sampler_registry
    assert registry.GRAD_SAMPLERS[nn.Linear] is linear_grad_sample
    registry.GRAD_SAMPLERS.pop(nn.Linear)
    assert layer_sampler_for(nn.Linear(2, 2)).norm_sample is linear_norm_sample  # the other forms stay
    assert nn.Linear not in registry.GRAD_SAMPLERS
    del registry.NORM_SAMPLERS[nn.Linear]
    del registry.WEIGHTED_SUM_SAMPLERS[nn.Linear]
    assert layer_sampler_for(nn.Linear(2, 2)) is None  # no form left: no entry
    with pytest.raises(KeyError):
        del registry.NORM_SAMPLERS[nn.Linear]
    registry.GRAD_SAMPLERS[nn.Linear] = _replacement_grad_sample
    assert layer_sampler_for(nn.Linear(2, 2)) == LayerSampler(grad_sample=_replacement_grad_sample)


def test_layer_sampler_needs_a_callable_form():
    with pytest.raises(ValueError, match="at least one"):
        LayerSampler()
    with pytest.raises(TypeError, match="norm_sample must be callable"):
        LayerSampler(grad_sample=_replacement_grad_sample, norm_sample="not a function")
    with pytest.raises(TypeError, match="takes a LayerSampler"):
        register_layer_sampler(_replacement_grad_sample, nn.Linear)
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        register_layer_sampler(LAYER_SAMPLER_OF_NOTHING, int)


LAYER_SAMPLER_OF_NOTHING = LayerSampler(grad_sample=_replacement_grad_sample)
