"""The fast paths of the per-sample gradient code stay exact.

- ``nn.MultiheadAttention`` under the torch.func fallback runs on its batched ``need_weights=True``
  path whatever the caller asked for (``functorch_fallback``), with its batch layout read from the
  module (``batch_first``, masks, returned weights);
- the fallback calls the module's own forward without re-running its hooks, and keeps arguments that
  are one tensor as one tensor;
- ``linear_grad_sample`` writes straight into (huge-page advised) buffers (``grad_samplers._memory``).

Every exactness check compares with the float64 per-example loop of ``conftest.per_example_reference``.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from conftest import assert_matches_reference, per_example_reference
from torch import nn

from grad_samplers import functorch_fallback
from grad_samplers._memory import advise_huge_pages, empty_per_sample
from privacy_engine import GradSampleModule

DOUBLE = torch.float64
EMBED, HEADS, QUERIES, KEYS, BATCH = 6, 2, 3, 4, 3


def probe_loss(output: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    """Weighs every output element differently, so no gradient is trivially symmetric."""
    return (torch.tanh(output) * probe).sum()


def attention(batch_first: bool, **options) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(EMBED, HEADS, batch_first=batch_first, **options).to(DOUBLE)


def query_and_memory(batch_first: bool, batch_size: int = BATCH):
    query = torch.randn(batch_size, QUERIES, EMBED, dtype=DOUBLE)
    memory = torch.randn(batch_size, KEYS, EMBED, dtype=DOUBLE)
    if not batch_first:
        query, memory = query.transpose(0, 1).contiguous(), memory.transpose(0, 1).contiguous()
    return query, memory


def padding_mask(batch_size: int = BATCH) -> torch.Tensor:
    mask = torch.zeros(batch_size, KEYS, dtype=torch.bool)  # (batch, keys) whatever batch_first says
    mask[0, -2:] = True
    mask[-1, -1] = True
    return mask


def no_vmap_loop_warning(record) -> bool:
    return not any("batching rule" in str(warning.message) for warning in record)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["no_weights", "weights"])
@pytest.mark.parametrize("with_padding", [False, True], ids=["no_mask", "key_padding_mask"])
def test_attention_per_sample_gradients_are_exact(batch_first, need_weights, with_padding):
    layer = attention(batch_first)
    query, memory = query_and_memory(batch_first)
    kwargs = {"need_weights": need_weights}
    if with_padding:
        kwargs["key_padding_mask"] = padding_mask()
    batch_dim = 0 if batch_first else 1
    probe = torch.randn_like(query)

    def loss_of(output, index):
        loss = probe_loss(output[0], probe.narrow(batch_dim, index, 1))
        return loss + output[1].square().sum() if need_weights else loss

    reference = per_example_reference(
        layer,
        (query, memory, memory),
        loss_of,
        kwargs=kwargs,
        batch_dim=batch_dim,
        kwarg_batch_dims={"key_padding_mask": 0},
    )
    wrapped = GradSampleModule(layer, batch_first=batch_first, loss_reduction="sum")
    output, weights = wrapped(query, memory, memory, **kwargs)
    assert (weights is not None) == need_weights
    loss = probe_loss(output, probe) + (weights.square().sum() if need_weights else 0)
    loss.backward()
    assert_matches_reference(layer, reference)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
@pytest.mark.parametrize("average", [True, False], ids=["averaged", "per_head"])
def test_attention_outputs_equal_the_module_outputs(batch_first, average):
    layer = attention(batch_first)
    query, memory = query_and_memory(batch_first)
    expected_output, expected_weights = layer(query, memory, memory, average_attn_weights=average)
    wrapped = GradSampleModule(layer, batch_first=batch_first, loss_reduction="sum")
    output, weights = wrapped(query, memory, memory, average_attn_weights=average)
    torch.testing.assert_close(output, expected_output)
    torch.testing.assert_close(weights, expected_weights)


def test_attention_self_attention_runs_batched_without_a_vmap_loop():
    layer = attention(True)
    query, _ = query_and_memory(True)
    wrapped = GradSampleModule(layer, loss_reduction="sum")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        output, weights = wrapped(query, query, query, need_weights=False)
    assert weights is None
    assert no_vmap_loop_warning(record), [str(w.message) for w in record]
    torch.testing.assert_close(output, layer(query, query, query, need_weights=False)[0])


def test_attention_three_dimensional_attn_mask_is_split_per_example():
    layer = attention(True)
    query, memory = query_and_memory(True)
    mask = torch.randn(BATCH * HEADS, QUERIES, KEYS, dtype=DOUBLE)  # additive, per example and head
    probe = torch.randn_like(query)
    # Example i's mask is rows i*HEADS .. (i+1)*HEADS - 1: a (heads, queries, keys) mask for a batch
    # of one, which per_example_reference's narrowing cannot produce, so the loop is written out.
    reference = {name: [] for name, _ in layer.named_parameters()}
    for i in range(BATCH):
        layer.zero_grad(set_to_none=True)
        example = layer(
            query[i : i + 1], memory[i : i + 1], memory[i : i + 1], attn_mask=mask[i * HEADS : (i + 1) * HEADS]
        )
        probe_loss(example[0], probe[i : i + 1]).backward()
        for name, param in layer.named_parameters():
            reference[name].append(param.grad.clone())
    reference = {name: torch.stack(grads) for name, grads in reference.items()}
    layer.zero_grad(set_to_none=True)
    wrapped = GradSampleModule(layer, loss_reduction="sum")
    probe_loss(wrapped(query, memory, memory, attn_mask=mask, need_weights=False)[0], probe).backward()
    assert_matches_reference(layer, reference)


def test_attention_causal_hint_with_its_mask_is_exact():
    layer = attention(True)
    query, _ = query_and_memory(True)
    causal = nn.Transformer.generate_square_subsequent_mask(QUERIES, dtype=DOUBLE)
    kwargs = {"attn_mask": causal, "is_causal": True, "need_weights": False}
    probe = torch.randn_like(query)
    reference = per_example_reference(
        layer, (query, query, query), lambda out, i: probe_loss(out[0], probe[i : i + 1]), kwargs=kwargs
    )
    wrapped = GradSampleModule(layer, loss_reduction="sum")
    probe_loss(wrapped(query, query, query, **kwargs)[0], probe).backward()
    assert_matches_reference(layer, reference)


def test_attention_need_weights_given_positionally_is_honoured():
    layer = attention(True)
    query, memory = query_and_memory(True)
    wrapped = GradSampleModule(layer, loss_reduction="sum")
    output, weights = wrapped(query, memory, memory, None, False)
    assert weights is None
    torch.testing.assert_close(output, layer(query, memory, memory, None, False)[0])


def test_attention_with_dropout_sums_to_the_real_gradient():
    layer = attention(True, dropout=0.5)
    query, _ = query_and_memory(True, batch_size=4)
    wrapped = GradSampleModule(layer, loss_reduction="mean")
    output, _ = wrapped(query, query, query, need_weights=False)
    with torch.no_grad():
        no_dropout = layer.eval()(query, query, query, need_weights=False)[0]
        layer.train()
    assert not torch.allclose(output, no_dropout)  # dropout was drawn (else this test could not fail)
    output.square().mean().backward()
    for name, param in layer.named_parameters():
        torch.testing.assert_close(param.grad_sample.sum(0), 4 * param.grad, rtol=1e-6, atol=1e-10, msg=name)


def test_attention_unbatched_query_is_rejected():
    layer = attention(True)
    wrapped = GradSampleModule(layer)
    unbatched = torch.randn(QUERIES, EMBED, dtype=DOUBLE)
    with pytest.raises(ValueError, match="batched query"):
        wrapped(unbatched, unbatched, unbatched)


class OwnsAttention(nn.Module):
    """Owns a parameter and an attention child: the fallback claims both, the attention is nested."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, EMBED))
        self.attention = nn.MultiheadAttention(EMBED, HEADS, batch_first=True)

    def forward(self, x, mask=None):
        return self.attention(x * self.gain, x, x, key_padding_mask=mask, need_weights=False)[0]


