"""Behaviour of GradSampleModule: exact per-sample gradients against a per-example float64 loop,
accumulation rules, what is (not) kept in memory, clean unwrapping, and errors for bad input."""

from __future__ import annotations

import copy
import gc
import itertools

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_matches_reference, module_fingerprint, per_example_reference
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from grad_samplers import grad_sampler_for
from privacy_engine import GradSampleModule, ParameterUsageError, UnsupportedModuleError

DOUBLE = torch.float64


def mlp(in_features: int = 5, hidden: int = 4, out_features: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, out_features)).to(DOUBLE)


def squared_error_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).sum()


class TwiceCalled(nn.Module):
    """One Linear applied twice in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.shared(torch.tanh(self.shared(x))))


class TiedEmbeddings(nn.Module):
    """Input embedding and output projection share one weight."""

    def __init__(self, vocab: int = 7, dim: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.unembed = nn.Linear(dim, vocab, bias=False)
        self.unembed.weight = self.embed.weight

    def forward(self, tokens):
        return self.unembed(torch.tanh(self.mix(self.embed(tokens))))


class Scale(nn.Module):
    """A bare parameter: no sampler is registered, so it goes through the torch.func fallback."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, features))

    def forward(self, x):
        return x * self.gain


class TwoInputs(nn.Module):
    def __init__(self, second_through_fallback: bool = False) -> None:
        super().__init__()
        self.left = nn.Linear(3, 2)
        self.right = Scale(4) if second_through_fallback else nn.Linear(4, 2)

    def forward(self, x, y):
        return self.left(x).sum() + self.right(y).sum()


class ReadsChildWeight(nn.Module):
    """Uses its child's weight directly, outside the child's forward."""

    def __init__(self, also_call_child: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.also_call_child = also_call_child

    def forward(self, x):
        direct = x @ self.fc.weight.t()
        return self.fc(x) + direct if self.also_call_child else direct


class SubLinear(nn.Linear):
    """A subclass: registry lookup is by exact type, so it needs its own sampler."""


def mixed_model() -> nn.Sequential:
    """Sampler layers, a fallback layer (PReLU), a bare-parameter module, a buffer, a parameterless layer."""
    model = nn.Sequential(nn.Linear(5, 4), nn.PReLU(), Scale(4), nn.LayerNorm(4), nn.Linear(4, 3))
    model.register_buffer("unused_buffer", torch.ones(2))
    return model.to(DOUBLE)


def storage_refs_of_output(layer: nn.Module):
    """Hook ``layer`` so that a weak reference to its output's storage is recorded at each call (the
    output of the layer before the one under test is that layer's input)."""
    refs = []
    handle = layer.register_forward_hook(lambda module, args, output: refs.append(StorageWeakRef(output.untyped_storage())))
    return refs, handle


# ---------------------------------------------------------------------------- shapes and scaling
def test_grad_sample_has_batch_shape_and_grad_stays_ordinary():
    torch.manual_seed(0)
    model = mlp()
    plain = copy.deepcopy(model)
    x, y = torch.randn(6, 5, dtype=DOUBLE), torch.randn(6, 3, dtype=DOUBLE)
    squared_error_sum(plain(x), y).backward()

    wrapped = GradSampleModule(model, loss_reduction="sum")
    squared_error_sum(wrapped(x), y).backward()

    for (name, param), (_, plain_param) in zip(model.named_parameters(), plain.named_parameters()):
        assert param.grad_sample.shape == (6, *param.shape), name
        torch.testing.assert_close(param.grad, plain_param.grad, rtol=1e-6, atol=1e-10)


def test_per_sample_grads_equal_per_example_reference_with_sequence_dimension():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(inplace=True), nn.Linear(4, 3)).to(DOUBLE)
    x, y = torch.randn(4, 3, 5, dtype=DOUBLE), torch.randn(4, 3, 3, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: squared_error_sum(out, y[i : i + 1]))

    wrapped = GradSampleModule(model, loss_reduction="sum")
    squared_error_sum(wrapped(x), y).backward()
    assert_matches_reference(model, reference)


