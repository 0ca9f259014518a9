"""The Opacus compatibility namespace (``privacy_engine.opacus``) and the engine features Opacus
scripts rely on: grad_sample_mode "no_op" and "ew", make_private on a returned loader, step hooks
and the accountant's hook, the processed-flag helpers, the list form of register_grad_sampler,
Opacus's state-dict keys and checkpoints, reproducibility under torch.manual_seed."""

from __future__ import annotations

import importlib.util
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

from accountants import make_accountant
from grad_samplers import registry
from privacy_engine import GradSampleModule as EngineGradSampleModule
from privacy_engine import PrivacyEngine as EnginePrivacyEngine
from privacy_engine.capture.manual import ManualGradSampleModule
from privacy_engine.models.validation import UnsupportedModuleError
from privacy_engine.opacus import GradSampleModule, PrivacyEngine
from privacy_engine.opacus._lazy import lazy_attribute, unavailable
from privacy_engine.opacus.accountants import PRVAccountant, RDPAccountant
from privacy_engine.opacus.accountants.utils import get_noise_multiplier
from privacy_engine.opacus.data_loader import DPDataLoader
from privacy_engine.opacus.grad_sample import register_grad_sampler
from privacy_engine.opacus.grad_sample.functorch import make_functional
from privacy_engine.opacus.layers import DPMultiheadAttention
from privacy_engine.opacus.optimizers import DPOptimizer
from privacy_engine.opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from privacy_engine.opacus.utils.per_sample_gradients_utils import check_per_sample_gradients_are_correct
from privacy_engine.training.virtual_steps import VirtualSteps

OPACUS_INSTALLED = importlib.util.find_spec("opacus") is not None


def make_data(num_examples=40, features=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(num_examples, features, generator=generator),
                         torch.randint(0, 2, (num_examples,), generator=generator))  # fmt: skip


def make_private(engine, *, batch_size=10, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(make_data(), batch_size=batch_size)
    kwargs.setdefault("noise_multiplier", 1.0)
    kwargs.setdefault("max_grad_norm", 1.0)
    return engine.make_private(module=model, optimizer=optimizer, data_loader=loader, **kwargs)


def train(model, optimizer, loader):
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


# ---------------------------------------------------------------------------------------------- modes
def test_no_op_mode_releases_the_loops_own_per_sample_gradients():
    model, optimizer, loader = make_private(EnginePrivacyEngine(), grad_sample_mode="no_op", noise_multiplier=0.0)
    assert isinstance(model, ManualGradSampleModule)
    params = list(model.parameters())
    x, _ = next(iter(loader))
    model(x)
    rows = [torch.randn(x.shape[0], *p.shape, dtype=p.dtype) for p in params]
    for param, row in zip(params, rows):
        param.grad_sample = row
    before = [p.detach().clone() for p in params]
    optimizer.step()
    # Each example's row clipped to norm 1 over all parameters, summed, divided by the expected batch size.
    norms = torch.sqrt(sum(row.flatten(1).pow(2).sum(1) for row in rows))
    factors = (1.0 / norms).clamp(max=1.0)
    for param, old, row in zip(params, before, rows):
        expected = old - 0.1 * torch.einsum("b,b...->...", factors, row) / 10
        torch.testing.assert_close(param.detach(), expected)


def test_no_op_rows_without_a_training_forward_on_a_loader_batch_are_refused():
    model, optimizer, _ = make_private(EnginePrivacyEngine(), grad_sample_mode="no_op")
    for param in model.parameters():
        param.grad_sample = torch.zeros(10, *param.shape)
    with pytest.raises(RuntimeError, match="did not draw"):
        optimizer.step()


def test_ew_is_the_hooks_mode():
    model, _, _ = make_private(EnginePrivacyEngine(), grad_sample_mode="ew")
    assert type(model) is EngineGradSampleModule


def test_make_private_on_a_returned_loader_keeps_its_examples_and_rate():
    dataset = make_data(60)
    subset = list(range(0, 60, 2))
    loader = DataLoader(dataset, batch_size=6, sampler=SubsetRandomSampler(subset))
    first = EnginePrivacyEngine()
    model = nn.Linear(5, 2)
    _, _, private = first.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                       data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)  # fmt: skip
    second = EnginePrivacyEngine()
    model = nn.Linear(5, 2)
    _, _, again = second.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      data_loader=private, noise_multiplier=1.0, max_grad_norm=1.0)  # fmt: skip
    assert again.sample_rate == private.sample_rate == 6 / 30
    assert again.expected_batch_size == pytest.approx(6)
    drawn = {int(i) for _ in range(20) for batch in [next(iter(again.batch_sampler))] for i in batch}
    assert drawn <= set(subset)  # never an example outside the subset


