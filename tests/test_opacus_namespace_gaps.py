"""The gaps Opacus's own test suite (tests/opacus_suite/run.py) showed in ``privacy_engine.opacus`` (issue 26): Opacus's module
paths, ``SequenceBias``, the NotImplementedError of an unsupported model, hooks switched off, the
fast-clipping wrapper on its own, the accountant registry and interface, ``len()`` of
``BatchMemoryManager``, ``p.grad_sample`` kept until ``zero_grad()``, and Opacus's helpers. Every
per-sample gradient is checked against a float64 per-example loop, every epsilon against dp-accounting.
"""

from __future__ import annotations

import copy
import importlib
import math

import dp_accounting
import pytest
import torch
from torch import nn
from torch.nn import functional
from torch.nn.utils.rnn import pack_sequence
from torch.utils.data import DataLoader, TensorDataset, default_collate

from privacy_engine.opacus import GradSampleModule, GradSampleModuleFastGradientClipping, PrivacyEngine
from privacy_engine.opacus.accountants import (
    IAccountant,
    RDPAccountant,
    create_accountant,
    register_accountant,
    registry,
)
from privacy_engine.opacus.data_loader import CollateFnWithEmpty
from privacy_engine.opacus.grad_sample.embedding_norm_sample import compute_embedding_norm_sample
from privacy_engine.opacus.layers import SequenceBias
from privacy_engine.opacus.utils.batch_memory_manager import BatchMemoryManager
from privacy_engine.opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from privacy_engine.opacus.utils.per_sample_gradients_utils import (
    compute_grad_samples_microbatch_and_opacus,
    unpack_packedsequences,
)
from privacy_engine.opacus.utils.tensor_utils import unfold2d

# (module path, name, where the same object lives in the namespace's package-level modules)
OPACUS_PATHS = [
    ("privacy_engine.opacus.grad_sample.utils", "register_grad_sampler", "privacy_engine.opacus.grad_sample"),
    ("privacy_engine.opacus.grad_sample.utils", "get_gsm_class", "privacy_engine.opacus.grad_sample"),
    ("privacy_engine.opacus.grad_sample.utils", "wrap_model", None),
    ("privacy_engine.opacus.grad_sample.grad_sample_module", "GradSampleModule", "privacy_engine.opacus"),
    ("privacy_engine.opacus.grad_sample.grad_sample_module_fast_gradient_clipping",
     "GradSampleModuleFastGradientClipping", "privacy_engine.opacus"),
    ("privacy_engine.opacus.grad_sample.gsm_exp_weights", "GradSampleModuleExpandedWeights", "privacy_engine.opacus.grad_sample"),
    ("privacy_engine.opacus.grad_sample.linear", "compute_linear_grad_sample", None),
    ("privacy_engine.opacus.grad_sample.conv", "convolution2d_backward_as_a_convolution", None),
    ("privacy_engine.opacus.layers.dp_multihead_attention", "DPMultiheadAttention", "privacy_engine.opacus.layers"),
    ("privacy_engine.opacus.layers.dp_multihead_attention", "SequenceBias", "privacy_engine.opacus.layers"),
    ("privacy_engine.opacus.layers.dp_rnn", "DPLSTM", "privacy_engine.opacus.layers"),
    ("privacy_engine.opacus.layers.dp_rnn", "DPGRU", "privacy_engine.opacus.layers"),
    ("privacy_engine.opacus.layers.dp_rnn", "DPRNN", "privacy_engine.opacus.layers"),
    ("privacy_engine.opacus.utils.module_utils", "are_state_dict_equal", None),
    ("privacy_engine.opacus.utils.packed_sequences", "compute_seq_lengths", None),
    ("privacy_engine.opacus.optimizers.perlayeroptimizer", "DPPerLayerOptimizer", "privacy_engine.opacus.optimizers"),
    ("privacy_engine.opacus.optimizers.ddpoptimizer", "DistributedDPOptimizer", "privacy_engine.opacus.optimizers"),
    ("privacy_engine.opacus.optimizers.ddp_perlayeroptimizer", "DistributedPerLayerOptimizer", "privacy_engine.opacus.optimizers"),
    ("privacy_engine.opacus.optimizers.ddpoptimizer_fast_gradient_clipping",
     "DistributedDPOptimizerFastGradientClipping", "privacy_engine.opacus.optimizers"),
    ("privacy_engine.opacus.accountants.registry", "register_accountant", "privacy_engine.opacus.accountants"),
    ("privacy_engine.opacus.data_loader", "wrap_collate_with_empty", None),
    ("privacy_engine.opacus.utils.tensor_utils", "unfold2d", None),
    ("privacy_engine.opacus.utils.fast_gradient_clipping_utils", "DPTensorFastGradientClipping", None),
]  # fmt: skip