def test_mean_reduction_undoes_the_one_over_batch_of_a_mean_loss():
    torch.manual_seed(0)
    model = mlp()
    x, target = torch.randn(5, 5, dtype=DOUBLE), torch.randint(0, 3, (5,))
    reference = per_example_reference(model, (x,), lambda out, i: F.cross_entropy(out, target[i : i + 1]))

    wrapped = GradSampleModule(model, loss_reduction="mean")
    F.cross_entropy(wrapped(x), target).backward()
    assert_matches_reference(model, reference)
    for param in model.parameters():
        torch.testing.assert_close(param.grad_sample.sum(0), 5 * param.grad)


def test_sum_reduction_does_not_rescale():
    torch.manual_seed(0)
    model = mlp()
    x, target = torch.randn(5, 5, dtype=DOUBLE), torch.randint(0, 3, (5,))
    reference = per_example_reference(model, (x,), lambda out, i: F.cross_entropy(out, target[i : i + 1]))

    # A mean loss declared as "sum": the 1/B stays in every example's gradient.
    wrapped = GradSampleModule(model, loss_reduction="sum")
    F.cross_entropy(wrapped(x), target).backward()
    assert_matches_reference(model, {name: grads / 5 for name, grads in reference.items()})
    for param in model.parameters():
        torch.testing.assert_close(param.grad_sample.sum(0), param.grad)


def test_batch_first_false_takes_the_batch_from_dim_1():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), Scale(4), nn.Linear(4, 3)).to(DOUBLE)
    x, y = torch.randn(2, 6, 5, dtype=DOUBLE), torch.randn(2, 6, 3, dtype=DOUBLE)  # (time, batch, features)
    reference = per_example_reference(
        model, (x,), lambda out, i: squared_error_sum(out, y[:, i : i + 1]), batch_dim=1
    )

    wrapped = GradSampleModule(model, batch_first=False, loss_reduction="sum")
    squared_error_sum(wrapped(x), y).backward()
    assert_matches_reference(model, reference)


# ---------------------------------------------------------------------------- summing rules
def test_module_called_twice_in_one_forward_sums_both_calls():
    torch.manual_seed(0)
    model = TwiceCalled().to(DOUBLE)
    x, y = torch.randn(4, 4, dtype=DOUBLE), torch.randn(4, 2, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: squared_error_sum(out, y[i : i + 1]))

    wrapped = GradSampleModule(model, loss_reduction="sum")
    squared_error_sum(wrapped(x), y).backward()
    assert_matches_reference(model, reference)


@pytest.mark.parametrize("embedding_path", ["registered_sampler", "torch_func_fallback"])
def test_tied_embedding_and_linear_sum_both_uses(embedding_path, restore_sampler_registry):
    if embedding_path == "torch_func_fallback":
        restore_sampler_registry.GRAD_SAMPLERS.pop(nn.Embedding, None)
    elif grad_sampler_for(nn.Embedding(2, 2)) is None:
        pytest.skip("no nn.Embedding sampler is registered")
    torch.manual_seed(0)
    model = TiedEmbeddings().to(DOUBLE)
    tokens, target = torch.randint(0, 7, (4, 5)), torch.randint(0, 7, (4, 5))

    def loss_of(out, i):
        return F.cross_entropy(out.reshape(-1, 7), target[i : i + 1].reshape(-1), reduction="sum")

    reference = per_example_reference(model, (tokens,), loss_of)
    wrapped = GradSampleModule(model, loss_reduction="sum")
    F.cross_entropy(wrapped(tokens).reshape(-1, 7), target.reshape(-1), reduction="sum").backward()
    assert_matches_reference(model, reference)
    assert model.embed.weight.grad_sample is model.unembed.weight.grad_sample


def test_backward_passes_add_up_until_cleared():
    torch.manual_seed(0)
    model = mlp()
    batches = [(torch.randn(3, 5, dtype=DOUBLE), torch.randn(3, 3, dtype=DOUBLE)) for _ in range(3)]
    references = [
        per_example_reference(model, (x,), lambda out, i, y=y: squared_error_sum(out, y[i : i + 1])) for x, y in batches
    ]
    wrapped = GradSampleModule(model, loss_reduction="sum")
    for x, y in batches[:2]:
        squared_error_sum(wrapped(x), y).backward()
    assert_matches_reference(model, {name: references[0][name] + references[1][name] for name in references[0]})

    wrapped.clear_grad_sample()
    assert all(param.grad_sample is None for param in model.parameters())
    x, y = batches[2]
    squared_error_sum(wrapped(x), y).backward()
    assert_matches_reference(model, references[2])