def test_opacus_from_data_loader_on_a_private_loader_and_its_sample_rate():
    loader = DataLoader(make_data(60), batch_size=16)
    private = DPDataLoader.from_data_loader(loader, distributed=False)
    # Opacus's rate, 1 / len(loader) = 1 / 4 (not the engine's 16 / 60): a hook given 1 / len(loader), as
    # Opacus's examples write it, records the rate sampled (issue 18).
    assert private.sample_rate == 1 / len(loader) == 1 / len(private) == 0.25
    assert DPDataLoader.from_data_loader(private).sample_rate == 0.25
    with pytest.raises(ValueError, match="rand_on_empty"):
        DPDataLoader.from_data_loader(loader, rand_on_empty=True)
    exact = DPDataLoader(make_data(60), sample_rate=0.25)
    assert exact.sample_rate == 0.25 and len(exact) == 4


# ---------------------------------------------------------------------------------------------- hooks
def test_step_hooks_run_once_per_released_step_after_the_noise():
    model, optimizer, loader = make_private(EnginePrivacyEngine(), noise_multiplier=0.0)
    seen = []
    optimizer.attach_step_hook(lambda opt: seen.append((opt.steps_taken, [p.grad.clone() for p in opt.params])))
    with VirtualSteps(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as batches:
        for x, y in batches:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    assert [steps for steps, _ in seen] == list(range(1, len(loader) + 1))
    with pytest.raises(TypeError, match="callable"):
        optimizer.attach_step_hook("not a function")


def test_accountant_hook_records_each_step_like_opacus():
    torch.manual_seed(0)
    model = GradSampleModule(nn.Linear(5, 2))
    optimizer = DPOptimizer(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.3,
                            max_grad_norm=1.0, expected_batch_size=10)  # fmt: skip
    accountant = RDPAccountant()
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=0.25))
    for x, y in DPDataLoader.from_data_loader(DataLoader(make_data(), batch_size=10)):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert len(accountant) == 4 and accountant.mechanism() == "rdp"
    reference = make_accountant("rdp")
    reference.step(noise_multiplier=1.3, sample_rate=0.25, num_steps=4)
    assert accountant.get_epsilon(delta=1e-5) == reference.get_epsilon(1e-5)
    epsilon, order = accountant.get_privacy_spent(delta=1e-5)
    assert epsilon == reference.get_epsilon(1e-5) and order > 1


def test_accountant_hook_records_accumulated_batches_as_one_release_of_several_draws():
    torch.manual_seed(0)
    model = GradSampleModule(nn.Linear(5, 2))
    optimizer = DPOptimizer(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                            max_grad_norm=1.0, expected_batch_size=10)  # fmt: skip
    accountant = PRVAccountant()
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=0.25))
    batches = iter(DPDataLoader.from_data_loader(DataLoader(make_data(), batch_size=10)))
    for _ in range(2):  # Opacus's hook would record sample rate 0.25 * accumulated_iterations
        x, y = next(batches)
        nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    (entry,) = accountant.history
    assert (entry.num_steps, entry.sample_rate, entry.batches_per_step) == (1, 0.25, 2)
    assert optimizer.accumulated_iterations == 2


