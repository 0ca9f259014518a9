"""The convolution's two forms of per-sample weight gradients (issue 21 item 7): the grouped backward
(the batch folded into the groups) and the patch form ``G^T A`` (``patches_are_small``: no more output
positions than output channels per group, the deep layers of a CNN). Each is forced in turn and checked
against a float64 per-example loop over conv1d/2d/3d, stride, padding ('same', 'valid', int), dilation,
groups, every padding mode and channels_last input; and the choice itself is checked. The same for the ghost
norm and clipped-sum forms: the norms through ``F.unfold``'s columns, the Gram form on both patch layouts
(``unfold_is_faster``) and the clipped sum as one product over the patches (``positions_are_few``)."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from conftest import ATOL, RTOL, per_example_reference
from torch import nn

import grad_samplers
import grad_samplers._convolution as convolution_module
import grad_samplers.conv as conv_module
import grad_samplers.conv_transpose as conv_transpose_module
from grad_samplers._convolution import patches_are_small, positions_are_few

DOUBLE = torch.float64
FORMS = {
    "patches": lambda *args: True,
    "grouped": lambda *args: False,
}

# (dims, in, out, kernel, stride, padding, dilation, groups, padding_mode, size, batch)
CONFIGS = [
    (1, 3, 4, 3, 1, 1, 1, 1, "zeros", (9,), 3),
    (1, 4, 6, 2, 2, "valid", 1, 2, "zeros", (8,), 2),
    (1, 2, 4, 3, 1, "same", 2, 2, "circular", (7,), 2),
    (2, 3, 5, 3, 2, 1, 1, 1, "zeros", (7, 6), 3),
    (2, 4, 4, 3, 1, "same", (1, 2), 2, "reflect", (5, 6), 2),
    (2, 4, 6, (2, 3), 1, "same", 1, 2, "replicate", (5, 5), 2),  # even kernel: asymmetric 'same'
    (2, 2, 8, 1, 2, 0, 1, 1, "zeros", (6, 6), 3),  # 1x1 strided (a ResNet shortcut)
    (2, 6, 6, 3, 1, 2, 2, 3, "circular", (6, 7), 2),
    (3, 2, 4, 2, (1, 2, 1), 1, 1, 2, "zeros", (4, 5, 4), 2),
    (3, 2, 3, 3, 1, "same", 1, 1, "replicate", (4, 4, 3), 2),
]


def _layer(config) -> nn.Module:
    dims, in_channels, out_channels, kernel, stride, padding, dilation, groups, mode, _, _ = config
    layer_type = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
    return layer_type(
        in_channels, out_channels, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups,
        padding_mode=mode,
    ).to(DOUBLE)  # fmt: skip


def _activations_and_backprops(layer: nn.Module, inputs: torch.Tensor, target: torch.Tensor):
    """The layer's input and its output gradient for the summed loss ``((tanh(out) - target)^2).sum()``."""
    inputs = inputs.detach().requires_grad_(False)
    output = layer(inputs)
    output.retain_grad()
    ((torch.tanh(output) - target) ** 2).sum().backward()
    return (inputs,), output.grad.detach()


