"""Fast clipping's rank-one linear calls done across layers at the end of a pass (``clipping.ghost.batched``):
bit for bit what the per-layer samplers give (norms, clipped sums, whole steps, NaN rows, per-layer clipping,
frozen parameters, stacked and unstacked sizes), exact against a float64 per-example loop, per-example data
dropped with the pass, and fewer torch calls per step than the per-layer path."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import per_example_reference
from torch import nn

from grad_samplers.linear import linear_norm_sample, linear_weighted_sum
from privacy_engine.clipping import PerSampleGradientClipper, parameter_groups
from privacy_engine.clipping.ghost import GhostClippingModule, batched
from privacy_engine.clipping.ghost import backward as ghost_backward
from privacy_engine.clipping.ghost.uses import Use
from privacy_engine.clipping.rule import clip_factors

MAX_GRAD_NORM = 0.7


def _call(layer: nn.Linear, batch_size: int, dtype: torch.dtype, generator: torch.Generator):
    parts = tuple((p, None) for p in (layer.weight, layer.bias) if p is not None and p.requires_grad)
    use = Use(path="", layer=layer, parts=parts, rank_one_linear=True)
    inputs = torch.randn(batch_size, layer.in_features, dtype=dtype, generator=generator)
    grads = torch.randn(batch_size, layer.out_features, dtype=dtype, generator=generator)
    return batched.rank_one_linear(use, (inputs,), grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_norms_and_sums_equal_the_per_layer_samplers_bit_for_bit(dtype, batch_size):
    """Stacked groups (same shape), single calls, calls above ``STACK_ELEMENTS``, both scaling branches
    (out <= in scales G, out > in scales A), a frozen bias, a frozen weight and per-call clipping columns."""
    generator = torch.Generator().manual_seed(batch_size)
    shapes = [(4, 4)] * 4 + [(3, 9)] * 3 + [(9, 3)] * 2 + [(5, 6), (300, 200), (150, 400)]
    layers = [nn.Linear(i, o).to(dtype) for i, o in shapes]
    layers.append(nn.Linear(4, 4).to(dtype))
    layers[-1].bias.requires_grad_(False)
    layers.append(nn.Linear(4, 4, bias=False).to(dtype))
    layers.append(nn.Linear(4, 4).to(dtype))
    layers[-1].weight.requires_grad_(False)
    calls = [_call(layer, batch_size, dtype, generator) for layer in layers]
    assert all(call is not None for call in calls)
    kept = batched.RankOneLinearLayers()
    squared: dict = {}
    for call in calls:
        kept.add(call, squared)
    assert all(value is None for value in squared.values())  # reserved in backward's order
    kept.squared_norms(squared)
    # Two clipping columns, so stacks of one shape get per-call weights too.
    weights = torch.rand(batch_size, 2, dtype=torch.float32, generator=generator)
    column_of = {p: index % 2 for index, call in enumerate(calls) for p, _ in call.use.parts}
    sums: dict = {}
    kept.weighted_sums(lambda column: (weights[:, column], None), sums, column_of, [])
    for call in calls:
        expected_norms = linear_norm_sample(call.use.layer, (call.inputs,), call.grads)
        expected_sums = linear_weighted_sum(
            call.use.layer, (call.inputs,), call.grads, weights[:, column_of[call.use.parts[0][0]]]
        )
        assert set(expected_norms) == {p for p, _ in call.use.parts}
        for param in expected_norms:
            assert torch.equal(squared[param], expected_norms[param])
            assert torch.equal(sums[param], expected_sums[param])


@pytest.mark.parametrize("drop_row", [False, True])
def test_single_column_gives_the_sums_of_the_per_call_lookup(drop_row):
    """``weighted_sums(..., single_column=c)`` (flat clipping: no lookup per call) adds exactly what the per-call
    column lookup adds: same keys, same tensors bit for bit, with and without rows to drop."""
    generator = torch.Generator().manual_seed(3)
    shapes = [(4, 4)] * 3 + [(3, 9), (300, 200)]
    layers = [nn.Linear(i, o) for i, o in shapes]
    weights = torch.rand(6, 1, generator=generator)
    keep = torch.tensor([True, False, True, True, True, True]) if drop_row else None
    results = []
    for single in (False, True):
        calls = [_call(layer, 6, torch.float32, torch.Generator().manual_seed(index)) for index, layer in enumerate(layers)]
        kept = batched.RankOneLinearLayers()
        squared: dict = {}
        for call in calls:
            kept.add(call, squared)
        kept.squared_norms(squared)
        column_of = {p: 0 for call in calls for p, _ in call.use.parts}
        sums: dict = {}
        fallback: list = []
        kept.weighted_sums(lambda column: (weights[:, column], keep), sums, column_of, fallback, 0 if single else None)
        assert not fallback
        results.append(sums)
    assert list(results[0]) and set(results[0]) == set(results[1])
    for param, value in results[0].items():
        assert torch.equal(value, results[1][param])


def test_calls_it_cannot_do_exactly_are_left_to_the_samplers():
    layer = nn.Linear(4, 3)
    use = Use(path="", layer=layer, parts=((layer.weight, None), (layer.bias, None)), rank_one_linear=True)
    inputs, grads = torch.randn(5, 4), torch.randn(5, 3)
    assert batched.rank_one_linear(use, (inputs,), grads) is not None
    assert batched.rank_one_linear(use, (inputs.half(),), grads.half()) is None  # in_float32 promotes those
    assert batched.rank_one_linear(use, (inputs.double(),), grads) is None  # mixed dtypes (autocast)
    assert batched.rank_one_linear(use, (inputs.unsqueeze(1),), grads.unsqueeze(1)) is None  # positions
    assert batched.rank_one_linear(use, (torch.randn(4, 5).t(),), grads) is None  # not contiguous
    assert batched.rank_one_linear(use, (inputs, inputs), grads) is None
    rows = Use(path="", layer=layer, parts=((layer.weight, slice(0, 2)),), rank_one_linear=True)
    assert batched.rank_one_linear(rows, (inputs,), grads) is None


class DeepMLP(nn.Module):
    """Same-shape layers (stacked), other shapes (single), a frozen bias and a layer without bias."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [
                nn.Linear(6, 4),
                nn.Linear(4, 4),
                nn.Linear(4, 4),
                nn.Linear(4, 4),
                nn.Linear(4, 9),
                nn.Linear(9, 4, bias=False),
            ]
        )
        self.layers[2].bias.requires_grad_(False)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _example_loss(output, target):
    return ((output - target) ** 2).sum(dim=1)


