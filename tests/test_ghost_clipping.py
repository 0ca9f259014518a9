"""Ghost clipping (``GhostClippingModule``): the per-example norms and the clipped sum from ONE backward
pass equal a float64 per-example loop (1e-10) and the materialised path (``GradSampleModule`` +
``clip_and_accumulate``: 1e-10 in float64, 1e-5 in float32) for every layer type and the benchmark
models; and the book-keeping rules (tied weights, frozen parameters, in-place ops, virtual steps,
padding, NaN, no weight-gradient product in backward) and errors."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from conftest import module_fingerprint, per_example_reference
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from grad_samplers.linear import (
    linear_grad_sample,
    linear_squared_norms,
    linear_weight_norm_form,
    linear_weighted_sums,
)
from privacy_engine import GradSampleModule, ParameterUsageError, connect_private
from privacy_engine.clipping import PerSampleGradientClipper, parameter_groups
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.clipping.ghost import backward as ghost_clipping
from privacy_engine.clipping.rule import clip_factors
from privacy_engine.noise import BandMFNoise, GaussianNoise
from privacy_engine.training.optimizer import DPOptimizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from workloads import build_cnn, build_mlp, build_transformer

DOUBLE = torch.float64
MAX_GRAD_NORM = 0.7


# ---------------------------------------------------------------------------------------------- helpers
def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def example_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-example squared errors ``(batch,)``."""
    return ((output - target) ** 2).flatten(1).sum(dim=1)


def _clipped(per_sample: dict, max_grad_norm, keep=None):
    """(name -> sum_i f_i g_i, per-example norms, name -> sum_i f_i ||g_i||) for flat clipping."""
    norms = torch.sqrt(sum(g.flatten(1).double().square().sum(dim=1) for g in per_sample.values()))
    factors = clip_factors(norms, max_grad_norm)
    if keep is not None:
        factors = torch.where(keep, factors, torch.zeros_like(factors))
    sums = {name: torch.tensordot(factors.to(g.dtype), g, dims=1) for name, g in per_sample.items()}
    # The scale of the summed terms: a sum that cancels is only as exact as its terms are large.
    scales = {name: float(factors @ g.flatten(1).double().norm(dim=1)) for name, g in per_sample.items()}
    return sums, norms, scales


def reference_clipped_sum(model, inputs, target, max_grad_norm=MAX_GRAD_NORM, keep=None):
    """The float64 per-example loop's clipped sums, norms and term scales; ``keep`` selects examples."""
    per_sample = per_example_reference(model, inputs, lambda out, i: example_loss(out, target[i : i + 1]).sum())
    return _clipped(per_sample, max_grad_norm, keep)


def _clipper(model, max_grad_norm, per_layer):
    params = trainable(model)
    if per_layer:
        return PerSampleGradientClipper(params, max_grad_norm, clipping="per_layer", groups=parameter_groups(model, params))
    return PerSampleGradientClipper(params, max_grad_norm)


def ghost_clipped_sum(model, inputs, target, max_grad_norm=MAX_GRAD_NORM, reduction="mean", per_layer=False):
    wrapped = GhostClippingModule(model, loss_reduction=reduction)
    clipper = _clipper(model, max_grad_norm, per_layer)
    wrapped.attach_clipper(clipper)
    losses = example_loss(wrapped(*inputs), target)
    (losses.mean() if reduction == "mean" else losses.sum()).backward()
    norms = wrapped.last_per_sample_norms
    clipper.pre_step()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, norms


def materialised_clipped_sum(model, inputs, target, max_grad_norm=MAX_GRAD_NORM, per_layer=False):
    """The materialised path's clipped sums and (flat clipping) the scale of their terms."""
    wrapped = GradSampleModule(model)
    clipper = _clipper(model, max_grad_norm, per_layer)
    example_loss(wrapped(*inputs), target).mean().backward()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    _, _, scales = _clipped({n: p.grad_sample for n, p in named}, max_grad_norm if not per_layer else float("inf"))
    clipper.clip_and_accumulate()
    clipper.pre_step()
    return {n: p.grad for n, p in named}, scales