@pytest.mark.parametrize(("module_path", "name", "package"), OPACUS_PATHS)
def test_opacus_module_path_imports_the_namespace_object(module_path, name, package):
    value = getattr(importlib.import_module(module_path), name)
    assert value is not None
    if package is not None:
        assert getattr(importlib.import_module(package), name) is value


def per_example_grads(model: nn.Module, inputs: torch.Tensor, loss_of, batch_dim: int = 0) -> list[torch.Tensor]:
    """Float64 reference: each example alone through a copy of the model; rows stacked per parameter."""
    reference = copy.deepcopy(model)
    rows: list[list[torch.Tensor]] = [[] for _ in reference.parameters()]
    for index in range(inputs.shape[batch_dim]):
        reference.zero_grad(set_to_none=True)
        loss_of(reference(inputs.narrow(batch_dim, index, 1)), index).backward()
        for row, param in zip(rows, reference.parameters()):
            row.append(param.grad.detach().clone())
    return [torch.stack(row) for row in rows]


@pytest.mark.parametrize("batch_first", [True, False])
def test_sequence_bias_per_sample_gradients_match_the_per_example_loop(batch_first):
    torch.manual_seed(0)
    layer = SequenceBias(4, batch_first=batch_first).double()
    model = nn.Sequential(layer, nn.Tanh())
    inputs = torch.randn((3, 5, 4) if batch_first else (5, 3, 4), dtype=torch.float64)
    batch_dim = 0 if batch_first else 1
    weights = torch.randn(inputs.shape, dtype=torch.float64).narrow(1 - batch_dim, 0, 1)  # fixed per-position weights
    expected = per_example_grads(model, inputs, lambda out, i: (out.narrow(1 - batch_dim, 0, 1) * weights.narrow(batch_dim, i, 1)).sum()
                                 + out.narrow(1 - batch_dim, 5, 1).pow(2).sum(), batch_dim)  # fmt: skip
    wrapped = GradSampleModule(copy.deepcopy(model), batch_first=batch_first, loss_reduction="sum")
    out = wrapped(inputs)
    loss = (out.narrow(1 - batch_dim, 0, 1) * weights).sum() + out.narrow(1 - batch_dim, 5, 1).pow(2).sum()
    loss.backward()
    (param,) = list(wrapped._module.parameters())
    torch.testing.assert_close(param.grad_sample, expected[0], rtol=1e-10, atol=1e-12)
    assert out.shape[1 - batch_dim] == 6


def test_sequence_bias_refuses_a_non_positive_size():
    with pytest.raises(ValueError, match="embed_dim"):
        SequenceBias(0)


def test_unsupported_model_raises_not_implemented_and_value_error_before_changing_it():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    forward_before = type(model[0]).forward
    with pytest.raises(NotImplementedError, match="BatchNorm1d") as caught:
        GradSampleModule(model)
    assert isinstance(caught.value, ValueError)
    assert type(model[0]).forward is forward_before and "forward" not in vars(model[0])