def test_accountant_hook_on_an_optimizer_that_records_itself_counts_nothing_twice():
    engine = PrivacyEngine()
    model, optimizer, loader = make_private(engine)
    optimizer.attach_step_hook(engine.accountant.get_optimizer_hook_fn(sample_rate=loader.sample_rate))
    with pytest.warns(UserWarning, match="already records"):
        train(model, optimizer, loader)
    assert engine.accountant.steps == len(loader)


def test_processed_flag_helpers_catch_a_second_use():
    tensors = [torch.zeros(2), torch.zeros(3)]
    _check_processed_flag(tensors)
    _mark_as_processed(tensors)
    with pytest.raises(ValueError, match="zero_grad"):
        _check_processed_flag(tensors[1])


def test_an_add_noise_override_is_what_the_step_releases():
    class NoNoise(DPOptimizer):
        def add_noise(self):
            for p in self.params:
                _check_processed_flag(p.summed_grad)
                p.grad = p.summed_grad * 2
                _mark_as_processed(p.summed_grad)

    torch.manual_seed(0)
    model = GradSampleModule(nn.Linear(5, 2).double())
    with pytest.warns(UserWarning, match="overrides add_noise"):
        optimizer = NoNoise(optimizer=torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0,
                            max_grad_norm=1e6, expected_batch_size=4)  # fmt: skip
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    reference = nn.Linear(5, 2).double()
    reference.load_state_dict(model._module.state_dict())
    nn.functional.cross_entropy(reference(x), y, reduction="sum").backward()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    # No clipping (huge bound): summed_grad is the gradient of the summed loss; doubled, over 4.
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad * 2 / 4)


# ---------------------------------------------------------------------------------------------- registry
def test_register_grad_sampler_takes_one_list_of_types():
    class A(nn.Linear):
        pass

    class B(nn.Linear):
        pass

    def sampler(layer, activations, backprops):
        return {}

    try:
        register_grad_sampler([A, B])(sampler)
        assert registry.grad_sampler_for(A(1, 1)) is sampler and registry.grad_sampler_for(B(1, 1)) is sampler
    finally:
        registry.GRAD_SAMPLERS.pop(A, None)
        registry.GRAD_SAMPLERS.pop(B, None)
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        register_grad_sampler([A, "B"])


def test_check_per_sample_gradients_detects_a_wrong_sampler():
    class Scaled(nn.Linear):
        pass

    def wrong(layer, activations, backprops):
        x = activations[0]
        return {layer.weight: 2 * torch.einsum("n...i,n...j->nij", backprops, x),
                layer.bias: torch.einsum("n...k->nk", backprops)}  # fmt: skip

    assert check_per_sample_gradients_are_correct(torch.randn(6, 3, 4), Scaled(4, 3))
    try:
        registry.register_grad_sampler(Scaled)(wrong)
        assert not check_per_sample_gradients_are_correct(torch.randn(6, 3, 4), Scaled(4, 3))
    finally:
        registry.GRAD_SAMPLERS.pop(Scaled, None)