def assert_relatively_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, name: str = "", scale=None) -> None:
    """``||actual - expected|| <= rtol * scale``, ``scale`` by default ``||expected||``; pass the size of
    the summed terms (``sum_i f_i ||g_i||``) for sums that cancel, whose rounding is relative to it."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = float(expected.double().norm()) if scale is None else scale
    error = float((actual.double() - expected.double()).norm())
    assert error <= rtol * scale + 1e-300, f"{name}: error {error:.3g} > {rtol} x scale {scale:.3g}"


# ---------------------------------------------------------------------------------------------- models
class Scale(nn.Module):
    """A bare parameter: no sampler, so the torch.func fallback materialises it."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return x * self.weight


class TiedEmbeddings(nn.Module):
    def __init__(self, vocab: int = 7, dim: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.unembed = nn.Linear(dim, vocab, bias=False)
        self.unembed.weight = self.embed.weight

    def forward(self, tokens):
        return self.unembed(torch.tanh(self.mix(self.embed(tokens))))


class TwiceCalled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.shared(torch.tanh(self.shared(x))))


class Attention(nn.Module):
    """MultiheadAttention with fixed call options (masks are attributes: the per-example reference
    narrows every argument to one example)."""

    def __init__(self, cross: bool = False, need_weights: bool = False, masked: bool = False, **options) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, **options)
        self.cross, self.need_weights, self.masked = cross, need_weights, masked

    def forward(self, x, memory=None):
        key = memory if self.cross else x
        batch_first = self.attention.batch_first
        attn_mask = key_padding_mask = None
        if self.masked:
            attn_mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)  # causal
            key_padding_mask = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool, device=x.device)
            key_padding_mask[:, -1] = True
        if not batch_first:
            x, key = x.transpose(0, 1), key.transpose(0, 1)
        out, _ = self.attention(
            x, key, key, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=self.need_weights
        )
        return out if batch_first else out.transpose(0, 1)


def _case(builder, *input_shapes, tokens=None):
    """(model, inputs, target) in float64 with a target shaped like the output."""

    def make(seed: int = 0, batch_size: int = 4):
        torch.manual_seed(seed)
        model = builder().to(DOUBLE)
        if tokens is not None:
            inputs = (torch.randint(0, tokens, (batch_size, *input_shapes[0])),)
        else:
            inputs = tuple(torch.randn(batch_size, *shape, dtype=DOUBLE) for shape in input_shapes)
        with torch.no_grad():
            target = torch.randn_like(model(*inputs))
        return model, inputs, target

    return make


CASES = {
    "linear_rank_one": _case(lambda: nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=True), nn.Linear(5, 3)), (6,)),
    "linear_gram": _case(lambda: nn.Sequential(nn.Linear(32, 24), nn.ReLU(inplace=True), nn.Linear(24, 20)), (3, 32)),
    "linear_direct": _case(lambda: nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 3)), (9, 3)),
    "conv1d": _case(lambda: nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Conv1d(4, 2, 2, groups=2)), (3, 9)),
    "conv2d": _case(lambda: nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.Tanh(), nn.Conv2d(4, 3, 2)), (2, 7, 7)),
    "conv3d": _case(lambda: nn.Conv3d(2, 3, 2, padding_mode="circular", padding=1), (2, 3, 3, 3)),
    "conv_transpose2d": _case(lambda: nn.ConvTranspose2d(2, 3, 3, stride=2), (2, 4, 4)),
    "embedding": _case(lambda: nn.Sequential(nn.Embedding(11, 4, padding_idx=0), nn.Linear(4, 3)), (6,), tokens=11),
    "embedding_bag": _case(lambda: nn.EmbeddingBag(9, 3, mode="mean"), (5,), tokens=9),
    "layer_norm": _case(lambda: nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2)), (5, 4)),
    "group_norm": _case(lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4)), (2, 5, 5)),
    "rms_norm": _case(lambda: nn.Sequential(nn.RMSNorm(4), nn.Linear(4, 2)), (3, 4)),
    "instance_norm": _case(lambda: nn.Sequential(nn.InstanceNorm1d(3, affine=True), nn.Conv1d(3, 2, 2)), (3, 7)),
    "attention_self": _case(lambda: Attention(batch_first=True), (5, 8)),
    "attention_weights": _case(lambda: Attention(need_weights=True, batch_first=True), (5, 8)),
    "attention_cross": _case(lambda: Attention(cross=True, batch_first=True), (5, 8), (3, 8)),
    "attention_masks": _case(lambda: Attention(masked=True, batch_first=True), (5, 8)),
    "attention_kdim_seq_first": _case(lambda: Attention(cross=True, kdim=3, vdim=3), (5, 8), (4, 3)),
    "encoder_layer": _case(
        lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True), (5, 8)
    ),
    "fallback": _case(lambda: nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Linear(4, 2)), (3,)),
    "tied_embeddings": _case(TiedEmbeddings, (5,), tokens=7),
    "layer_called_twice": _case(TwiceCalled, (3, 4)),
}


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("case", sorted(CASES))
def test_clipped_sum_and_norms_match_per_example_loop_float64(case):
    model, inputs, target = CASES[case]()
    expected, expected_norms, scales = reference_clipped_sum(model, inputs, target)
    sums, norms = ghost_clipped_sum(copy.deepcopy(model), inputs, target)
    assert set(sums) == set(expected)
    torch.testing.assert_close(norms[:, 0], expected_norms, rtol=1e-10, atol=0)
    for name in expected:
        assert_relatively_close(sums[name], expected[name], 1e-10, name, scales[name])


