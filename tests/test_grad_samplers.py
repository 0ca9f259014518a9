"""The built-in layer samplers (conv, transposed conv, embeddings, normalisation layers) against an
independent float64 per-example loop.

For each layer family, with randomised shapes and hyper-parameters:

- grad sampler, through ``GradSampleModule`` (both loss reductions; ``batch_first=False`` for the
  sequence layers): ``param.grad_sample[i]`` == the gradient of example ``i``'s loss computed on that
  example alone in an unwrapped copy of the model;
- norm sampler, called directly: == the squared norm of that reference (every form it can choose);
- weighted-sum sampler, called directly: == ``sum_i w_i * reference_i``.

The samplers are fed ``(activations, backprops)`` captured with a forward hook and an output-gradient
hook on an unwrapped copy, scaled as the core scales them (``mean``: times the batch size).
"""

from __future__ import annotations

import copy
import inspect
from unittest import mock

import pytest
import torch
from conftest import ATOL, RTOL, assert_matches_reference, per_example_reference
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import grad_samplers
import grad_samplers.conv as conv_module
import grad_samplers.conv_transpose as conv_transpose_module
import grad_samplers.embedding as embedding_module
from privacy_engine import GradSampleModule

DOUBLE = torch.float64
FEW = settings(max_examples=15, deadline=None)
CHEAP = settings(max_examples=30, deadline=None)  # for tests whose examples take milliseconds


# ------------------------------------------------------------------------------------------ helpers
def loss_terms(output: torch.Tensor, target: torch.Tensor, batch_dim: int) -> torch.Tensor:
    """Each example's own loss: half its squared error (so output gradients depend on the output)."""
    return 0.5 * ((output - target) ** 2).movedim(batch_dim, 0).flatten(1).sum(dim=1)


def example_loss(target: torch.Tensor, batch_dim: int):
    return lambda output, index: loss_terms(output, target.narrow(batch_dim, index, 1), batch_dim).sum()


def batch_loss(terms: torch.Tensor, loss_reduction: str) -> torch.Tensor:
    return terms.sum() if loss_reduction == "sum" else terms.mean()


def check_wrapped(model, args, target, reference, *, loss_reduction: str, batch_first: bool = True, kwargs=None):
    """Wrap ``model``, run one backward of the reduced loss, compare every ``grad_sample`` to ``reference``."""
    batch_dim = 0 if batch_first else 1
    wrapped = GradSampleModule(model, loss_reduction=loss_reduction, batch_first=batch_first)
    batch_loss(loss_terms(wrapped(*args, **(kwargs or {})), target, batch_dim), loss_reduction).backward()
    assert_matches_reference(model, reference)
    wrapped.to_standard_module()


def capture(model, layer, args, target, *, loss_reduction: str, batch_dim: int = 0, kwargs=None):
    """``(activations, backprops)`` as the core hands them to ``layer``'s samplers, from an unwrapped run."""
    store = {}

    def on_forward(module, positional, keyword, output):
        bound = inspect.signature(module.forward).bind(*positional, **keyword)
        bound.apply_defaults()
        store["activations"] = tuple(
            value.detach() if isinstance(value, torch.Tensor) else value for value in bound.arguments.values()
        )
        output.register_hook(lambda grad: store.__setitem__("backprops", grad))

    handle = layer.register_forward_hook(on_forward, with_kwargs=True)
    try:
        model.zero_grad(set_to_none=True)
        batch_loss(loss_terms(model(*args, **(kwargs or {})), target, batch_dim), loss_reduction).backward()
    finally:
        handle.remove()
    backprops = store["backprops"].movedim(batch_dim, 0)
    if loss_reduction == "mean":
        backprops = backprops * backprops.shape[0]
    activations = tuple(
        value.movedim(batch_dim, 0) if isinstance(value, torch.Tensor) and value.dim() > batch_dim else value
        for value in store["activations"]
    )
    return activations, backprops


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def check_norms_and_weighted_sums(layer, activations, backprops, reference_by_param, *, norm_forms=None):
    """Norm sampler (and each forced form in ``norm_forms``: {label: patch context}) and weighted-sum
    sampler of ``layer`` against the per-example reference ``{param: (B, *shape)}``."""
    expected_norms = {p: g.flatten(1).pow(2).sum(dim=1) for p, g in reference_by_param.items()}
    norm_sampler = grad_samplers.norm_sampler_for(layer)
    forms = {"chosen": None, **(norm_forms or {})}
    for label, patch in forms.items():
        if patch is None:
            norms = norm_sampler(layer, activations, backprops)
        else:
            with patch:
                norms = norm_sampler(layer, activations, backprops)
        assert set(norms) == set(expected_norms)
        for param, expected in expected_norms.items():
            assert_close(norms[param], expected, f"norm ({label})")
    batch_size = backprops.shape[0]
    weights = torch.rand(batch_size, dtype=DOUBLE, generator=torch.Generator().manual_seed(batch_size)) * 2 - 0.5
    sums = grad_samplers.weighted_sum_sampler_for(layer)(layer, activations, backprops, weights)
    assert set(sums) == set(reference_by_param)
    for param, per_example in reference_by_param.items():
        assert_close(sums[param], torch.einsum("b,b...->...", weights, per_example), "weighted sum")