def _ghost_step(
    model, inputs, target, *, batched_path: bool, monkeypatch, per_layer=False, padding=None, sync_free=False
):
    """``model``'s clipped sums and norms from one ghost pass, with or without the batched rank-one path."""
    with monkeypatch.context() as patch:
        if not batched_path:
            patch.setattr(ghost_backward, "rank_one_linear", lambda use, activations, grads: None)
        if sync_free:  # what a CUDA pass does: rows with a zero factor always zeroed, no host sync
            patch.setattr(ghost_backward, "_may_hold_non_finite", lambda norms: True)
        params = [p for p in model.parameters() if p.requires_grad]
        groups = parameter_groups(model, params) if per_layer else None
        clipper = PerSampleGradientClipper(
            params, MAX_GRAD_NORM, clipping="per_layer" if per_layer else "flat", groups=groups
        )
        wrapped = GhostClippingModule(model, clipper=clipper)
        if padding is not None:
            wrapped.set_padding_mask(padding)
        _example_loss(wrapped(inputs), target).mean().backward()
        norms = wrapped.last_per_sample_norms
        assert wrapped._passes.current is None
        clipper.pre_step()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}, norms


def _data(dtype=torch.float32, batch_size=8):
    generator = torch.Generator().manual_seed(3)
    return torch.randn(batch_size, 6, dtype=dtype, generator=generator), torch.randn(
        batch_size, 3, dtype=dtype, generator=generator
    )


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("case", ["finite", "nan row", "padding", "sync-free"])
def test_whole_pass_equals_the_per_layer_path_bit_for_bit(monkeypatch, per_layer, case):
    torch.manual_seed(0)
    model = DeepMLP()
    inputs, target = _data()
    if case == "nan row":
        inputs[2, 1] = float("nan")
    padding = torch.tensor([False, True] + [False] * 6) if case == "padding" else None
    options = {"per_layer": per_layer, "padding": padding}
    reference, reference_norms = _ghost_step(
        copy.deepcopy(model), inputs, target, batched_path=False, monkeypatch=monkeypatch, **options
    )
    sums, norms = _ghost_step(
        copy.deepcopy(model),
        inputs,
        target,
        batched_path=True,
        monkeypatch=monkeypatch,
        sync_free=case == "sync-free",
        **options,
    )
    torch.testing.assert_close(norms, reference_norms, rtol=0, atol=0, equal_nan=True)  # bit for bit, NaN where NaN
    for name in reference:
        assert torch.equal(sums[name], reference[name]), name
        assert torch.isfinite(sums[name]).all()