def make_private_linear(batch_size=10, n=40, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    data = TensorDataset(torch.randn(n, 3, dtype=torch.float64), torch.randint(0, 2, (n,)))
    loader = DataLoader(data, batch_size=batch_size)
    unwrapped = copy.deepcopy(model)  # never wrapped: the per-example reference is built from it
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine(accountant="rdp")
    kwargs.setdefault("noise_multiplier", 1.0)
    kwargs.setdefault("loss_reduction", "sum")  # the tests' losses are sums over the batch
    private = engine.make_private(module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=1.0, **kwargs)
    return (engine, unwrapped, *private)


def reference_of(unwrapped: nn.Module, wrapper: nn.Module) -> nn.Module:
    """An unwrapped copy of the model with the wrapper's current parameter values."""
    reference = copy.deepcopy(unwrapped)
    with torch.no_grad():
        for target, source in zip(reference.parameters(), wrapper._module.parameters()):
            target.copy_(source)
    return reference


def cross_entropy_sum(out, y):
    return nn.functional.cross_entropy(out, y, reduction="sum")


def test_disabled_hooks_give_the_plain_gradient_and_nothing_can_be_released():
    engine, unwrapped, model, optimizer, loader = make_private_linear(poisson_sampling=False)
    x, y = next(iter(loader))
    plain = reference_of(unwrapped, model)
    cross_entropy_sum(plain(x), y).backward()
    model.disable_hooks()
    assert not model.hooks_enabled
    cross_entropy_sum(model(x), y).backward()
    for param, reference in zip(model._module.parameters(), plain.parameters()):
        assert getattr(param, "grad_sample", None) is None
        torch.testing.assert_close(param.grad, reference.grad, rtol=1e-12, atol=1e-14)
    with pytest.raises(RuntimeError):
        optimizer.step()
    assert engine.accountant.steps == 0
    optimizer.zero_grad()
    model.enable_hooks()
    assert model.hooks_enabled
    expected = per_example_grads(reference_of(unwrapped, model), x, lambda out, i: cross_entropy_sum(out, y[i : i + 1]))
    cross_entropy_sum(model(x), y).backward()
    for param, rows in zip(model._module.parameters(), expected):
        torch.testing.assert_close(param.grad_sample, rows, rtol=1e-10, atol=1e-12)


def clipped_sum_reference(model, x, y, max_grad_norm):
    rows = per_example_grads(model, x, lambda out, i: cross_entropy_sum(out, y[i : i + 1]))
    norms = torch.sqrt(sum(r.flatten(1).pow(2).sum(1) for r in rows))
    factors = torch.clamp(max_grad_norm / norms, max=1.0)
    return [torch.einsum("b,b...->...", factors, r) for r in rows]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_fast_clipping_wrapper_alone_leaves_the_clipped_sum_in_grad(reduction):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    expected = clipped_sum_reference(model, x, y, 0.5)
    wrapped = GradSampleModuleFastGradientClipping(copy.deepcopy(model), max_grad_norm=0.5, loss_reduction=reduction)
    nn.functional.cross_entropy(wrapped(x), y, reduction=reduction).backward()
    for param, reference in zip(wrapped._module.parameters(), expected):
        torch.testing.assert_close(param.grad, reference, rtol=1e-9, atol=1e-12)


def test_fast_clipping_wrapper_alone_without_a_bound_refuses_to_train():
    wrapped = GradSampleModuleFastGradientClipping(nn.Linear(3, 2))
    with pytest.raises(RuntimeError, match="clipper"):
        wrapped(torch.randn(4, 3))
    with pytest.raises(ValueError, match="max_grad_norm"):
        GradSampleModuleFastGradientClipping(nn.Linear(3, 2), max_grad_norm=-1.0)


def test_dp_loss_backward_is_the_reduced_loss():
    torch.manual_seed(2)
    layer = nn.Linear(3, 2).double()
    plain = copy.deepcopy(layer)
    wrapped = GradSampleModuleFastGradientClipping(layer, max_grad_norm=1e9)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    criterion = DPLossFastGradientClipping(wrapped, torch.optim.SGD(wrapped.parameters(), lr=1.0), nn.CrossEntropyLoss())
    loss = criterion(wrapped(x), y)
    assert (2 * loss - loss).loss_per_sample.shape == (5,)
    loss.backward()
    reference_loss = nn.functional.cross_entropy(plain(x), y)
    torch.testing.assert_close(loss.detach(), reference_loss.detach())
    nn.functional.cross_entropy(plain(x), y, reduction="sum").backward()  # bound never reached: the plain sum
    for param, reference in zip(wrapped._module.parameters(), plain.parameters()):
        torch.testing.assert_close(param.grad, reference.grad, rtol=1e-9, atol=1e-12)


class CountingAccountant(IAccountant):
    """Opacus's abstract methods only (what an Opacus user writes)."""

    def __init__(self):
        self.history = []

    def step(self, *, noise_multiplier, sample_rate):
        self.history.append((noise_multiplier, sample_rate, 1))

    def get_epsilon(self, delta, *args, **kwargs):
        return float(len(self.history))

    def __len__(self):
        return len(self.history)

    @classmethod
    def mechanism(cls):
        return "counting"


@pytest.fixture
def clean_registry():
    saved = dict(registry._ACCOUNTANTS)
    yield
    registry._ACCOUNTANTS.clear()
    registry._ACCOUNTANTS.update(saved)


@pytest.mark.parametrize("name", ["rdp", "prv", "pld", "gdp"])
def test_register_accountant_refuses_to_replace_a_built_in_without_force(clean_registry, name):
    before = dict(registry._ACCOUNTANTS)
    with pytest.raises(ValueError, match="force=True"):
        register_accountant(name, CountingAccountant)
    assert registry._ACCOUNTANTS == before


def test_register_accountant_with_force_replaces_and_a_new_name_needs_no_force(clean_registry):
    register_accountant("counting", CountingAccountant)
    assert isinstance(create_accountant("counting"), CountingAccountant)
    with pytest.raises(ValueError):
        register_accountant("counting", CountingAccountant)
    register_accountant("rdp", CountingAccountant, force=True)
    assert isinstance(create_accountant("rdp"), CountingAccountant)
    with pytest.raises(TypeError):
        register_accountant("other", dict)


def test_custom_iaccountant_is_instantiable_and_counts_through_the_hook_but_the_engine_refuses_it(clean_registry):
    accountant = CountingAccountant()
    assert isinstance(accountant, IAccountant) and isinstance(RDPAccountant(), IAccountant)
    _, _, model, optimizer, loader = make_private_linear(poisson_sampling=False)
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=0.25))
    for x, y in loader:
        cross_entropy_sum(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert len(accountant) == len(loader) and accountant.history[0] == (1.0, 0.25, 1)
    register_accountant("counting", CountingAccountant)
    with pytest.raises(TypeError, match="IAccountant"):
        PrivacyEngine(accountant="counting")


def test_assigning_opacus_history_gives_dp_accountings_epsilon():
    accountant = RDPAccountant()
    accountant.history = [(1.1, 0.01, 500), (0.9, 0.02, 100)]
    event = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.1)), 500),
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(0.9)), 100),
    ])  # fmt: skip
    expected = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
    assert accountant.get_epsilon(1e-5) == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError):
        accountant.history = [(1.0, 0.01)]
    assert accountant.get_epsilon(1e-5) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(("batch_size", "max_physical"), [(16, 4), (10, 3), (8, 8), (4, 8)])