def reference_by_param(model, reference, layer):
    names = {id(p): n for n, p in model.named_parameters()}
    return {p: reference[names[id(p)]] for p in layer.parameters(recurse=False) if p.requires_grad}


# ------------------------------------------------------------------------------------------ convolution
@st.composite
def conv_configs(draw):
    dims = draw(st.sampled_from([1, 2, 3]))
    groups = draw(st.sampled_from([1, 2]))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    padding = draw(st.sampled_from(["int", "same", "valid"]))
    stride = (1,) * dims if padding == "same" else tuple(draw(st.integers(1, 2)) for _ in range(dims))
    spans = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    return {
        "dims": dims,
        "in_channels": groups * draw(st.integers(1, 2)),
        "out_channels": groups * draw(st.integers(1, 3)),
        "kernel_size": kernel,
        "stride": stride,
        "padding": draw(st.integers(0, 2)) if padding == "int" else padding,
        "dilation": dilation,
        "groups": groups,
        "bias": draw(st.booleans()),
        "padding_mode": draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"])),
        "size": tuple(max(span, 3) + draw(st.integers(0, 2)) for span in spans),
        "batch_size": draw(st.integers(1, 3)),
        "loss_reduction": draw(st.sampled_from(["sum", "mean"])),
    }


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")
@FEW
@given(config=conv_configs(), seed=st.integers(0, 2**16))
@example(  # 'same' with an even kernel pads asymmetrically, here through reflect padding and groups
    config={
        "dims": 2, "in_channels": 4, "out_channels": 2, "kernel_size": (2, 3), "stride": (1, 1),
        "padding": "same", "dilation": (1, 2), "groups": 2, "bias": True, "padding_mode": "reflect",
        "size": (4, 5), "batch_size": 2, "loss_reduction": "mean",
    },
    seed=1,
)
def test_conv_samplers_match_per_example_reference(config, seed):
    torch.manual_seed(seed)
    layer_type = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[config["dims"] - 1]
    layer = layer_type(
        config["in_channels"],
        config["out_channels"],
        config["kernel_size"],
        stride=config["stride"],
        padding=config["padding"],
        dilation=config["dilation"],
        groups=config["groups"],
        bias=config["bias"],
        padding_mode=config["padding_mode"],
    ).to(DOUBLE)
    model = nn.Sequential(layer, nn.Tanh())
    x = torch.randn(config["batch_size"], config["in_channels"], *config["size"], dtype=DOUBLE)
    target = torch.randn_like(model(x))
    reference = per_example_reference(model, (x,), example_loss(target, 0))

    plain = copy.deepcopy(model)
    activations, backprops = capture(plain, plain[0], (x,), target, loss_reduction=config["loss_reduction"])
    forms = {
        "gram": mock.patch.object(conv_module, "gram_is_cheaper", lambda *a: True),
        "materialised": mock.patch.object(conv_module, "gram_is_cheaper", lambda *a: False),
    }
    layer_reference = reference_by_param(plain, reference, plain[0])
    check_norms_and_weighted_sums(plain[0], activations, backprops, layer_reference, norm_forms=forms)

    check_wrapped(model, (x,), target, reference, loss_reduction=config["loss_reduction"])