@pytest.mark.parametrize("case", sorted(CASES))
def test_clipped_sum_matches_materialised_path_float32(case):
    model, inputs, target = CASES[case](seed=1)
    model = model.float()
    inputs = tuple(x.float() if x.is_floating_point() else x for x in inputs)
    target = target.float()
    expected, scales = materialised_clipped_sum(copy.deepcopy(model), inputs, target)
    sums, _ = ghost_clipped_sum(copy.deepcopy(model), inputs, target)
    for name in expected:
        assert_relatively_close(sums[name], expected[name], 1e-5, name, scales[name])


def _benchmark_model(name: str) -> tuple[nn.Module, tuple, torch.Tensor]:
    torch.manual_seed(3)
    if name == "mlp":
        return build_mlp(), (torch.randn(3, 784),), torch.randint(0, 10, (3,))
    if name == "cnn":
        return build_cnn(), (torch.randn(3, 1, 28, 28),), torch.randint(0, 10, (3,))
    model = build_transformer()
    for module in model.modules():  # dropout draws differ between paths; compare without it
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0
    return model, (torch.randint(0, 8000, (2, 64)),), torch.randint(0, 2, (2,))


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (DOUBLE, 1e-10)])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_benchmark_models_match_materialised_path(name, dtype, rtol):
    model, inputs, labels = _benchmark_model(name)
    model = model.to(dtype)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    results = []
    for wrapper in (GradSampleModule, GhostClippingModule):
        copy_ = copy.deepcopy(model)
        wrapped = wrapper(copy_)
        clipper = PerSampleGradientClipper(trainable(copy_), 1.0)
        if wrapper is GhostClippingModule:
            wrapped.attach_clipper(clipper)
        nn.functional.cross_entropy(wrapped(*inputs), labels).backward()
        if wrapper is GradSampleModule:
            _, _, scales = _clipped({n: p.grad_sample for n, p in copy_.named_parameters()}, 1.0)
            clipper.clip_and_accumulate()
        stats = clipper.pre_step()
        results.append(({n: p.grad for n, p in copy_.named_parameters()}, stats))
    (materialised, materialised_stats), (ghost, ghost_stats) = results
    for param_name in materialised:
        assert_relatively_close(ghost[param_name], materialised[param_name], rtol, param_name, scales[param_name])
    assert ghost_stats.max_per_sample_norm == pytest.approx(materialised_stats.max_per_sample_norm, rel=rtol)