def test_zero_grad_clears_grad_and_grad_sample():
    model = mlp()
    wrapped = GradSampleModule(model)
    wrapped(torch.randn(3, 5, dtype=DOUBLE)).sum().backward()
    wrapped.zero_grad()
    for param in model.parameters():
        assert param.grad is None
        assert param.grad_sample is None


def test_second_backward_through_one_forward_raises():
    model = mlp()
    wrapped = GradSampleModule(model)
    loss = wrapped(torch.randn(3, 5, dtype=DOUBLE)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_frozen_parameters_get_no_grad_sample():
    torch.manual_seed(0)
    model = mixed_model()
    model[0].weight.requires_grad_(False)
    model[2].gain.requires_grad_(False)
    model[4].requires_grad_(False)
    x, y = torch.randn(4, 5, dtype=DOUBLE), torch.randn(4, 3, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: squared_error_sum(out, y[i : i + 1]))

    wrapped = GradSampleModule(model, loss_reduction="sum")
    squared_error_sum(wrapped(x), y).backward()
    assert_matches_reference(model, reference)
    for param in (model[0].weight, model[2].gain, model[4].weight, model[4].bias):
        assert getattr(param, "grad_sample", None) is None


def test_fully_frozen_first_layer_is_skipped():
    torch.manual_seed(0)
    model = mlp()
    model[0].requires_grad_(False)
    x, y = torch.randn(4, 5, dtype=DOUBLE), torch.randn(4, 3, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: squared_error_sum(out, y[i : i + 1]))
    wrapped = GradSampleModule(model, loss_reduction="sum")
    squared_error_sum(wrapped(x), y).backward()
    assert_matches_reference(model, reference)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zeroing_grads_between_forward_and_backward_is_not_a_usage_error(set_to_none):
    torch.manual_seed(0)
    model = mixed_model()
    x, y = torch.randn(4, 5, dtype=DOUBLE), torch.randn(4, 3, dtype=DOUBLE)
    squared_error_sum(model(x), y).backward()  # gradients from before wrapping
    reference = per_example_reference(model, (x,), lambda out, i: squared_error_sum(out, y[i : i + 1]))

    wrapped = GradSampleModule(model, loss_reduction="sum")
    loss = squared_error_sum(wrapped(x), y)
    wrapped.zero_grad(set_to_none=set_to_none)  # the usual optimizer.zero_grad(); loss.backward()
    loss.backward()
    assert_matches_reference(model, reference)


def test_empty_batch_gives_empty_grad_samples():
    model = mixed_model()
    wrapped = GradSampleModule(model)
    wrapped(torch.randn(0, 5, dtype=DOUBLE)).sum().backward()
    for param in model.parameters():
        assert param.grad_sample.shape == (0, *param.shape)


# ---------------------------------------------------------------------------- memory
@pytest.mark.parametrize("layer_index", [4, 2], ids=["sampler_layer", "fallback_layer"])
def test_activations_are_freed_once_their_backward_has_run(layer_index):
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), Scale(4), nn.Tanh(), nn.Linear(4, 3)).to(DOUBLE)
    refs, handle = storage_refs_of_output(model[layer_index - 1])
    wrapped = GradSampleModule(model)
    output = wrapped(torch.randn(3, 5, dtype=DOUBLE))
    loss = output.sum()
    gc.collect()
    assert not refs[0].expired()  # held for the backward (else this test could not fail)
    loss.backward()
    gc.collect()
    assert refs[0].expired(), "the layer's input is still alive after its backward ran"
    del output, loss
    handle.remove()