def test_conv_frozen_bias_is_left_out():
    layer = nn.Conv2d(2, 3, 2).to(DOUBLE)
    layer.bias.requires_grad_(False)
    x = torch.randn(2, 2, 4, 4, dtype=DOUBLE)
    backprops = torch.randn(2, 3, 3, 3, dtype=DOUBLE)
    for sampler in (grad_samplers.grad_sampler_for(layer), grad_samplers.norm_sampler_for(layer)):
        assert set(sampler(layer, (x,), backprops)) == {layer.weight}
    weights = torch.ones(2, dtype=DOUBLE)
    assert set(grad_samplers.weighted_sum_sampler_for(layer)(layer, (x,), backprops, weights)) == {layer.weight}


def test_conv_rejects_unbatched_input():
    layer = nn.Conv1d(2, 3, 2).to(DOUBLE)
    with pytest.raises(ValueError, match="batched input"):
        unbatched = torch.randn(2, 5, dtype=DOUBLE)
        grad_samplers.grad_sampler_for(layer)(layer, (unbatched,), torch.randn(3, 4, dtype=DOUBLE))


def test_gram_form_is_chosen_only_when_fewer_flops():
    # L*(D+P) < D*P: one output position with wide channels -> Gram; a long signal -> materialise.
    assert conv_module.gram_is_cheaper(num_positions=4, patch_size=576, outputs_per_group=64)
    assert not conv_module.gram_is_cheaper(num_positions=1024, patch_size=27, outputs_per_group=16)
    assert not conv_module.gram_is_cheaper(num_positions=1, patch_size=1, outputs_per_group=1)


# ------------------------------------------------------------------------------------------ transposed convolution
class TransposeWithOutputSize(nn.Module):
    """Calls its ConvTranspose with ``output_size`` (a keyword argument the core binds to a position)."""

    def __init__(self, layer: nn.Module, extra: int) -> None:
        super().__init__()
        self.layer = layer
        self.extra = extra

    def forward(self, x):
        layer = self.layer
        natural = [
            (size - 1) * stride - 2 * pad + dilation * (kernel - 1) + 1
            for size, stride, pad, dilation, kernel in zip(
                x.shape[2:], layer.stride, layer.padding, layer.dilation, layer.kernel_size
            )
        ]
        return torch.tanh(layer(x, output_size=[size + self.extra for size in natural]))


@st.composite
def conv_transpose_configs(draw):
    dims = draw(st.sampled_from([1, 2, 3]))
    groups = draw(st.sampled_from([1, 2]))
    stride = draw(st.integers(1, 3))
    dilation = draw(st.integers(1, 2))
    use_output_size = draw(st.booleans())
    # output_padding must be < max(stride, dilation); output_size only allows < stride extra.
    extra = draw(st.integers(0, (stride if use_output_size else max(stride, dilation)) - 1))
    kernel_size = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    size = tuple(draw(st.integers(2, 4)) for _ in range(dims))
    padding = draw(st.integers(0, 1))
    if any(2 * padding > (s - 1) * stride + dilation * (k - 1) for s, k in zip(size, kernel_size)):
        padding = 0  # padding would crop the whole output
    return {
        "dims": dims,
        "in_channels": groups * draw(st.integers(1, 2)),
        "out_channels": groups * draw(st.integers(1, 3)),
        "kernel_size": kernel_size,
        "stride": stride,
        "padding": padding,
        "dilation": dilation,
        "groups": groups,
        "bias": draw(st.booleans()),
        "use_output_size": use_output_size,
        "extra": extra,
        "size": size,
        "batch_size": draw(st.integers(1, 3)),
        "loss_reduction": draw(st.sampled_from(["sum", "mean"])),
    }