# ---------------------------------------------------------------------------------------------- Linear forms
@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 4),
    positions=st.sampled_from([(), (1,), (3,), (2, 3)]),
    in_features=st.integers(1, 9),
    out_features=st.integers(1, 9),
)
def test_linear_norms_and_sums_equal_materialised(batch, positions, in_features, out_features):
    generator = torch.Generator().manual_seed(batch * 100 + in_features * 10 + out_features)
    layer = nn.Linear(in_features, out_features).to(DOUBLE)
    inputs = torch.randn(batch, *positions, in_features, dtype=DOUBLE, generator=generator)
    grads = torch.randn(batch, *positions, out_features, dtype=DOUBLE, generator=generator)
    weights = torch.rand(batch, dtype=DOUBLE, generator=generator)
    per_sample = linear_grad_sample(layer, (inputs,), grads)
    weight_norms, bias_norms = linear_squared_norms(inputs, grads)
    weight_sum, bias_sum = linear_weighted_sums(inputs, grads, weights)
    for param, norms, total in ((layer.weight, weight_norms, weight_sum), (layer.bias, bias_norms, bias_sum)):
        torch.testing.assert_close(norms, per_sample[param].flatten(1).square().sum(1), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(total, torch.tensordot(weights, per_sample[param], 1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "positions, in_features, out_features, form",
    [(1, 784, 512, "rank_one"), (3, 32, 24, "gram"), (64, 128, 384, "gram"), (196, 64, 16, "direct"), (9, 3, 2, "direct")],
)
def test_linear_norm_form_is_the_cheapest(positions, in_features, out_features, form):
    assert linear_weight_norm_form(positions, in_features, out_features) == form
    assert linear_squared_norms(torch.zeros(2, positions, in_features), torch.zeros(2, positions, out_features))[0].shape == (2,)


@pytest.mark.parametrize("form_shape", [(1, 5, 4), (3, 32, 24), (9, 3, 2)])
def test_linear_norms_float32_within_1e5(form_shape):
    positions, in_features, out_features = form_shape
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(6, positions, in_features, generator=generator)
    grads = torch.randn(6, positions, out_features, generator=generator)
    exact = linear_squared_norms(inputs.double(), grads.double())[0]
    torch.testing.assert_close(linear_squared_norms(inputs, grads)[0].double(), exact, rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------------- book-keeping
_PRODUCTS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default})


class _MatmulCounter(TorchDispatchMode):

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in _PRODUCTS
        return func(*args, **(kwargs or {}))


def test_backward_computes_no_weight_gradient_product():
    """Plain backward of a 3-layer MLP: 3 weight-gradient + 2 input-gradient products. Ghost: the 2
    input-gradient products + 3 weighted sums (the clipped sums), nothing else; .grad stays empty."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 2))
    inputs = torch.randn(4, 6)
    plain_loss = model(inputs).square().sum()
    with _MatmulCounter() as plain:
        plain_loss.backward()
    # per_sample_memory_ratio=0: no layer keeps per-example gradients (their sums would be
    # (1 x B) @ (B x p) products, counted too).
    wrapped = GhostClippingModule(copy.deepcopy(model), per_sample_memory_ratio=0.0)
    clipper = PerSampleGradientClipper(list(wrapped.parameters()), 1.0)
    wrapped.attach_clipper(clipper)
    ghost_loss = wrapped(inputs).square().sum()
    with _MatmulCounter() as ghost:
        ghost_loss.backward()
    assert plain.count == 5
    assert ghost.count == 5
    assert all(p.grad is None for p in wrapped.parameters())
    assert clipper.has_accumulated


def test_frozen_parameters_are_left_out():
    model, inputs, target = CASES["linear_gram"]()
    model[0].bias.requires_grad_(False)
    model[2].requires_grad_(False)
    expected, _, _ = reference_clipped_sum(model, inputs, target)
    sums, _ = ghost_clipped_sum(copy.deepcopy(model), inputs, target)
    assert set(sums) == {"0.weight"} == set(expected)
    assert_relatively_close(sums["0.weight"], expected["0.weight"], 1e-10)


def test_in_place_op_on_gated_outputs_of_every_shape():
    """ReLU(inplace=True) right after gated layers whose outputs are fresh (2-D Linear), reshaped views
    (Conv1d) and 3-D products: backward still works and stays exact."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(2, 3, 2), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(12, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)
    ).to(DOUBLE)
    inputs = (torch.randn(3, 2, 5, dtype=DOUBLE),)
    target = torch.randn(3, 2, dtype=DOUBLE)
    expected, _, _ = reference_clipped_sum(model, inputs, target)
    sums, _ = ghost_clipped_sum(copy.deepcopy(model), inputs, target)
    for name in expected:
        assert_relatively_close(sums[name], expected[name], 1e-10, name)