@pytest.mark.parametrize("context", ["eval", "no_grad", "inference_mode"])
def test_eval_and_no_grad_capture_nothing_and_hold_nothing(context):
    model = mixed_model()
    refs_sampler, handle_sampler = storage_refs_of_output(model[3])  # input of a sampler layer
    refs_fallback, handle_fallback = storage_refs_of_output(model[1])  # input of a fallback layer
    wrapped = GradSampleModule(model)
    x = torch.randn(3, 5, dtype=DOUBLE)
    if context == "eval":
        wrapped.eval()
        output = wrapped(x)
        output.sum().backward()  # ordinary gradients still flow; no per-sample ones are made
        assert model[0].weight.grad is not None
    elif context == "no_grad":
        with torch.no_grad():
            output = wrapped(x)
    else:
        with torch.inference_mode():
            output = wrapped(x)
    gc.collect()
    assert refs_sampler[0].expired() and refs_fallback[0].expired()
    assert all(getattr(param, "grad_sample", None) is None for param in model.parameters())
    del output
    handle_sampler.remove()
    handle_fallback.remove()


def test_layer_in_eval_mode_inside_a_training_wrapper_still_gets_exact_grads():
    torch.manual_seed(0)
    model = mixed_model()
    x, y = torch.randn(4, 5, dtype=DOUBLE), torch.randn(4, 3, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: squared_error_sum(out, y[i : i + 1]))
    wrapped = GradSampleModule(model, loss_reduction="sum")
    model[0].eval()  # the wrapper's mode decides, not the layer's
    model[1].eval()
    squared_error_sum(wrapped(x), y).backward()
    assert_matches_reference(model, reference)


def test_eval_forward_after_an_abandoned_training_forward_does_not_raise():
    model = mlp()
    wrapped = GradSampleModule(model)
    wrapped(torch.randn(3, 5, dtype=DOUBLE))  # training forward, never backpropagated
    wrapped.eval()
    wrapped(torch.randn(3, 5, dtype=DOUBLE)).sum().backward()  # e.g. an input-saliency pass
    assert model[0].weight.grad is not None
    assert all(getattr(param, "grad_sample", None) is None for param in model.parameters())


# ---------------------------------------------------------------------------- unwrapping
def test_to_standard_module_gives_back_the_original_exactly():
    model = nn.Sequential(mixed_model(), nn.Identity())
    before = module_fingerprint(model)
    wrapped = GradSampleModule(model)
    assert module_fingerprint(model) != before  # hooks were attached (else this test could not fail)
    wrapped(torch.randn(3, 5, dtype=DOUBLE)).sum().backward()
    assert model[0][0].weight.grad_sample is not None

    assert wrapped.to_standard_module() is model
    assert module_fingerprint(model) == before
    for module in model.modules():
        assert module.forward.__func__ is type(module).forward
    # Nothing stays registered: it can be wrapped again.
    GradSampleModule(model).to_standard_module()


def test_to_standard_module_keeps_a_forward_overridden_on_the_instance():
    model = nn.Sequential(Scale(4), nn.Linear(4, 2)).to(DOUBLE)
    class_forward = model[0].forward
    model[0].forward = lambda x: class_forward(x) + 1.0
    override = model[0].forward
    GradSampleModule(model).to_standard_module()
    assert model[0].forward is override


def test_unwrapped_wrapper_refuses_to_run():
    model = mlp()
    wrapped = GradSampleModule(model)
    wrapped.to_standard_module()
    before = module_fingerprint(model)
    with pytest.raises(RuntimeError, match="to_standard_module"):
        wrapped(torch.randn(3, 5, dtype=DOUBLE))
    assert module_fingerprint(model) == before


def test_state_dict_keys_equal_the_wrapped_modules():
    model = mixed_model()
    expected = model.state_dict()
    wrapped = GradSampleModule(model)
    state = wrapped.state_dict()
    assert list(state) == list(expected)
    for key in state:
        assert state[key] is not None and torch.equal(state[key], expected[key])
    fresh = mixed_model()
    GradSampleModule(fresh).load_state_dict(state)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key])


# ---------------------------------------------------------------------------- bad input
def assert_rejected_at_wrap_time(model: nn.Module, error: type, *patterns: str) -> None:
    before = module_fingerprint(model)
    with pytest.raises(error) as raised:
        GradSampleModule(model)
    for pattern in patterns:
        assert pattern in str(raised.value), f"{pattern!r} not in: {raised.value}"
    assert module_fingerprint(model) == before


def test_batchnorm_in_training_mode_is_rejected_suggesting_groupnorm():
    model = nn.Sequential(nn.Linear(4, 3), nn.Sequential(nn.BatchNorm1d(3)))
    assert_rejected_at_wrap_time(model, UnsupportedModuleError, "'1.0'", "GroupNorm")