@FEW
@given(config=conv_transpose_configs(), seed=st.integers(0, 2**16))
@example(  # output_padding >= stride, allowed because dilation > stride: the adjoint has a spare position
    config={
        "dims": 1, "in_channels": 2, "out_channels": 4, "kernel_size": (3,), "stride": 1, "padding": 1,
        "dilation": 2, "groups": 2, "bias": True, "use_output_size": False, "extra": 1, "size": (3,),
        "batch_size": 2, "loss_reduction": "mean",
    },
    seed=2,
)
def test_conv_transpose_samplers_match_per_example_reference(config, seed):
    torch.manual_seed(seed)
    layer_type = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[config["dims"] - 1]
    layer = layer_type(
        config["in_channels"],
        config["out_channels"],
        config["kernel_size"],
        stride=config["stride"],
        padding=config["padding"],
        output_padding=0 if config["use_output_size"] else config["extra"],
        dilation=config["dilation"],
        groups=config["groups"],
        bias=config["bias"],
    ).to(DOUBLE)
    if config["use_output_size"]:
        model = TransposeWithOutputSize(layer, config["extra"])
    else:
        model = nn.Sequential(layer, nn.Tanh())
    x = torch.randn(config["batch_size"], config["in_channels"], *config["size"], dtype=DOUBLE)
    target = torch.randn_like(model(x))
    reference = per_example_reference(model, (x,), example_loss(target, 0))

    plain = copy.deepcopy(model)
    plain_layer = plain.layer if config["use_output_size"] else plain[0]
    activations, backprops = capture(plain, plain_layer, (x,), target, loss_reduction=config["loss_reduction"])
    forms = {
        "gram": mock.patch.object(conv_transpose_module, "gram_is_cheaper", lambda *a: True),
        "materialised": mock.patch.object(conv_transpose_module, "gram_is_cheaper", lambda *a: False),
    }
    check_norms_and_weighted_sums(
        plain_layer, activations, backprops, reference_by_param(plain, reference, plain_layer), norm_forms=forms
    )

    check_wrapped(model, (x,), target, reference, loss_reduction=config["loss_reduction"])


# ------------------------------------------------------------------------------------------ nn.Embedding
class SequenceModel(nn.Module):
    """Embedding -> LayerNorm -> Linear over a (time, batch) or (batch, time) token tensor."""

    def __init__(self, vocab: int, dim: int, padding_idx, out_features: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, out_features)
        with torch.no_grad():  # away from the trivial weight 1 / bias 0
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens)))


@FEW
@given(
    vocab=st.integers(2, 6),
    dim=st.integers(1, 4),
    length=st.integers(1, 6),
    batch_size=st.integers(1, 4),
    padding=st.sampled_from([None, 0, -1]),
    batch_first=st.booleans(),
    loss_reduction=st.sampled_from(["sum", "mean"]),
    seed=st.integers(0, 2**16),
)
def test_sequence_model_samplers_match_per_example_reference(
    vocab, dim, length, batch_size, padding, batch_first, loss_reduction, seed
):
    torch.manual_seed(seed)
    model = SequenceModel(vocab, dim, padding).to(DOUBLE)
    batch_dim = 0 if batch_first else 1
    shape = (batch_size, length) if batch_first else (length, batch_size)
    tokens = torch.randint(0, vocab, shape)  # a small vocabulary repeats indices and hits padding_idx
    target = torch.randn_like(model(tokens))
    reference = per_example_reference(model, (tokens,), example_loss(target, batch_dim), batch_dim=batch_dim)
    if padding is not None:
        row = model.embed.padding_idx
        assert reference["embed.weight"][:, row].abs().max() == 0  # the reference agrees: no gradient there

    plain = copy.deepcopy(model)
    for layer, forms in (
        (
            plain.embed,
            {
                "equal-index": mock.patch.object(embedding_module, "_equal_index_is_cheaper", lambda *a: True),
                "segment-sum": mock.patch.object(embedding_module, "_equal_index_is_cheaper", lambda *a: False),
            },
        ),
        (plain.norm, None),
        (plain.head, None),
    ):
        activations, backprops = capture(
            plain, layer, (tokens,), target, loss_reduction=loss_reduction, batch_dim=batch_dim
        )
        linear_samplers = (grad_samplers.norm_sampler_for(layer), grad_samplers.weighted_sum_sampler_for(layer))
        if layer is plain.head and None in linear_samplers:
            continue  # Linear's norm/weighted-sum samplers belong to another file; GSM covers its grad sampler
        layer_reference = reference_by_param(plain, reference, layer)
        check_norms_and_weighted_sums(layer, activations, backprops, layer_reference, norm_forms=forms)

    check_wrapped(model, (tokens,), target, reference, loss_reduction=loss_reduction, batch_first=batch_first)