def test_weight_and_bias_in_different_groups_go_through_the_samplers(monkeypatch):
    """Per-parameter clipping groups split a layer's weight and bias: those calls take the per-layer sums."""
    torch.manual_seed(1)
    model = DeepMLP()
    inputs, target = _data()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [[p] for p in params]

    def step(batched_path):
        copy_ = copy.deepcopy(model)
        copied = [p for p in copy_.parameters() if p.requires_grad]
        with monkeypatch.context() as patch:
            if not batched_path:
                patch.setattr(ghost_backward, "rank_one_linear", lambda use, activations, grads: None)
            clipper = PerSampleGradientClipper(
                copied, [MAX_GRAD_NORM] * len(groups), clipping="per_layer", groups=[[p] for p in copied]
            )
            wrapped = GhostClippingModule(copy_, clipper=clipper)
            _example_loss(wrapped(inputs), target).mean().backward()
            clipper.pre_step()
        return [p.grad for p in copied]

    for got, expected in zip(step(True), step(False)):
        assert torch.equal(got, expected)


def test_float64_equals_the_per_example_loop(monkeypatch):
    torch.manual_seed(2)
    model = DeepMLP().double()
    inputs, target = _data(torch.float64)
    per_sample = per_example_reference(model, (inputs,), lambda out, i: _example_loss(out, target[i : i + 1]).sum())
    norms = torch.sqrt(sum(g.flatten(1).square().sum(dim=1) for g in per_sample.values()))
    factors = clip_factors(norms, MAX_GRAD_NORM)
    sums, got_norms = _ghost_step(copy.deepcopy(model), inputs, target, batched_path=True, monkeypatch=monkeypatch)
    torch.testing.assert_close(got_norms[:, 0], norms, rtol=1e-12, atol=0)
    for name, grads in per_sample.items():
        expected = torch.tensordot(factors, grads, dims=1)
        torch.testing.assert_close(sums[name], expected, rtol=1e-10, atol=1e-12)


def test_per_example_data_does_not_outlive_the_pass(monkeypatch):
    torch.manual_seed(3)
    model = DeepMLP()
    inputs, target = _data()
    seen = []
    original = batched.RankOneLinearLayers.add

    def add(self, call, squared_norms):
        seen.append(self)
        original(self, call, squared_norms)

    monkeypatch.setattr(batched.RankOneLinearLayers, "add", add)
    _ghost_step(model, inputs, target, batched_path=True, monkeypatch=monkeypatch)
    assert seen and all(not kept.calls and not kept._stacks for kept in seen)


def test_fewer_torch_calls_than_the_per_layer_path(monkeypatch):
    """50 x Linear(4, 4): the batched pass runs far fewer top-level torch calls (the fixed cost per layer)."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(50)])
    inputs, target = torch.randn(8, 4), torch.randn(8, 4)

    def count(batched_path):
        copy_ = copy.deepcopy(model)
        with monkeypatch.context() as patch:
            if not batched_path:
                patch.setattr(ghost_backward, "rank_one_linear", lambda use, activations, grads: None)
            clipper = PerSampleGradientClipper(list(copy_.parameters()), MAX_GRAD_NORM)
            wrapped = GhostClippingModule(copy_, clipper=clipper)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                ((wrapped(inputs) - target) ** 2).sum(dim=1).mean().backward()
        top = 0
        for event in profile.events():
            parent = event.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            top += event.name.startswith("aten::") and parent is None
        return top

    assert count(True) < 0.6 * count(False)