def test_batchnorm_switched_to_training_after_wrapping_is_rejected_at_forward():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).to(DOUBLE)
    model.eval()
    wrapped = GradSampleModule(model)
    wrapped.train()
    with pytest.raises(UnsupportedModuleError, match="GroupNorm"):
        wrapped(torch.randn(3, 4, dtype=DOUBLE))


@pytest.mark.parametrize(
    "embedding, pattern",
    [(nn.Embedding(5, 3, max_norm=1.0), "max_norm"), (nn.Embedding(5, 3, sparse=True), "sparse")],
    ids=["max_norm", "sparse"],
)
def test_unsupported_embedding_options_are_rejected(embedding, pattern):
    model = nn.Sequential(nn.Sequential(embedding), nn.Linear(3, 2))
    assert_rejected_at_wrap_time(model, UnsupportedModuleError, "'0.0'", pattern)


@pytest.mark.parametrize("also_call_child", [False, True], ids=["only_outside", "inside_and_outside"])
def test_parameter_used_outside_its_owner_raises_at_first_backward(also_call_child):
    model = ReadsChildWeight(also_call_child).to(DOUBLE)
    wrapped = GradSampleModule(model)
    with pytest.raises(ParameterUsageError, match="'fc.weight'"):
        wrapped(torch.randn(3, 3, dtype=DOUBLE)).sum().backward()


def test_usage_check_off_is_a_declared_class_option_not_a_state_write():
    # A wrapper class whose backward never writes .grad (GhostClippingModule) declares the check off; the
    # same outside use that GradSampleModule refuses then passes through this check unjudged.
    class Unchecked(GradSampleModule):
        checks_parameter_usage = False

    model = ReadsChildWeight(also_call_child=False).to(DOUBLE)
    wrapped = Unchecked(model)
    wrapped(torch.randn(3, 3, dtype=DOUBLE)).sum().backward()
    assert wrapped._check_state == "off"
    assert GradSampleModule(ReadsChildWeight(False).to(DOUBLE))._check_state == "pending"


def test_cancelling_per_sample_gradients_are_not_mistaken_for_outside_use():
    # Examples come in pairs (z, -z): the float32 batch gradient is pure rounding noise, and must be
    # judged against the per-sample magnitudes, not against its own near-zero norm.
    torch.manual_seed(0)
    half = torch.randn(32, 8)
    x = torch.cat([half, -half])[torch.randperm(64)]
    model = nn.Sequential(nn.Linear(8, 1, bias=False))
    wrapped = GradSampleModule(model, loss_reduction="sum")
    wrapped(x).sum().backward()
    torch.testing.assert_close(model[0].weight.grad_sample, x.unsqueeze(1))


def test_wrong_shape_from_a_sampler_names_sampler_and_module(restore_sampler_registry):
    def truncated_sampler(layer, activations, backprops):
        return {layer.weight: torch.zeros(backprops.shape[0] + 1, *layer.weight.shape)}

    restore_sampler_registry.register_grad_sampler(SubLinear)(truncated_sampler)
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(SubLinear(3, 2)))
    before = module_fingerprint(model)
    wrapped = GradSampleModule(model)
    with pytest.raises(RuntimeError) as raised:
        wrapped(torch.randn(4, 3)).sum().backward()
    message = str(raised.value)
    assert "truncated_sampler" in message and "'1.0'" in message and "(5, 2, 3)" in message
    assert module_fingerprint(wrapped.to_standard_module()) == before


@pytest.mark.parametrize("second_through_fallback", [False, True], ids=["sampler", "fallback"])
def test_batch_size_differing_between_inputs_names_both_modules(second_through_fallback):
    model = TwoInputs(second_through_fallback).to(DOUBLE)
    wrapped = GradSampleModule(model)
    with pytest.raises(ValueError) as raised:
        wrapped(torch.randn(3, 3, dtype=DOUBLE), torch.randn(2, 4, dtype=DOUBLE))
    assert "'left'" in str(raised.value) and "'right'" in str(raised.value)