def test_embedding_padding_row_gets_no_per_sample_gradient():
    layer = nn.Embedding(4, 3, padding_idx=2).to(DOUBLE)
    tokens = torch.tensor([[2, 2, 1], [0, 2, 3]])
    backprops = torch.randn(2, 3, 3, dtype=DOUBLE)
    grads = grad_samplers.grad_sampler_for(layer)(layer, (tokens,), backprops)[layer.weight]
    assert grads[:, 2].abs().max() == 0
    assert_close(grads[0, 1], backprops[0, 2], "row 1 of example 0")


def test_int32_indices_give_the_same_samplers_as_int64():
    embedding, bag = nn.Embedding(6, 2, padding_idx=1).to(DOUBLE), nn.EmbeddingBag(6, 2, mode="mean").to(DOUBLE)
    tokens = torch.tensor([[1, 4, 4], [0, 5, 1]])
    cases = (
        (embedding, (tokens,), torch.randn(2, 3, 2, dtype=DOUBLE)),
        (bag, (tokens.flatten(), torch.tensor([0, 4]), None), torch.randn(2, 2, dtype=DOUBLE)),
    )
    for layer, activations, backprops in cases:
        narrow = tuple(a.int() if isinstance(a, torch.Tensor) else a for a in activations)
        for sampler in (grad_samplers.grad_sampler_for(layer), grad_samplers.norm_sampler_for(layer)):
            expected = sampler(layer, activations, backprops)[layer.weight]
            assert_close(sampler(layer, narrow, backprops)[layer.weight], expected, "int32 indices")


def test_equal_index_form_is_chosen_only_for_short_inputs():
    assert embedding_module._equal_index_is_cheaper(batch_size=32, num_lookups=1, embedding_dim=64)
    assert not embedding_module._equal_index_is_cheaper(batch_size=32, num_lookups=128, embedding_dim=64)


@pytest.mark.parametrize("layer_type", [nn.Embedding, nn.EmbeddingBag])
def test_scale_grad_by_freq_is_rejected(layer_type):
    layer = layer_type(5, 2, scale_grad_by_freq=True).to(DOUBLE)
    tokens = torch.tensor([[1, 1], [1, 2]])
    backprops = torch.randn(2, 2, 2, dtype=DOUBLE) if layer_type is nn.Embedding else torch.randn(2, 2, dtype=DOUBLE)
    activations = (tokens,) if layer_type is nn.Embedding else (tokens, None, None)
    for sampler in (grad_samplers.grad_sampler_for(layer), grad_samplers.norm_sampler_for(layer)):
        with pytest.raises(ValueError, match="scale_grad_by_freq"):
            sampler(layer, activations, backprops)


# ------------------------------------------------------------------------------------------ nn.EmbeddingBag
class BagModel(nn.Module):
    """EmbeddingBag (offsets and per_sample_weights passed by keyword) -> Linear."""

    def __init__(self, bag: nn.EmbeddingBag) -> None:
        super().__init__()
        self.bag = bag
        self.head = nn.Linear(bag.embedding_dim, 2)

    def forward(self, tokens, offsets=None, per_sample_weights=None):
        return self.head(self.bag(tokens, offsets=offsets, per_sample_weights=per_sample_weights))


@st.composite
def bag_batches(draw):
    """A batch of bags in one of the three input layouts, with empty bags allowed where torch allows them."""
    vocab = draw(st.integers(2, 6))
    layout = draw(st.sampled_from(["2d", "offsets", "offsets_last"]))
    num_bags = draw(st.integers(1, 4))
    if layout == "2d":
        length = draw(st.integers(1, 4))
        sizes = [length] * num_bags
    else:
        sizes = [draw(st.integers(0, 4)) for _ in range(num_bags)]
    bags = [[draw(st.integers(0, vocab - 1)) for _ in range(size)] for size in sizes]
    mode = draw(st.sampled_from(["sum", "mean"]))
    return {
        "vocab": vocab,
        "dim": draw(st.integers(1, 3)),
        "layout": layout,
        "bags": bags,
        "mode": mode,
        "weighted": mode == "sum" and draw(st.booleans()),
        "padding_idx": draw(st.sampled_from([None, 0, 1])),
        "loss_reduction": draw(st.sampled_from(["sum", "mean"])),
    }