def _per_example(layer: nn.Module, inputs: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    model = nn.Sequential(layer)

    def loss_of(output, index):
        return ((torch.tanh(output) - target[index : index + 1]) ** 2).sum()

    return {name.removeprefix("0."): grads for name, grads in per_example_reference(model, (inputs,), loss_of).items()}


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}d-g{c[7]}-{c[8]}-{c[5]}")
def test_each_form_matches_a_float64_per_example_loop(config, channels_last, form):
    torch.manual_seed(len(config[9]) * 100 + config[1])
    layer = _layer(config)
    inputs = torch.randn(config[10], config[1], *config[9], dtype=DOUBLE)
    if channels_last and config[0] > 1:
        inputs = inputs.contiguous(memory_format=torch.channels_last if config[0] == 2 else torch.channels_last_3d)
    target = torch.randn_like(layer(inputs))
    expected = _per_example(copy.deepcopy(layer), inputs, target)
    activations, backprops = _activations_and_backprops(copy.deepcopy(layer), inputs, target)
    with mock.patch.object(conv_module, "patches_are_small", FORMS[form]):
        grads = conv_module.conv_grad_sample(layer, activations, backprops)
        norms = conv_module.conv_norm_sample(layer, activations, backprops)
    for name in ("weight", "bias"):
        param = getattr(layer, name)
        torch.testing.assert_close(grads[param], expected[name], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(norms[param], expected[name].flatten(1).square().sum(dim=1), rtol=RTOL, atol=ATOL)


def test_frozen_weight_in_the_patch_form_is_left_out():
    layer = nn.Conv2d(2, 8, 3, padding=1).to(DOUBLE)
    layer.weight.requires_grad_(False)
    inputs = torch.randn(2, 2, 2, 2, dtype=DOUBLE)
    target = torch.randn(2, 8, 2, 2, dtype=DOUBLE)
    expected = _per_example(copy.deepcopy(layer), inputs, target)
    activations, backprops = _activations_and_backprops(copy.deepcopy(layer), inputs, target)
    grads = grad_samplers.grad_sampler_for(layer)(layer, activations, backprops)
    assert set(grads) == {layer.bias}
    torch.testing.assert_close(grads[layer.bias], expected["bias"], rtol=RTOL, atol=ATOL)


def test_the_patch_form_is_chosen_when_positions_do_not_exceed_outputs_per_group():
    assert patches_are_small(num_positions=4, outputs_per_group=512)  # ResNet's last stage
    assert patches_are_small(num_positions=64, outputs_per_group=64)
    assert not patches_are_small(num_positions=256, outputs_per_group=64)  # ResNet's first stage
    calls = []
    original = conv_module.patch_weight_grads
    with mock.patch.object(conv_module, "patch_weight_grads", lambda *a: calls.append(1) or original(*a)):
        for size, used in (((2, 2), True), ((6, 6), False)):  # 4 or 36 positions, 8 outputs per group
            calls.clear()
            layer = nn.Conv2d(4, 16, 3, padding=1, groups=2)
            inputs = torch.randn(3, 4, *size)
            conv_module.conv_grad_sample(layer, (inputs,), torch.randn(3, 16, *size))
            assert bool(calls) == used


def test_both_forms_give_the_same_float32_result_to_rounding():
    layer = nn.Conv2d(16, 32, 3, stride=2, padding=1)
    inputs, backprops = torch.randn(4, 16, 8, 8), torch.randn(4, 32, 4, 4)
    results = {}
    for form, rule in FORMS.items():
        with mock.patch.object(conv_module, "patches_are_small", rule):
            results[form] = conv_module.conv_grad_sample(layer, (inputs,), backprops)[layer.weight]
    torch.testing.assert_close(results["patches"], results["grouped"], rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}d-g{c[7]}-{c[8]}-{c[5]}")
def test_patch_norm_and_both_weighted_sum_forms_match_a_float64_per_example_loop(config):
    """The norms through the patch columns (``patch_weight_norms``: the Gram form turned off), in the Gram form
    on both patch layouts (``unfold_is_faster``), and the clipped sum both as one product over the patches
    (``patch_weight_backward``) and as the backend's weight backward."""
    torch.manual_seed(len(config[9]) * 100 + config[1] + 7)
    layer = _layer(config)
    inputs = torch.randn(config[10], config[1], *config[9], dtype=DOUBLE)
    if config[0] == 2 and config[1] % 2 == 0:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    target = torch.randn_like(layer(inputs))
    expected = _per_example(copy.deepcopy(layer), inputs, target)
    activations, backprops = _activations_and_backprops(copy.deepcopy(layer), inputs, target)
    weights = torch.rand(config[10], dtype=DOUBLE)
    with (
        mock.patch.object(conv_module, "patches_are_small", FORMS["patches"]),
        mock.patch.object(conv_module, "gram_is_cheaper", lambda *args: False),
    ):
        norms = conv_module.conv_norm_sample(layer, activations, backprops)
    gram_norms = {}
    for rule in (True, False):  # the Gram form on F.unfold's columns and on the strided patch copy
        with (
            mock.patch.object(conv_module, "gram_is_cheaper", lambda *args: True),
            mock.patch.object(convolution_module, "unfold_is_faster", lambda *args, rule=rule: rule),
        ):
            gram_norms[rule] = conv_module.conv_norm_sample(layer, activations, backprops)
    sums = {}
    for form, rule in (("patches", True), ("backend", False)):
        with mock.patch.object(conv_module, "positions_are_few", lambda *args, rule=rule: rule):
            sums[form] = conv_module.conv_weighted_sum(layer, activations, backprops, weights)
    for name in ("weight", "bias"):
        param = getattr(layer, name)
        squared = expected[name].flatten(1).square().sum(dim=1)
        for result in (norms, gram_norms[True], gram_norms[False]):
            torch.testing.assert_close(result[param], squared, rtol=RTOL, atol=ATOL)
        for form in ("patches", "backend"):
            torch.testing.assert_close(
                sums[form][param], torch.einsum("b,b...->...", weights, expected[name]), rtol=RTOL, atol=ATOL
            )


def test_the_patch_weight_backward_is_chosen_for_few_positions():
    assert positions_are_few(1)  # ResNet's last stage at 32x32
    assert not positions_are_few(4)
    calls = []
    original = conv_module.patch_weight_backward
    with mock.patch.object(conv_module, "patch_weight_backward", lambda *a: calls.append(1) or original(*a)):
        for size, used in (((1, 1), True), ((2, 2), False)):
            calls.clear()
            layer = nn.Conv2d(4, 16, 3, padding=1, groups=2)
            conv_module.conv_weighted_sum(layer, (torch.randn(3, 4, *size),), torch.randn(3, 16, *size), torch.rand(3))
            assert bool(calls) == used


@pytest.mark.parametrize(
    ("in_channels", "out_channels", "kernel", "stride", "padding", "output_padding", "dilation", "groups"),
    [(4, 6, 3, 2, 1, 1, 1, 2), (2, 4, 3, 1, 1, 0, 2, 1), (3, 3, (2, 3), 2, 0, 1, 1, 3)],
)
def test_transposed_convolution_gram_form_on_both_layouts_matches_a_float64_loop(
    in_channels, out_channels, kernel, stride, padding, output_padding, dilation, groups
):
    """A transposed convolution windows its output gradient: the Gram form on ``F.unfold``'s columns
    (``unfold_is_faster``) and on the strided copy, each against the per-example loop's weight-gradient norms."""
    torch.manual_seed(in_channels + 10 * out_channels)
    layer = nn.ConvTranspose2d(
        in_channels, out_channels, kernel, stride, padding, output_padding=output_padding, dilation=dilation,
        groups=groups,
    ).to(DOUBLE)  # fmt: skip
    inputs = torch.randn(3, in_channels, 6, 7, dtype=DOUBLE)
    target = torch.randn_like(layer(inputs))
    expected = _per_example(copy.deepcopy(layer), inputs, target)["weight"].flatten(1).square().sum(dim=1)
    activations, backprops = _activations_and_backprops(copy.deepcopy(layer), inputs, target)
    sampler = grad_samplers.norm_sampler_for(layer)
    for rule in (True, False):
        with (
            mock.patch.object(conv_transpose_module, "gram_is_cheaper", lambda *args: True),
            mock.patch.object(convolution_module, "unfold_is_faster", lambda *args, rule=rule: rule),
        ):
            norms = sampler(layer, activations, backprops)
        torch.testing.assert_close(norms[layer.weight], expected, rtol=RTOL, atol=ATOL)