# ---------------------------------------------------------------------------------------------- state
def test_compat_wrappers_save_with_opacus_keys_and_load_either():
    engine_model, _, _ = make_private(EnginePrivacyEngine())
    opacus_model, _, _ = make_private(PrivacyEngine(), seed=1)
    assert list(engine_model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert list(opacus_model.state_dict()) == [f"_module.{key}" for key in engine_model.state_dict()]
    engine_model.load_state_dict(opacus_model.state_dict())  # Opacus's keys into the engine's wrapper
    for a, b in zip(engine_model.parameters(), opacus_model.parameters()):
        assert torch.equal(a, b)
    opacus_model.load_state_dict({k: v + 1 for k, v in engine_model.state_dict().items()})  # and the reverse
    assert torch.equal(opacus_model.state_dict()["_module.0.bias"], engine_model.state_dict()["0.bias"] + 1)
    plain = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    plain.load_state_dict(engine_model.state_dict())


@pytest.mark.skipif(not OPACUS_INSTALLED, reason="Opacus is not installed")
def test_state_dicts_cross_between_opacus_and_the_compat_wrapper():
    import opacus

    ours = GradSampleModule(nn.Linear(3, 2))
    theirs = opacus.GradSampleModule(nn.Linear(3, 2))
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict({k: v * 3 for k, v in theirs.state_dict().items()})
    assert torch.equal(ours._module.weight, theirs._module.weight * 3)


def _opacus_layout_checkpoint(path, model_state, history, mechanism="prv"):
    """A file with exactly the keys and types Opacus's save_checkpoint writes."""
    torch.save({"module_state_dict": model_state,
                "privacy_accountant_state_dict": {"history": history, "mechanism": mechanism}}, path)  # fmt: skip


def test_an_opacus_checkpoint_loads_into_the_compat_engine(tmp_path):
    source = GradSampleModule(nn.Linear(3, 2))
    path = tmp_path / "opacus.pt"
    _opacus_layout_checkpoint(path, source.state_dict(), [(1.1, 0.01, 100), (1.1, 0.01, 50)])
    engine = PrivacyEngine()
    target = GradSampleModule(nn.Linear(3, 2))
    engine.load_checkpoint(path=path, module=target)
    assert torch.equal(target._module.weight, source._module.weight)
    reference = PRVAccountant()
    reference.step(noise_multiplier=1.1, sample_rate=0.01, num_steps=150)
    assert engine.accountant.steps == 150
    assert engine.get_epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-6)
    bad = tmp_path / "bad.pt"
    _opacus_layout_checkpoint(bad, {"_module.nope": torch.zeros(1)}, [(1.1, 0.01, 7)])
    with pytest.raises(RuntimeError):
        engine.load_checkpoint(path=bad, module=target)
    assert engine.accountant.steps == 150 and torch.equal(target._module.weight, source._module.weight)


@pytest.mark.skipif(not OPACUS_INSTALLED, reason="Opacus is not installed")
def test_opacus_save_checkpoint_loads_into_ours_and_our_export_into_opacus(tmp_path):
    import opacus

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = opacus.PrivacyEngine()
        model = nn.Linear(5, 2)
        model, optimizer, loader = theirs.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(make_data(), batch_size=10), noise_multiplier=1.0, max_grad_norm=1.0,
        )  # fmt: skip
        train(model, optimizer, loader)
        theirs.save_checkpoint(path=tmp_path / "theirs.pt", module=model, optimizer=optimizer)
        ours = PrivacyEngine()
        our_model, our_optimizer, _ = make_private_linear(ours)
        ours.load_checkpoint(path=tmp_path / "theirs.pt", module=our_model, optimizer=our_optimizer)
    assert torch.equal(our_model._module.weight, model._module.weight)
    assert ours.get_epsilon(1e-5) == pytest.approx(theirs.get_epsilon(1e-5), rel=0.01)
    # The reverse: the model's state dict and the ledger in Opacus's format, read by Opacus.
    torch.save({"module_state_dict": our_model.state_dict(),
                "privacy_accountant_state_dict": ours.accountant.opacus_state_dict()}, tmp_path / "ours.pt")  # fmt: skip
    again = opacus.PrivacyEngine()
    target = opacus.GradSampleModule(nn.Linear(5, 2))
    again.load_checkpoint(path=tmp_path / "ours.pt", module=target)
    assert torch.equal(target._module.weight, our_model._module.weight)
    assert again.get_epsilon(1e-5) == pytest.approx(theirs.get_epsilon(1e-5))


def make_private_linear(engine, model=None):
    model = nn.Linear(5, 2) if model is None else model
    return engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               data_loader=DataLoader(make_data(), batch_size=10), noise_multiplier=1.0,
                               max_grad_norm=1.0)  # fmt: skip


def test_accountant_state_dicts_in_opacus_format():
    accountant = PRVAccountant()
    accountant.load_state_dict({"history": [(1.0, 0.02, 10), (0.8, 0.02, 5)], "mechanism": "rdp"})
    assert accountant.opacus_state_dict() == {"history": [(1.0, 0.02, 10), (0.8, 0.02, 5)], "mechanism": "prv"}
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=4, num_bands=2)
    with pytest.raises(ValueError, match="no Opacus equivalent"):
        accountant.opacus_state_dict()
    with pytest.raises(ValueError, match="noise_multiplier, sample_rate, steps"):
        accountant.load_state_dict({"history": [(1.0, 0.02)], "mechanism": "prv"})