def bag_inputs(bags, layout, weights_per_bag):
    """(tokens, offsets, per_sample_weights) for ``bags`` in the given layout."""
    if layout == "2d":
        tokens = torch.tensor(bags, dtype=torch.long)
        weights = None if weights_per_bag is None else torch.stack(weights_per_bag)
        return tokens, None, weights
    tokens = torch.tensor([index for bag in bags for index in bag], dtype=torch.long)
    starts = [0]
    for bag in bags:
        starts.append(starts[-1] + len(bag))
    offsets = torch.tensor(starts if layout == "offsets_last" else starts[:-1], dtype=torch.long)
    weights = None if weights_per_bag is None else torch.cat(weights_per_bag)
    return tokens, offsets, weights


@CHEAP
@given(batch=bag_batches(), seed=st.integers(0, 2**16))
@example(  # an empty bag, an all-padding bag and padding inside a mean
    batch={
        "vocab": 4, "dim": 2, "layout": "offsets", "bags": [[1, 0, 1], [], [0, 0], [3]], "mode": "mean",
        "weighted": False, "padding_idx": 0, "loss_reduction": "mean",
    },
    seed=3,
)
@example(
    batch={
        "vocab": 4, "dim": 2, "layout": "offsets_last", "bags": [[2, 2], [], [1, 3, 2]], "mode": "sum",
        "weighted": True, "padding_idx": 3, "loss_reduction": "sum",
    },
    seed=4,
)
def test_embedding_bag_samplers_match_per_bag_reference(batch, seed):
    torch.manual_seed(seed)
    bag_layer = nn.EmbeddingBag(
        batch["vocab"],
        batch["dim"],
        mode=batch["mode"],
        padding_idx=batch["padding_idx"],
        include_last_offset=batch["layout"] == "offsets_last",
    )
    model = BagModel(bag_layer).to(DOUBLE)
    bags = batch["bags"]
    weights_per_bag = (
        [torch.randn(len(bag), dtype=DOUBLE) for bag in bags] if batch["weighted"] else None
    )
    tokens, offsets, per_sample_weights = bag_inputs(bags, batch["layout"], weights_per_bag)
    kwargs = {"offsets": offsets, "per_sample_weights": per_sample_weights}
    target = torch.randn_like(model(tokens, **kwargs))

    # Reference: each bag alone, given to a copy of the model as a one-bag batch of the same layout.
    copy_model = copy.deepcopy(model)
    per_bag = {name: [] for name, _ in copy_model.named_parameters()}
    for index, bag in enumerate(bags):
        copy_model.zero_grad(set_to_none=True)
        one = bag_inputs([bag], batch["layout"], None if weights_per_bag is None else [weights_per_bag[index]])
        output = copy_model(one[0], offsets=one[1], per_sample_weights=one[2])
        loss_terms(output, target[index : index + 1], 0).sum().backward()
        for name, param in copy_model.named_parameters():
            per_bag[name].append(torch.zeros_like(param) if param.grad is None else param.grad.clone())
    reference = {name: torch.stack(grads) for name, grads in per_bag.items()}
    if batch["padding_idx"] is not None:
        assert reference["bag.weight"][:, batch["padding_idx"]].abs().max() == 0

    plain = copy.deepcopy(model)
    activations, backprops = capture(
        plain, plain.bag, (tokens,), target, loss_reduction=batch["loss_reduction"], kwargs=kwargs
    )
    check_norms_and_weighted_sums(plain.bag, activations, backprops, reference_by_param(plain, reference, plain.bag))

    check_wrapped(model, (tokens,), target, reference, loss_reduction=batch["loss_reduction"], kwargs=kwargs)


def test_embedding_bag_max_mode_is_rejected():
    layer = nn.EmbeddingBag(5, 2, mode="max").to(DOUBLE)
    with pytest.raises(ValueError, match="mode='max'"):
        activations = (torch.tensor([[1, 2]]), None, None)
        grad_samplers.grad_sampler_for(layer)(layer, activations, torch.randn(1, 2, dtype=DOUBLE))


