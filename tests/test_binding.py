"""Who releases a wrapper's per-sample gradients: the engine connects one wrapper, one DPOptimizer and
one private loader (``make_private``, or ``privacy_engine.connect_private`` for a hand-built pipeline),
and nothing connects by itself (no registry of live wrappers or optimizers)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from accountants import make_accountant
from privacy_engine import DPOptimizer, GhostClippingModule, GradSampleModule, PrivacyEngine, connect_private
from privacy_engine.capture.manual import ManualGradSampleModule
from privacy_engine.training.data_loader import DPDataLoader
from tests.test_loop_contract import loss_of, make_data, make_model, snapshot


def dp_optimizer(params, **kwargs) -> DPOptimizer:
    settings = {"noise_multiplier": 0.0, "max_grad_norm": 0.5, "expected_batch_size": 8, **kwargs}
    return DPOptimizer(torch.optim.SGD(list(params), lr=1.0), **settings)


def unchanged(before, model) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def not_connected(wrapper, optimizer) -> bool:
    return wrapper._consumer is None and optimizer.contract.modules == []


def drawn_batch(loader=None):
    loader = loader or DPDataLoader.from_data_loader(DataLoader(make_data(), batch_size=8))
    return next(iter(loader))


# ---------------------------------------------------------------------------------------------- connecting
def test_a_connected_pipeline_releases_what_make_private_releases_on_the_same_seeds():
    engine = PrivacyEngine(accountant="pld")
    model = make_model()
    made, made_optimizer, made_loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(make_data(), batch_size=8), noise_multiplier=1.0, max_grad_norm=0.5,
        noise_generator=torch.Generator().manual_seed(3),
    )  # fmt: skip

    # By hand, as make_private does it: the noise seed is one draw of the generator, which then samples.
    generator = torch.Generator().manual_seed(3)
    noise_seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    hand_model = make_model()
    loader = DPDataLoader.from_data_loader(DataLoader(make_data(), batch_size=8), generator=generator)
    accountant = make_accountant("pld")
    wrapped = GradSampleModule(hand_model)
    optimizer = dp_optimizer(hand_model.parameters(), noise_multiplier=1.0, noise_seed=noise_seed,
                             expected_batch_size=loader.expected_batch_size, accountant=accountant,
                             sample_rate=loader.sample_rate)  # fmt: skip
    connect_private(wrapped, optimizer, loader)

    for module, opt, batches in ((made, made_optimizer, made_loader), (wrapped, optimizer, loader)):
        for x, y in batches:
            opt.zero_grad()
            loss_of(module, x, y).backward()
            opt.step()
    assert optimizer.steps_taken == made_optimizer.steps_taken == len(loader)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), hand_model.parameters()))
    assert accountant.get_epsilon(1e-5) == engine.get_epsilon(1e-5)


def test_connect_private_ties_the_three_and_attaches_a_fast_clipping_wrappers_clipper():
    model = make_model()
    ghost = GhostClippingModule(model)
    optimizer = dp_optimizer(model.parameters())
    loader = DPDataLoader.from_data_loader(DataLoader(make_data(), batch_size=8))
    assert connect_private(ghost, optimizer, loader) is None
    assert ghost._consumer is optimizer and optimizer.contract.modules == [ghost]
    assert ghost.clipper is optimizer.clipper and optimizer.contract.origin is loader.tickets.origin


@pytest.mark.parametrize("wrapper_class", [GradSampleModule, ManualGradSampleModule, GhostClippingModule])
@pytest.mark.parametrize("optimizer_first", [False, True])
def test_building_a_wrapper_and_an_optimizer_in_any_order_binds_nothing(wrapper_class, optimizer_first):
    model = make_model()
    if optimizer_first:
        optimizer = dp_optimizer(model.parameters())
        wrapper = wrapper_class(model)
    else:
        wrapper = wrapper_class(model)
        optimizer = dp_optimizer(model.parameters())
    assert not_connected(wrapper, optimizer)
    if wrapper_class is GhostClippingModule:
        wrapper.attach_clipper(optimizer.clipper)  # sharing the clipper connects nothing either
        assert not_connected(wrapper, optimizer)


# ---------------------------------------------------------------------------------------------- refusals
def test_connecting_a_wrapper_twice_is_refused_and_changes_nothing():
    model = make_model()
    wrapped, optimizer = GradSampleModule(model), dp_optimizer(model.parameters())
    connect_private(wrapped, optimizer)
    with pytest.raises(ValueError, match="module is already connected to this optimizer"):
        connect_private(wrapped, optimizer)
    other = dp_optimizer(model.parameters())
    with pytest.raises(ValueError, match="module is already connected to another DPOptimizer"):
        connect_private(wrapped, other)
    assert wrapped._consumer is optimizer and other.contract.modules == []


def test_a_second_wrapper_for_a_connected_optimizer_is_refused_and_changes_nothing():
    model, second_model = make_model(), make_model(1)
    wrapped, second = GradSampleModule(model), GradSampleModule(second_model)
    optimizer = dp_optimizer([*model.parameters(), *second_model.parameters()])
    connect_private(wrapped, optimizer)
    with pytest.raises(ValueError, match="optimizer is already connected to a GradSampleModule"):
        connect_private(second, optimizer)
    assert second._consumer is None and optimizer.contract.modules == [wrapped]


def test_a_wrapper_with_parameters_the_optimizer_lacks_is_refused_naming_them():
    model = make_model()
    wrapped = GradSampleModule(model)
    optimizer = dp_optimizer(model[0].parameters())
    with pytest.raises(ValueError, match=r"module's trainable parameters \['2.weight', '2.bias'\] are not optimizer's"):
        connect_private(wrapped, optimizer)
    assert not_connected(wrapped, optimizer)


def test_a_fast_clipping_wrapper_on_another_clipper_is_refused():
    model = make_model()
    optimizer = dp_optimizer(model.parameters())
    ghost = GhostClippingModule(model, clipper=dp_optimizer(model.parameters()).clipper)
    with pytest.raises(ValueError, match="another clipper than optimizer.clipper"):
        connect_private(ghost, optimizer)
    assert not_connected(ghost, optimizer)


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        (lambda m, o: (m._module, o, None), TypeError, "module must be the wrapper"),
        (lambda m, o: (m, o.original_optimizer, None), TypeError, "optimizer must be a DPOptimizer"),
        (lambda m, o: (m, o, DataLoader(make_data(), batch_size=8)), TypeError, "data_loader must be a DPDataLoader"),
    ],
)
def test_arguments_of_the_wrong_kind_are_refused_naming_them(arguments, error, match):
    model = make_model()
    wrapped, optimizer = GradSampleModule(model), dp_optimizer(model.parameters())
    with pytest.raises(error, match=match):
        connect_private(*arguments(wrapped, optimizer))
    assert not_connected(wrapped, optimizer)


def test_a_loader_other_than_the_optimizers_own_is_refused_before_anything_is_connected():
    model = make_model()
    wrapped, optimizer = GradSampleModule(model), dp_optimizer(model.parameters())
    own, other = (DPDataLoader.from_data_loader(DataLoader(make_data(), batch_size=8)) for _ in range(2))
    optimizer.attach_loader(own)
    with pytest.raises(ValueError, match="data_loader is not the loader optimizer already draws from"):
        connect_private(wrapped, optimizer, other)
    assert not_connected(wrapped, optimizer)


# ---------------------------------------------------------------------------------------------- unconnected
@pytest.mark.parametrize("wrapper_class", [GradSampleModule, ManualGradSampleModule])
def test_an_unconnected_pair_is_refused_at_step_before_the_accountant_counts(wrapper_class):
    model = make_model()
    wrapper = wrapper_class(model)
    accountant = make_accountant("pld")
    optimizer = dp_optimizer(model.parameters(), noise_multiplier=1.0, accountant=accountant, sample_rate=0.1)
    x, y = drawn_batch()
    loss_of(wrapper, x, y).backward()
    if wrapper_class is ManualGradSampleModule:
        for p in model.parameters():
            p.grad_sample = torch.zeros(len(x), *p.shape, dtype=p.dtype)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=rf"of a {wrapper_class.__name__} that is not connected.*connect_private"):
        optimizer.step()
    assert accountant.steps == 0 and optimizer.steps_taken == 0 and unchanged(before, model)
    assert all(p.grad_sample is not None for p in model.parameters())  # nothing was clipped either


def test_an_unconnected_fast_clipping_wrapper_sharing_the_clipper_is_refused_at_step():
    model = make_model()
    accountant = make_accountant("pld")
    optimizer = dp_optimizer(model.parameters(), noise_multiplier=1.0, accountant=accountant, sample_rate=0.1)
    ghost = GhostClippingModule(model, clipper=optimizer.clipper)
    x, y = drawn_batch()
    loss_of(ghost, x, y).backward()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="GhostClippingModule that is not connected"):
        optimizer.step()
    assert accountant.steps == 0 and unchanged(before, model)


def test_per_sample_gradients_set_by_hand_on_an_unwrapped_model_are_released_as_before():
    model = make_model()
    wrapped = GradSampleModule(model)
    wrapped.to_standard_module()  # the model is no wrapper's any more
    optimizer = dp_optimizer(model.parameters())
    for p in model.parameters():
        p.grad_sample = torch.ones(4, *p.shape, dtype=p.dtype)
    optimizer.step()
    assert optimizer.steps_taken == 1


def test_of_two_wrappers_only_the_connected_ones_batches_are_released():
    # One model in two parts, each wrapped; one optimizer over all of it, connected to the first wrapper.
    model = nn.ModuleDict({"first": make_model(), "second": make_model(1)})
    first, second = GradSampleModule(model["first"]), GradSampleModule(model["second"])
    accountant = make_accountant("pld")
    optimizer = dp_optimizer(model.parameters(), accountant=accountant, sample_rate=0.1)
    loader = DPDataLoader.from_data_loader(DataLoader(make_data(), batch_size=8))
    connect_private(first, optimizer, loader)
    batches = iter(loader)
    x, y = next(batches)
    loss_of(first, x, y).backward()
    optimizer.step()
    assert accountant.steps == 1
    optimizer.zero_grad()
    x, y = next(batches)
    loss_of(second, x, y).backward()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="GradSampleModule that is not connected"):
        optimizer.step()
    assert accountant.steps == 1 and unchanged(before, model)


def test_an_unconnected_wrappers_gradients_are_not_taken_in_by_the_connected_ones_next_forward():
    model = nn.ModuleDict({"first": make_model(), "second": make_model(1)})
    first, second = GradSampleModule(model["first"]), GradSampleModule(model["second"])
    optimizer = dp_optimizer(model.parameters())
    loader = DPDataLoader.from_data_loader(DataLoader(make_data(), batch_size=8))
    connect_private(first, optimizer, loader)
    batches = iter(loader)
    x, y = next(batches)
    (loss_of(first, x, y) + loss_of(second, x, y)).backward()
    x, y = next(batches)
    with pytest.raises(RuntimeError, match="GradSampleModule that is not connected"):
        first(x)  # would clip the first pass, the second wrapper's rows with it
    assert optimizer.steps_taken == 0 and not optimizer.clipper.has_accumulated


# ---------------------------------------------------------------------------------------------- Opacus
@pytest.mark.parametrize("optimizer_first", [False, True])
def test_opacus_namespace_connects_its_hand_built_pair_in_either_order(optimizer_first):
    from privacy_engine.opacus import GradSampleModule as OpacusGradSampleModule
    from privacy_engine.opacus.optimizers import DPOptimizer as OpacusDPOptimizer

    model = make_model()

    def build_optimizer():
        return OpacusDPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                                 max_grad_norm=0.5, expected_batch_size=8)  # fmt: skip

    if optimizer_first:
        optimizer = build_optimizer()
        wrapped = OpacusGradSampleModule(model)
    else:
        wrapped = OpacusGradSampleModule(model)
        optimizer = build_optimizer()
    assert wrapped._consumer is optimizer and optimizer.contract.modules == [wrapped]
    x, y = drawn_batch()
    loss_of(wrapped, x, y).backward()
    optimizer.step()
    assert optimizer.steps_taken == 1