def test_reproducible_under_torch_manual_seed_alone():
    def run(seed):
        model = nn.Linear(5, 2)
        with torch.no_grad():
            model.weight.fill_(0.1)
            model.bias.zero_()
        torch.manual_seed(seed)  # no noise_seed or generator: noise and sampling follow this seed
        model, optimizer, loader = make_private_linear(PrivacyEngine(), model)
        train(model, optimizer, loader)
        return [p.detach().clone() for p in model.parameters()]

    first, second, other = run(123), run(123), run(124)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_secure_mode_refuses_a_generator():
    with pytest.raises(ValueError, match="secure"):
        make_private(PrivacyEngine(secure_mode=True), noise_generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------------------------- names
def test_unavailable_names_import_and_raise_only_when_used():
    stand_in = lazy_attribute("Thing", "privacy_engine.no_such_module", ("Thing",), "a missing piece")
    assert not isinstance(object(), stand_in)
    with pytest.raises(NotImplementedError, match="privacy_engine.no_such_module.Thing"):
        stand_in()
    with pytest.raises(NotImplementedError, match="a missing piece"):
        stand_in.fix(nn.Linear(1, 1))
    assert unavailable("X", "why").__doc__ == "why"


def test_opacus_options_without_an_equivalent_are_refused_clearly():
    with pytest.raises(NotImplementedError, match="GaussianAccountant"):
        PrivacyEngine(accountant="gdp")
    with pytest.raises(NotImplementedError, match="wrap_model=False"):
        make_private(PrivacyEngine(), wrap_model=False)
    with pytest.raises(ValueError, match="rand_on_empty"):
        make_private(PrivacyEngine(), rand_on_empty=True)


def test_make_functional_computes_the_model_with_given_parameters():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    fmodel, params = make_functional(model)
    x = torch.randn(5, 4)
    torch.testing.assert_close(fmodel(params, x), model(x))
    shifted = [p + 1 for p in params]
    assert not torch.allclose(fmodel(shifted, x), model(x))
    with pytest.raises(TypeError, match="hooks"):
        make_functional(EngineGradSampleModule(nn.Linear(2, 2)))


def test_dp_multihead_attention_is_torchs_layer_with_opacus_arguments():
    layer = DPMultiheadAttention(8, 2, dropout=0.0, bias=True, batch_first=True)
    assert type(layer) is nn.MultiheadAttention and layer.batch_first


def test_get_noise_multiplier_meets_the_target():
    sigma = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01, epochs=2)
    accountant = make_accountant("rdp")
    accountant.step(noise_multiplier=sigma, sample_rate=0.01, num_steps=200)
    assert 1.9 < accountant.get_epsilon(1e-5) <= 2.0
    with pytest.raises(ValueError, match="exactly one"):
        get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01)


def test_opacus_model_checks_on_the_engine():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    engine = PrivacyEngine()
    assert not engine.is_compatible(module=model, optimizer=None, data_loader=None)
    with pytest.raises(UnsupportedModuleError, match="BatchNorm"):
        engine.validate(module=model, optimizer=None, data_loader=None)
    fixed = PrivacyEngine.get_compatible_module(model)
    assert engine.is_compatible(module=fixed, optimizer=None, data_loader=None)
    assert isinstance(fixed[1], nn.GroupNorm) and isinstance(model[1], nn.BatchNorm2d)  # a fixed copy


def test_the_compat_engine_returns_opacus_classes():
    model, optimizer, loader = make_private(PrivacyEngine())
    assert isinstance(model, GradSampleModule) and isinstance(optimizer, DPOptimizer)
    assert optimizer.accumulated_iterations == 1
    assert math.isclose(loader.sample_rate, 0.25)