def test_embedding_bag_last_offset_must_cover_the_input():
    layer = nn.EmbeddingBag(5, 2, include_last_offset=True).to(DOUBLE)
    tokens, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 3])  # entry 3 lies past the last offset
    with pytest.raises(ValueError, match="last offset"):
        grad_samplers.grad_sampler_for(layer)(layer, (tokens, offsets, None), torch.randn(2, 2, dtype=DOUBLE))


# ------------------------------------------------------------------------------------------ normalisation layers
@st.composite
def norm_configs(draw):
    kind = draw(st.sampled_from(["layer", "rms", "group", "instance"]))
    batch_size = draw(st.integers(1, 3))
    if kind in ("layer", "rms"):
        normalized = tuple(draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 2))))
        leading = tuple(draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 1))))
        if kind == "layer":
            layer = nn.LayerNorm(normalized, bias=draw(st.booleans()))
        else:
            layer = nn.RMSNorm(normalized, eps=draw(st.sampled_from([None, 1e-3])))
        shape = (batch_size, *leading, *normalized)
    elif kind == "group":
        groups = draw(st.integers(1, 3))
        channels = groups * draw(st.integers(1, 2))
        spatial = tuple(draw(st.integers(2, 3)) for _ in range(draw(st.integers(0, 2))))
        if channels == groups and not spatial:
            spatial = (2,)  # a group needs two values for a variance
        layer = nn.GroupNorm(groups, channels)
        shape = (batch_size, channels, *spatial)
    else:
        dims = draw(st.integers(1, 3))
        channels = draw(st.integers(1, 3))
        layer = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[dims - 1](
            channels, affine=True  # running statistics are refused while training (test_fixer)
        )
        shape = (batch_size, channels, *(draw(st.integers(2, 3)) for _ in range(dims)))
    return layer, shape, draw(st.sampled_from(["sum", "mean"]))


@CHEAP
@given(config=norm_configs(), seed=st.integers(0, 2**16))
def test_normalization_samplers_match_per_example_reference(config, seed):
    torch.manual_seed(seed)
    layer, shape, loss_reduction = config
    layer = layer.to(DOUBLE)
    with torch.no_grad():  # away from the trivial weight 1 / bias 0
        for param in layer.parameters():
            param.uniform_(-1.5, 1.5)
    model = nn.Sequential(layer, nn.Tanh())
    x = torch.randn(shape, dtype=DOUBLE)
    target = torch.randn_like(model(x))
    reference = per_example_reference(model, (x,), example_loss(target, 0))

    plain = copy.deepcopy(model)
    activations, backprops = capture(plain, plain[0], (x,), target, loss_reduction=loss_reduction)
    check_norms_and_weighted_sums(plain[0], activations, backprops, reference_by_param(plain, reference, plain[0]))

    check_wrapped(model, (x,), target, reference, loss_reduction=loss_reduction)


def test_normalization_frozen_weight_is_left_out():
    layer = nn.GroupNorm(2, 4).to(DOUBLE)
    layer.weight.requires_grad_(False)
    x, backprops = torch.randn(3, 4, 5, dtype=DOUBLE), torch.randn(3, 4, 5, dtype=DOUBLE)
    assert set(grad_samplers.grad_sampler_for(layer)(layer, (x,), backprops)) == {layer.bias}
    assert set(grad_samplers.norm_sampler_for(layer)(layer, (x,), backprops)) == {layer.bias}


def test_layer_norm_rejects_input_without_batch_dimension():
    layer = nn.LayerNorm(4).to(DOUBLE)
    with pytest.raises(ValueError, match="batch dimension"):
        grad_samplers.grad_sampler_for(layer)(layer, (torch.randn(4, dtype=DOUBLE),), torch.randn(4, dtype=DOUBLE))


# ------------------------------------------------------------------------------------------ registry
@pytest.mark.parametrize(
    "layer_type",
    [
        nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
        nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
        nn.InstanceNorm3d, nn.RMSNorm,
    ],
)
def test_every_builtin_layer_has_all_three_samplers(layer_type):
    from grad_samplers import registry

    assert layer_type in registry.GRAD_SAMPLERS
    assert layer_type in registry.NORM_SAMPLERS
    assert layer_type in registry.WEIGHTED_SUM_SAMPLERS