def test_wrapping_twice_is_rejected():
    model = mixed_model()
    wrapped = GradSampleModule(model)
    hooked = module_fingerprint(model)
    with pytest.raises(ValueError, match="already a GradSampleModule"):
        GradSampleModule(wrapped)
    with pytest.raises(ValueError, match="already hooked"):
        GradSampleModule(model)
    with pytest.raises(ValueError, match="'0.0'"):
        GradSampleModule(nn.Sequential(model))
    assert module_fingerprint(model) == hooked  # the failed attempts added nothing


def failing_on_third_attach(monkeypatch):
    original = GradSampleModule._attach
    calls = []

    def attach(self, path, layer, sampler):
        calls.append(path)
        original(self, path, layer, sampler)
        if len(calls) == 3:
            raise RuntimeError("injected failure while attaching")

    monkeypatch.setattr(GradSampleModule, "_attach", attach)


def failing_on_second_forward_hook(monkeypatch):
    original = nn.Module.register_forward_hook
    calls = []

    def register(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 2:
            raise RuntimeError("injected failure while attaching")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "register_forward_hook", register)


@pytest.mark.parametrize("inject", [failing_on_third_attach, failing_on_second_forward_hook])
def test_failure_half_way_through_attaching_leaves_nothing(monkeypatch, inject):
    model = nn.Sequential(nn.Linear(5, 4), nn.PReLU(), Scale(4), nn.Linear(4, 3)).to(DOUBLE)
    before = module_fingerprint(model)
    inject(monkeypatch)
    with pytest.raises(RuntimeError, match="injected failure"):
        GradSampleModule(model)
    monkeypatch.undo()
    assert module_fingerprint(model) == before
    GradSampleModule(model).to_standard_module()  # nothing is left registered as hooked


# ---------------------------------------------------------------------------- randomised shapes
@settings(max_examples=10, deadline=None)
@given(
    batch_size=st.integers(1, 5),
    sizes=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    sequence=st.integers(0, 3),
    loss_reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_random_mlp_shapes_match_reference(batch_size, sizes, sequence, loss_reduction, seed):
    torch.manual_seed(seed)
    layers = []
    for in_features, out_features in itertools.pairwise(sizes):
        layers += [nn.Linear(in_features, out_features), nn.Tanh()]
    model = nn.Sequential(*layers[:-1]).to(DOUBLE)
    middle = (sequence,) if sequence else ()
    x = torch.randn(batch_size, *middle, sizes[0], dtype=DOUBLE)
    y = torch.randn(batch_size, *middle, sizes[-1], dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: F.mse_loss(out, y[i : i + 1]))

    wrapped = GradSampleModule(model, loss_reduction=loss_reduction)
    loss = F.mse_loss(wrapped(x), y, reduction=loss_reduction)
    loss.backward()
    if loss_reduction == "sum":
        # mse of one example alone averages over its own elements; the batch sum does not.
        elements = y[0].numel()
        reference = {name: grads * elements for name, grads in reference.items()}
    assert_matches_reference(model, reference)


# ---------------------------------------------------------------------------- device
@pytest.mark.cuda
def test_cuda_per_sample_grads_match_cpu_reference():
    torch.manual_seed(0)
    model = mixed_model()
    x, y = torch.randn(4, 5, dtype=DOUBLE), torch.randn(4, 3, dtype=DOUBLE)
    reference = per_example_reference(model, (x,), lambda out, i: squared_error_sum(out, y[i : i + 1]))
    model = model.cuda()
    wrapped = GradSampleModule(model, loss_reduction="sum")
    squared_error_sum(wrapped(x.cuda()), y.cuda()).backward()
    for name, param in model.named_parameters():
        assert param.grad_sample.is_cuda
        torch.testing.assert_close(param.grad_sample.cpu(), reference[name], rtol=1e-6, atol=1e-10)


@pytest.mark.parametrize(
    "layer, pattern",
    [
        (nn.Embedding(5, 2, scale_grad_by_freq=True), "scale_grad_by_freq"),
        (nn.EmbeddingBag(5, 2, scale_grad_by_freq=True), "scale_grad_by_freq"),
        (nn.EmbeddingBag(5, 2, mode="max"), "mode='max'"),
    ],
)
def test_embedding_configurations_without_per_sample_gradients_are_rejected_at_wrap_time(layer, pattern):
    model = nn.Sequential(nn.Sequential(layer))
    assert_rejected_at_wrap_time(model, UnsupportedModuleError, "'0.0'", pattern)