def test_batch_memory_manager_len_counts_physical_batches(batch_size, max_physical):
    _, _, model, optimizer, loader = make_private_linear(batch_size=batch_size, n=40, poisson_sampling=False)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=max_physical, optimizer=optimizer) as physical:
        count = 0
        for x, y in physical:
            cross_entropy_sum(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            count += 1
        sizes = [min(batch_size, 40 - start) for start in range(0, 40, batch_size)]  # the loader's batches
        assert len(physical) == count == sum(math.ceil(size / max_physical) for size in sizes)


def test_grad_sample_stays_after_step_until_zero_grad_and_never_mixes_batches():
    engine, unwrapped, model, optimizer, loader = make_private_linear(poisson_sampling=False)
    batches = list(loader)[:2]
    for x, y in batches:  # no zero_grad between the batches: the kept rows must not be added to
        reference = reference_of(unwrapped, model)
        expected = per_example_grads(reference, x, lambda out, i, y=y: cross_entropy_sum(out, y[i : i + 1]))
        cross_entropy_sum(model(x), y).backward()
        optimizer.step()
        for param, rows in zip(model._module.parameters(), expected):
            torch.testing.assert_close(param.grad_sample, rows, rtol=1e-10, atol=1e-12)
    assert engine.accountant.steps == 2
    with pytest.raises(RuntimeError):
        optimizer.step()  # the kept per-sample gradients are never released again
    assert engine.accountant.steps == 2
    optimizer.zero_grad()
    assert all(getattr(p, "grad_sample", None) is None for p in model._module.parameters())


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_microbatch_and_engine_helpers_agree_in_float64(reduction):
    torch.manual_seed(3)
    module = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    reference, engine = compute_grad_samples_microbatch_and_opacus(torch.randn(5, 3, dtype=torch.float64), module,
                                                                   loss_reduction=reduction)  # fmt: skip
    assert reference.keys() == engine.keys() == {name for name, _ in module.named_parameters()}
    for name in reference:
        torch.testing.assert_close(engine[name], reference[name], rtol=1e-10, atol=1e-12)


def test_unpack_packedsequences_gives_back_the_sequences_in_order():
    sequences = [torch.randn(length, 2) for length in (2, 4, 1)]
    for got, expected in zip(unpack_packedsequences(pack_sequence(sequences, enforce_sorted=False)), sequences):
        assert torch.equal(got, expected)


def test_collate_with_empty_keeps_the_structure_and_refuses_random_stand_ins():
    collate = CollateFnWithEmpty(default_collate)
    collate([{"x": torch.ones(3), "y": 1}])
    empty = collate([])
    assert empty["x"].shape == (0, 3) and empty["y"].shape == (0,)
    with pytest.raises(ValueError, match="rand_on_empty"):
        CollateFnWithEmpty(default_collate, rand_on_empty=True)


@pytest.mark.parametrize("padding", [(1, 2), "valid"])
def test_unfold2d_equals_torchs_unfold(padding):
    x = torch.randn(2, 3, 11, 13)
    torch_padding = (0, 0) if padding == "valid" else padding
    expected = functional.unfold(x, kernel_size=(3, 2), padding=torch_padding, stride=(2, 1), dilation=(1, 2))
    assert torch.equal(unfold2d(x, kernel_size=(3, 2), padding=padding, stride=(2, 1), dilation=(1, 2)), expected)


def test_unfold2d_same_padding_reproduces_the_convolution():
    torch.manual_seed(4)
    conv = nn.Conv2d(3, 4, (3, 3), padding="same", dilation=(2, 1), bias=False).double()
    x = torch.randn(2, 3, 9, 10, dtype=torch.float64)
    columns = unfold2d(x, kernel_size=(3, 3), padding="same", stride=(1, 1), dilation=(2, 1))
    torch.testing.assert_close((conv.weight.view(4, -1) @ columns).view(2, 4, 9, 10), conv(x))


def test_embedding_norm_sample_is_the_norm_of_each_examples_gradient():
    torch.manual_seed(5)
    layer = nn.Embedding(6, 3).double()
    ids = torch.tensor([[1, 1, 4], [2, 0, 5], [3, 3, 3]])
    output_grads = torch.randn(3, 3, 3, dtype=torch.float64)  # the loss is sum(embedding(ids) * output_grads)
    expected = []
    for index in range(3):
        layer.zero_grad()
        (layer(ids[index : index + 1]) * output_grads[index : index + 1]).sum().backward()
        expected.append(layer.weight.grad.norm())
    norms = compute_embedding_norm_sample(layer, [ids], output_grads)[layer.weight]
    torch.testing.assert_close(norms, torch.stack(expected), rtol=1e-10, atol=1e-12)