def test_eval_mode_and_no_grad_run_the_plain_forward():
    model, inputs, _ = CASES["attention_cross"]()
    wrapped = GhostClippingModule(copy.deepcopy(model))  # no clipper: not needed outside training
    with torch.no_grad():
        torch.testing.assert_close(wrapped(*inputs), model(*inputs))
    wrapped.eval()
    model.eval()
    torch.testing.assert_close(wrapped(*inputs), model(*inputs))
    assert len(wrapped._pending) == 0


def test_non_finite_example_contributes_exactly_zero():
    """An example with a NaN input has a NaN norm: its factor is 0 and its rows are zeroed, so the sum is
    the reference over the other examples. (The materialised path with nan_safe=True keeps the finite
    entries of that example instead; here the whole example is dropped.)"""
    model, inputs, target = CASES["linear_gram"]()
    expected, _, _ = reference_clipped_sum(model, inputs, target, keep=torch.tensor([True, False, True, True]))
    poisoned = inputs[0].clone()
    poisoned[1, 0, 0] = float("nan")
    sums, norms = ghost_clipped_sum(copy.deepcopy(model), (poisoned,), target)
    assert torch.isnan(norms[1, 0]) and torch.isfinite(norms[[0, 2, 3], 0]).all()
    for name in expected:
        assert torch.isfinite(sums[name]).all()
        assert_relatively_close(sums[name], expected[name], 1e-10, name)


@pytest.mark.parametrize("through_source", [False, True])
def test_padding_examples_contribute_zero(through_source):
    model, inputs, target = CASES["conv2d"]()
    padding = torch.tensor([False, True, False, True])
    expected, _, _ = reference_clipped_sum(model, inputs, target, keep=~padding)
    copy_ = copy.deepcopy(model)
    clipper = PerSampleGradientClipper(trainable(copy_), MAX_GRAD_NORM)
    wrapped = GhostClippingModule(copy_)
    wrapped.attach_clipper(clipper, padding_mask_source=(lambda: padding) if through_source else None)
    if not through_source:
        wrapped.set_padding_mask(padding)
    example_loss(wrapped(*inputs), target).mean().backward()
    stats = clipper.pre_step()
    assert stats.num_examples == 2
    for name, param in copy_.named_parameters():
        assert_relatively_close(param.grad, expected[name], 1e-10, name)


def test_virtual_steps_accumulate_over_backward_passes():
    model, inputs, target = CASES["encoder_layer"](batch_size=5)
    expected, _, _ = reference_clipped_sum(model, inputs, target)
    copy_ = copy.deepcopy(model)
    clipper = PerSampleGradientClipper(trainable(copy_), MAX_GRAD_NORM)
    wrapped = GhostClippingModule(copy_, loss_reduction="sum", clipper=clipper)
    for part in (slice(0, 2), slice(2, 5)):
        example_loss(wrapped(inputs[0][part]), target[part]).sum().backward()
    clipper.pre_step()
    for name, param in copy_.named_parameters():
        assert_relatively_close(param.grad, expected[name], 1e-10, name)


def test_per_layer_clipping_matches_materialised_path():
    model, inputs, target = CASES["attention_masks"]()
    num_groups = len(parameter_groups(model, trainable(model)))
    bounds = [0.05 * (i + 1) for i in range(num_groups)]
    expected, _ = materialised_clipped_sum(copy.deepcopy(model), inputs, target, bounds, per_layer=True)
    sums, norms = ghost_clipped_sum(copy.deepcopy(model), inputs, target, bounds, per_layer=True)
    assert norms.shape == (4, num_groups)
    for name in expected:
        assert_relatively_close(sums[name], expected[name], 1e-10, name)