@pytest.mark.parametrize("with_padding", [False, True], ids=["no_mask", "key_padding_mask"])
def test_attention_nested_in_a_fallback_module_is_exact_and_batched(with_padding):
    torch.manual_seed(0)
    model = OwnsAttention().to(DOUBLE)
    x = torch.randn(BATCH, KEYS, EMBED, dtype=DOUBLE)
    args = (x, padding_mask()) if with_padding else (x,)
    probe = torch.randn_like(x)
    reference = per_example_reference(model, args, lambda out, i: probe_loss(out, probe[i : i + 1]))
    wrapped = GradSampleModule(model, loss_reduction="sum")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        output = wrapped(*args)
    assert no_vmap_loop_warning(record), [str(w.message) for w in record]
    probe_loss(output, probe).backward()
    assert_matches_reference(model, reference)
    assert not model.attention._forward_pre_hooks and not model.attention._forward_hooks  # hooks removed


def test_user_hooks_on_a_nested_attention_see_the_call_as_made():
    torch.manual_seed(0)
    model = OwnsAttention().to(DOUBLE)
    seen = []
    model.attention.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["need_weights"]), with_kwargs=True
    )
    model.attention.register_forward_hook(lambda m, args, output: seen.append(output[1]))
    GradSampleModule(model)(torch.randn(BATCH, KEYS, EMBED, dtype=DOUBLE))
    assert seen == [False, None]


class CountsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(EMBED))
        self.same_tensor_seen = []

    def forward(self, a, b):
        self.same_tensor_seen.append(a is b)
        return a * self.gain + b


def test_fallback_runs_user_hooks_once_and_keeps_one_tensor_one_tensor():
    model = CountsCalls().to(DOUBLE)
    calls = []
    model.register_forward_hook(lambda module, args, output: calls.append(tuple(output.shape)))
    x = torch.randn(BATCH, EMBED, dtype=DOUBLE)
    wrapped = GradSampleModule(model, loss_reduction="sum")
    wrapped(x, x).sum().backward()
    assert calls == [(BATCH, EMBED)]
    assert model.same_tensor_seen == [True]
    torch.testing.assert_close(model.gain.grad_sample, x)  # d(sum(a * gain + b))/d gain = a per example


def test_attention_argument_names_match_torch():
    # The fallback maps MultiheadAttention's arguments by position; a torch change must fail here.
    names = tuple(inspect.signature(nn.MultiheadAttention.forward).parameters)[1:]
    assert names == functorch_fallback._ATTENTION_PARAMETERS


def test_transformer_encoder_layer_with_padding_is_exact():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, 8, dropout=0.0, batch_first=True).to(DOUBLE)
    x = torch.randn(BATCH, KEYS, EMBED, dtype=DOUBLE)
    mask = padding_mask()
    probe = torch.randn_like(x)
    reference = per_example_reference(
        layer, (x,), lambda out, i: probe_loss(out, probe[i : i + 1]), kwargs={"src_key_padding_mask": mask}
    )
    wrapped = GradSampleModule(layer, loss_reduction="sum")
    probe_loss(wrapped(x, src_key_padding_mask=mask), probe).backward()
    assert_matches_reference(layer, reference)


# ---------------------------------------------------------------------------------- Linear
@pytest.mark.parametrize("positions", [None, 3], ids=["2d_input", "3d_input"])
def test_linear_per_sample_gradients_are_exact_in_huge_buffers(positions):
    # 6 x 256 x 384 float64 weight gradients = 4.5 MiB: large enough for the huge-page advice path.
    torch.manual_seed(0)
    layer = nn.Linear(384, 256).to(DOUBLE)
    shape = (6, 384) if positions is None else (6, positions, 384)
    x = torch.randn(*shape, dtype=DOUBLE)
    probe = torch.randn(*shape[:-1], 256, dtype=DOUBLE)
    reference = per_example_reference(layer, (x,), lambda out, i: probe_loss(out, probe[i : i + 1]))
    wrapped = GradSampleModule(layer, loss_reduction="sum")
    probe_loss(wrapped(x), probe).backward()
    assert_matches_reference(layer, reference)


def test_huge_page_advice_keeps_contents_and_layout():
    tensor = empty_per_sample((3, 1024, 1024), dtype=torch.float32, device=torch.device("cpu"))
    assert tensor.shape == (3, 1024, 1024) and tensor.is_contiguous()
    advise_huge_pages(tensor)  # advising again after allocation is harmless
    values = torch.arange(tensor.numel(), dtype=torch.float32).reshape(tensor.shape)
    tensor.copy_(values)
    assert torch.equal(tensor, values)
    assert advise_huge_pages(torch.zeros(8)) is False  # small tensors are left alone


@pytest.mark.parametrize("shape", [(0, 5), (0, 4, 5), (2, 0, 5)], ids=["empty_batch", "empty_batch_3d", "no_positions"])
def test_linear_per_sample_gradients_of_empty_inputs_are_zero_sized_or_zero(shape):
    from grad_samplers.linear import linear_grad_sample

    layer = nn.Linear(5, 3).to(DOUBLE)
    inputs = torch.randn(*shape, dtype=DOUBLE)
    backprops = torch.randn(*shape[:-1], 3, dtype=DOUBLE)
    per_sample = linear_grad_sample(layer, (inputs,), backprops)
    assert per_sample[layer.weight].shape == (shape[0], 3, 5)
    assert per_sample[layer.bias].shape == (shape[0], 3)
    # No positions: every example's gradient is exactly zero (never uninitialised memory).
    assert torch.equal(per_sample[layer.weight], torch.zeros(shape[0], 3, 5, dtype=DOUBLE))
