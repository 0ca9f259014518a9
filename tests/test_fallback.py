"""The torch.func fallback (modules with no registered sampler), exercised through GradSampleModule
against the per-example float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_matches_reference, module_fingerprint, per_example_reference
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from grad_samplers import grad_sampler_for
from privacy_engine import GradSampleModule

DOUBLE = torch.float64
EMBED, HEADS, QUERIES, KEYS = 6, 2, 3, 4


class BareParameterWithChild(nn.Module):
    """Owns a bare parameter and a child Linear: the fallback claims the whole subtree."""

    def __init__(self, features: int = 4, out_features: int = 3) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, features))
        self.child = nn.Linear(features, out_features)

    def forward(self, x):
        return self.child(torch.tanh(x * self.gain)) + self.gain[:1]


class BufferedScale(nn.Module):
    """Uses a buffer (a fixed centring) next to its parameter."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.register_buffer("centre", torch.linspace(-1.0, 1.0, features))
        self.scale = nn.Parameter(torch.ones(features))

    def forward(self, x):
        return (x - self.centre) * self.scale


class Scale(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, features))

    def forward(self, x):
        return x * self.gain


def probe_loss(output: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    """A loss that weighs every output element differently, so no gradient is trivially symmetric."""
    return (torch.tanh(output) * probe).sum()


def attention_inputs(batch_first: bool, with_mask: bool, batch_size: int = 3):
    query = torch.randn(batch_size, QUERIES, EMBED, dtype=DOUBLE)
    memory = torch.randn(batch_size, KEYS, EMBED, dtype=DOUBLE)
    if not batch_first:
        query, memory = query.transpose(0, 1).contiguous(), memory.transpose(0, 1).contiguous()
    kwargs = {"need_weights": False}
    if with_mask:
        mask = torch.zeros(batch_size, KEYS, dtype=torch.bool)  # batch first whatever batch_first says
        mask[0, -2:] = True
        mask[-1, -1] = True
        kwargs["key_padding_mask"] = mask
    return (query, memory, memory), kwargs


@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "key_padding_mask"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
def test_multihead_attention_is_exact(batch_first, with_mask):
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(EMBED, HEADS, batch_first=batch_first).to(DOUBLE)
    assert grad_sampler_for(attention) is None  # else this would not test the fallback
    args, kwargs = attention_inputs(batch_first, with_mask)
    batch_dim = 0 if batch_first else 1
    probe = torch.randn_like(args[0])
    reference = per_example_reference(
        attention,
        args,
        lambda out, i: probe_loss(out[0], probe.narrow(batch_dim, i, 1)),
        kwargs=kwargs,
        batch_dim=batch_dim,
        kwarg_batch_dims={"key_padding_mask": 0},
    )
    wrapped = GradSampleModule(attention, batch_first=batch_first, loss_reduction="sum")
    probe_loss(wrapped(*args, **kwargs)[0], probe).backward()
    assert_matches_reference(attention, reference)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
def test_multihead_attention_weights_keep_their_layout(batch_first):
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(EMBED, HEADS, batch_first=batch_first).to(DOUBLE)
    args, _ = attention_inputs(batch_first, with_mask=False)
    expected_output, expected_weights = attention(*args)
    wrapped = GradSampleModule(attention, batch_first=batch_first, loss_reduction="sum")
    output, weights = wrapped(*args)
    assert weights.shape == expected_weights.shape
    torch.testing.assert_close(output, expected_output)
    torch.testing.assert_close(weights, expected_weights)


class SequenceFirstAttentionBlock(nn.Module):
    """A batch-first model holding a sequence-first attention (it transposes around it)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(EMBED, HEADS, batch_first=False)
        self.head = nn.Linear(EMBED, 2)

    def forward(self, x, key_padding_mask):
        sequence_first = x.transpose(0, 1)
        attended, _ = self.attention(sequence_first, sequence_first, sequence_first, key_padding_mask=key_padding_mask)
        return self.head(attended.transpose(0, 1))


def test_sequence_first_attention_inside_a_batch_first_model_is_exact():
    torch.manual_seed(0)
    model = SequenceFirstAttentionBlock().to(DOUBLE)
    x, probe = torch.randn(3, KEYS, EMBED, dtype=DOUBLE), torch.randn(3, KEYS, 2, dtype=DOUBLE)
    mask = torch.zeros(3, KEYS, dtype=torch.bool)
    mask[1, -2:] = True
    reference = per_example_reference(model, (x, mask), lambda out, i: probe_loss(out, probe[i : i + 1]))
    wrapped = GradSampleModule(model, loss_reduction="sum")
    probe_loss(wrapped(x, mask), probe).backward()
    assert_matches_reference(model, reference)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
def test_transformer_encoder_layer_is_exact(batch_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, dim_feedforward=8, dropout=0.0, batch_first=batch_first)
    layer = layer.to(DOUBLE)
    batch_dim = 0 if batch_first else 1
    source = torch.randn(3, KEYS, EMBED, dtype=DOUBLE)
    if not batch_first:
        source = source.transpose(0, 1).contiguous()
    mask = torch.zeros(3, KEYS, dtype=torch.bool)
    mask[2, -1] = True
    probe = torch.randn_like(source)
    reference = per_example_reference(
        layer,
        (source,),
        lambda out, i: probe_loss(out, probe.narrow(batch_dim, i, 1)),
        kwargs={"src_key_padding_mask": mask},
        batch_dim=batch_dim,
        kwarg_batch_dims={"src_key_padding_mask": 0},
    )
    wrapped = GradSampleModule(layer, batch_first=batch_first, loss_reduction="sum")
    probe_loss(wrapped(source, src_key_padding_mask=mask), probe).backward()
    assert_matches_reference(layer, reference)


def test_multihead_attention_with_dropout_sums_to_the_real_gradient():
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(EMBED, HEADS, dropout=0.5, batch_first=True).to(DOUBLE)
    args, _ = attention_inputs(batch_first=True, with_mask=False, batch_size=4)
    wrapped = GradSampleModule(attention, loss_reduction="mean")
    output, _ = wrapped(*args)
    with torch.no_grad():
        no_dropout, _ = attention.eval()(*args)
        attention.train()
    assert not torch.allclose(output, no_dropout)  # dropout was active (else this test could not fail)
    (output**2).mean().backward()
    for name, param in attention.named_parameters():
        torch.testing.assert_close(param.grad_sample.sum(0), 4 * param.grad, rtol=1e-6, atol=1e-10, msg=name)


@pytest.mark.parametrize("channels_at_dim_1", [False, True], ids=["features", "channels_by_length"])
def test_prelu_is_exact(channels_at_dim_1):
    torch.manual_seed(0)
    if channels_at_dim_1:  # (batch, channels, length): PReLU's weight runs over dim 1
        model = nn.Sequential(nn.PReLU(2), nn.Linear(5, 3), nn.PReLU()).to(DOUBLE)
        x, probe = torch.randn(4, 2, 5, dtype=DOUBLE), torch.randn(4, 2, 3, dtype=DOUBLE)
    else:
        model = nn.Sequential(nn.Linear(5, 4), nn.PReLU(4), nn.Linear(4, 3), nn.PReLU()).to(DOUBLE)
        x, probe = torch.randn(4, 5, dtype=DOUBLE), torch.randn(4, 3, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: probe_loss(out, probe[i : i + 1]))
    wrapped = GradSampleModule(model, loss_reduction="sum")
    probe_loss(wrapped(x), probe).backward()
    assert_matches_reference(model, reference)


def test_bare_parameter_with_child_linear_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), BareParameterWithChild()).to(DOUBLE)
    x, probe = torch.randn(4, 5, dtype=DOUBLE), torch.randn(4, 3, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: probe_loss(out, probe[i : i + 1]))
    wrapped = GradSampleModule(model, loss_reduction="sum")
    probe_loss(wrapped(x), probe).backward()
    assert_matches_reference(model, reference)


def test_modules_with_buffers_are_exact_and_buffers_untouched():
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4)
    norm.running_mean.uniform_(-1, 1)
    norm.running_var.uniform_(0.5, 2)
    norm.eval()  # frozen statistics, trainable affine: allowed, and the affine needs per-sample grads
    model = nn.Sequential(nn.Linear(5, 4), BufferedScale(), norm, nn.Linear(4, 3)).to(DOUBLE)
    buffers = {name: value.clone() for name, value in model.named_buffers()}
    x, probe = torch.randn(4, 5, dtype=DOUBLE), torch.randn(4, 3, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: probe_loss(out, probe[i : i + 1]))
    wrapped = GradSampleModule(model, loss_reduction="sum")
    probe_loss(wrapped(x), probe).backward()
    assert_matches_reference(model, reference)
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name


def test_parameter_shared_by_two_fallback_modules_sums_both_uses():
    torch.manual_seed(0)
    first, second = Scale(4), Scale(4)
    second.gain = first.gain
    model = nn.Sequential(first, nn.Tanh(), second, nn.Linear(4, 2)).to(DOUBLE)
    x, probe = torch.randn(3, 4, dtype=DOUBLE), torch.randn(3, 2, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: probe_loss(out, probe[i : i + 1]))
    wrapped = GradSampleModule(model, loss_reduction="sum")
    probe_loss(wrapped(x), probe).backward()
    assert_matches_reference(model, reference)


def test_frozen_parameter_inside_a_fallback_module_gets_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(BareParameterWithChild(5, 3)).to(DOUBLE)
    model[0].child.weight.requires_grad_(False)
    x, probe = torch.randn(3, 5, dtype=DOUBLE), torch.randn(3, 3, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: probe_loss(out, probe[i : i + 1]))
    wrapped = GradSampleModule(model, loss_reduction="sum")
    probe_loss(wrapped(x), probe).backward()
    assert_matches_reference(model, reference)
    assert getattr(model[0].child.weight, "grad_sample", None) is None


def test_user_forward_hooks_on_a_fallback_module_run_once_per_call():
    model = nn.Sequential(nn.Linear(5, 4), Scale(4)).to(DOUBLE)
    calls = []
    model[1].register_forward_hook(lambda module, args, output: calls.append(output.shape))
    wrapped = GradSampleModule(model)
    wrapped(torch.randn(3, 5, dtype=DOUBLE)).sum().backward()
    assert calls == [torch.Size([3, 4])]


class AttentionThenBareParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(EMBED, HEADS, batch_first=True)
        self.tail = BareParameterWithChild(EMBED)

    def forward(self, x):
        return self.tail(self.attention(x, x, x, need_weights=False)[0])


def test_fallback_modules_are_restored_by_to_standard_module():
    model = AttentionThenBareParameter()
    before = module_fingerprint(model)
    wrapped = GradSampleModule(model)
    wrapped(torch.randn(2, QUERIES, EMBED)).sum().backward()
    assert model.attention.in_proj_weight.grad_sample is not None
    assert wrapped.to_standard_module() is model
    assert module_fingerprint(model) == before


@settings(max_examples=10, deadline=None)
@given(
    batch_size=st.integers(1, 4),
    features=st.integers(1, 5),
    hidden=st.integers(1, 5),
    sequence=st.integers(0, 3),
    loss_reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_through_the_fallback_match_reference(batch_size, features, hidden, sequence, loss_reduction, seed):
    torch.manual_seed(seed)
    prelu = nn.PReLU() if sequence else nn.PReLU(hidden)  # per-channel PReLU wants channels at dim 1
    model = nn.Sequential(
        nn.Linear(features, hidden), prelu, BufferedScale(hidden), BareParameterWithChild(hidden, 2)
    ).to(DOUBLE)
    middle = (sequence,) if sequence else ()
    x = torch.randn(batch_size, *middle, features, dtype=DOUBLE)
    target = torch.randn(batch_size, *middle, 2, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: F.mse_loss(out, target[i : i + 1], reduction="sum"))
    wrapped = GradSampleModule(model, loss_reduction=loss_reduction)
    loss = F.mse_loss(wrapped(x), target, reduction="sum")
    if loss_reduction == "mean":
        loss = loss / batch_size
    loss.backward()
    assert_matches_reference(model, reference)