def test_batch_second_inputs_and_sum_reduction():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DOUBLE)
    inputs = torch.randn(5, 4, 3, dtype=DOUBLE)  # (positions, batch, features)
    target = torch.randn(5, 4, 2, dtype=DOUBLE)
    per_sample = per_example_reference(
        model, (inputs,), lambda out, i: ((out - target[:, i : i + 1]) ** 2).sum(), batch_dim=1
    )
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in per_sample.values()))
    factors = clip_factors(norms, MAX_GRAD_NORM)
    copy_ = copy.deepcopy(model)
    clipper = PerSampleGradientClipper(trainable(copy_), MAX_GRAD_NORM)
    wrapped = GhostClippingModule(copy_, batch_first=False, loss_reduction="sum", clipper=clipper)
    ((wrapped(inputs) - target) ** 2).sum().backward()
    clipper.pre_step()
    for name, param in copy_.named_parameters():
        assert_relatively_close(param.grad, torch.tensordot(factors, per_sample[name], 1), 1e-10, name)


@pytest.mark.parametrize("max_grad_norm", [0.0, float("inf")])
def test_zero_and_infinite_bounds(max_grad_norm):
    model, inputs, target = CASES["embedding"]()
    sums, _ = ghost_clipped_sum(copy.deepcopy(model), inputs, target, max_grad_norm)
    if max_grad_norm == 0.0:
        assert all(torch.count_nonzero(total) == 0 for total in sums.values())
        return
    plain = copy.deepcopy(model)
    example_loss(plain(*inputs), target).sum().backward()  # unclipped: the ordinary gradient of the sum
    for name, param in plain.named_parameters():
        assert_relatively_close(sums[name], param.grad, 1e-10, name)


def test_empty_batch_accumulates_zeros():
    model, inputs, target = CASES["layer_norm"](batch_size=0)
    sums, norms = ghost_clipped_sum(copy.deepcopy(model), inputs, target, reduction="sum")
    assert norms.shape[0] == 0
    assert all(torch.count_nonzero(total) == 0 for total in sums.values())


@pytest.mark.parametrize("noise", ["gaussian", "bandmf"])
def test_dp_optimizer_step_equals_materialised_step(noise):
    """Same seeds: a DP-SGD / BandMF step with ghost clipping lands on the same parameters."""
    model, inputs, target = CASES["tied_embeddings"]()
    results = []
    for ghost in (False, True):
        copy_ = copy.deepcopy(model)
        mechanism = GaussianNoise(seed=5) if noise == "gaussian" else BandMFNoise([1.0, 0.4], seed=5)
        optimizer = DPOptimizer(
            torch.optim.SGD(copy_.parameters(), lr=0.1), noise_multiplier=0.8, max_grad_norm=MAX_GRAD_NORM,
            expected_batch_size=4, noise=mechanism,
        )  # fmt: skip
        wrapped = GhostClippingModule(copy_, clipper=optimizer.clipper) if ghost else GradSampleModule(copy_)
        connect_private(wrapped, optimizer)
        for _ in range(2):
            optimizer.zero_grad()
            example_loss(wrapped(*inputs), target).mean().backward()
            optimizer.step()
        results.append([p.detach().clone() for p in copy_.parameters()])
    for materialised, ghost in zip(*results):
        assert_relatively_close(ghost, materialised, 1e-10)


@pytest.mark.parametrize("ratio", [0.0, float("inf")])
@pytest.mark.parametrize("case", ["conv2d", "encoder_layer"])
def test_memory_policy_changes_nothing_but_memory(case, ratio):
    """per_sample_memory_ratio 0 (never keep per-example gradients unless needed) and inf (always):
    the same exact result."""
    model, inputs, target = CASES[case]()
    expected, _, scales = reference_clipped_sum(model, inputs, target)
    copy_ = copy.deepcopy(model)
    clipper = PerSampleGradientClipper(trainable(copy_), MAX_GRAD_NORM)
    wrapped = GhostClippingModule(copy_, clipper=clipper, per_sample_memory_ratio=ratio)
    example_loss(wrapped(*inputs), target).mean().backward()
    clipper.pre_step()
    for name, param in copy_.named_parameters():
        assert_relatively_close(param.grad, expected[name], 1e-10, name, scales[name])


def test_negative_memory_ratio_raises():
    with pytest.raises(ValueError, match="per_sample_memory_ratio"):
        GhostClippingModule(nn.Linear(2, 2), per_sample_memory_ratio=-1.0)


class PlainMatrix(nn.Linear):
    """A Linear subclass: registered below with a grad sampler only (no norm or weighted-sum form)."""


@pytest.mark.parametrize("width, re_formed", [(1, False), (24, True)])
def test_layer_without_norm_sampler_materialises(restore_sampler_registry, monkeypatch, width, re_formed):
    """Without a norm sampler the per-example gradients are formed: kept to the end of backward when
    they are smaller than the layer's inputs and output gradient (width 1), otherwise reduced to norms
    and freed, the sum then re-formed from the kept inputs (width 24). Both exact; the subclass is not
    known to leave its output unsaved, so the gate copies it."""
    restore_sampler_registry.register_grad_sampler(PlainMatrix)(linear_grad_sample)
    re_formations = []
    original = ghost_clipping._weighted_sum_by_materialising
    monkeypatch.setattr(
        ghost_clipping, "_weighted_sum_by_materialising", lambda *a: re_formations.append(1) or original(*a)
    )
    torch.manual_seed(0)
    model = nn.Sequential(PlainMatrix(12, width), nn.ReLU(inplace=True), nn.Linear(width, 2)).to(DOUBLE)
    inputs = (torch.randn(4, 2, 12, dtype=DOUBLE),)
    target = torch.randn(4, 2, 2, dtype=DOUBLE)
    expected, _, scales = reference_clipped_sum(model, inputs, target)
    sums, _ = ghost_clipped_sum(copy.deepcopy(model), inputs, target)
    assert bool(re_formations) == re_formed
    for name in expected:
        assert_relatively_close(sums[name], expected[name], 1e-10, name, scales[name])


# ---------------------------------------------------------------------------------------------- errors
class ReadsWeightDirectly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3)

    def forward(self, x):
        return self.layer(x) + x @ self.layer.weight


def test_parameter_used_outside_its_module_raises_before_grad_changes():
    model = ReadsWeightDirectly()
    wrapped = GhostClippingModule(model, clipper=PerSampleGradientClipper(list(model.parameters()), 1.0))
    with pytest.raises(ParameterUsageError, match="'layer.weight'"):
        wrapped(torch.randn(2, 3)).sum().backward()
    assert model.layer.weight.grad is None


def test_second_backward_through_one_forward_raises():
    model, inputs, target = CASES["linear_gram"]()
    wrapped = GhostClippingModule(model, clipper=PerSampleGradientClipper(trainable(model), 1.0))
    loss = example_loss(wrapped(*inputs), target).mean()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_training_forward_without_clipper_raises():
    wrapped = GhostClippingModule(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="attach_clipper"):
        wrapped(torch.randn(3, 2))


def test_clipper_missing_a_trainable_parameter_raises():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    wrapped = GhostClippingModule(model)
    with pytest.raises(ValueError, match=r"\['1.weight', '1.bias'\]"):
        wrapped.attach_clipper(PerSampleGradientClipper(list(model[0].parameters()), 1.0))
    assert wrapped.clipper is None


def test_unwrapping_leaves_nothing_behind():
    model, inputs, target = CASES["attention_cross"]()
    before = module_fingerprint(model)
    wrapped = GhostClippingModule(model, clipper=PerSampleGradientClipper(trainable(model), 1.0))
    example_loss(wrapped(*inputs), target).mean().backward()
    assert wrapped.to_standard_module() is model
    assert module_fingerprint(model) == before


def test_grad_sample_module_refuses_ghost_mode_and_names_the_fast_clipping_wrapper():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="GhostClippingModule"):
        GradSampleModule(model, grad_sample_mode="ghost")
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    assert type(GradSampleModule(model, grad_sample_mode="hooks")) is GradSampleModule
    with pytest.raises(ValueError, match="grad_sample_mode"):
        GradSampleModule(nn.Linear(2, 2), grad_sample_mode="ghosts")
