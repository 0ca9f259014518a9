"""PrivacyEngine: what make_private builds, what it feeds the accountant, and that bad input is
refused before anything is wrapped."""

from __future__ import annotations

import copy
import math

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from accountants import make_accountant
from privacy_engine.capture import GradSampleModule
from privacy_engine.engine import PrivacyEngine
from privacy_engine.models.validation import UnsupportedModuleError
from privacy_engine.training.data_loader import DPDataLoader
from privacy_engine.training.optimizer import DPOptimizer
from tests.conftest import module_fingerprint

NUM_EXAMPLES = 40


def make_setup(batch_size=8, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(seed)
    dataset = TensorDataset(torch.randn(NUM_EXAMPLES, 6, generator=generator), torch.randint(0, 3, (NUM_EXAMPLES,), generator=generator))
    return model, optimizer, DataLoader(dataset, batch_size=batch_size)


def train_one_epoch(model, optimizer, loader):
    for inputs, targets in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()


def dp_accounting_epsilon(kind, noise_multiplier, sample_rate, steps, delta):
    """dp-accounting's own epsilon for `steps` Poisson-subsampled Gaussian steps (default settings,
    the same as the accountants')."""
    accountant = dp_accounting.pld.PLDAccountant() if kind == "pld" else dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), steps
    )
    return accountant.compose(event).get_epsilon(delta)


# ---------------------------------------------------------------------------- what it builds
def test_make_private_wraps_all_three_with_opacus_keyword_names():
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine()
    private_model, private_optimizer, private_loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.1, max_grad_norm=0.9, noise_seed=0
    )
    assert isinstance(private_model, GradSampleModule) and private_model.wrapped_module is model
    assert isinstance(private_optimizer, DPOptimizer) and private_optimizer.original_optimizer is optimizer
    assert isinstance(private_loader, DPDataLoader)
    assert private_loader.sample_rate == pytest.approx(8 / NUM_EXAMPLES)
    assert private_optimizer.expected_batch_size == pytest.approx(8)
    assert private_optimizer.noise_multiplier == 1.1 and private_optimizer.max_grad_norm == 0.9


def test_positional_arguments_work_and_two_spellings_of_one_argument_do_not():
    model, optimizer, loader = make_setup()
    with pytest.raises(TypeError, match="module"):
        PrivacyEngine().make_private(model, optimizer, loader, module=nn.Linear(1, 1), noise_multiplier=1.0,
                                     max_grad_norm=1.0)  # fmt: skip
    private_model, _, _ = PrivacyEngine().make_private(model, optimizer, loader, noise_multiplier=1.0, max_grad_norm=1.0)
    assert private_model.wrapped_module is model


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_epsilon_equals_dp_accounting_on_the_same_event(kind):
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine(accountant=kind)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.3, max_grad_norm=1.0,
        noise_generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    train_one_epoch(model, optimizer, loader)
    train_one_epoch(model, optimizer, loader)
    steps = 2 * round(NUM_EXAMPLES / 8)
    assert engine.accountant.steps == steps
    expected = dp_accounting_epsilon(kind, 1.3, 8 / NUM_EXAMPLES, steps, 1e-5)
    assert engine.get_epsilon(1e-5) == pytest.approx(expected, rel=1e-9)


def test_every_step_is_counted_including_empty_batches():
    model, optimizer, loader = make_setup(batch_size=1)  # q = 1/40: about a third of the batches are empty
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        noise_generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    sizes = []
    for inputs, targets in loader:
        sizes.append(len(inputs))
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    assert 0 in sizes, "the seed should give at least one empty batch"
    assert engine.accountant.steps == len(sizes) == NUM_EXAMPLES


def test_make_private_with_epsilon_calibrates_over_epochs_times_len_loader():
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine()
    _, private_optimizer, private_loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=2.0, target_delta=1e-5, epochs=3,
        max_grad_norm=1.0,
    )  # fmt: skip
    sigma, steps = private_optimizer.noise_multiplier, 3 * len(loader)
    epsilon = dp_accounting_epsilon("pld", sigma, private_loader.sample_rate, steps, 1e-5)
    assert epsilon <= 2.0 and epsilon > 2.0 * 0.97  # within target, and tight
    assert len(private_loader) <= len(loader)  # an epoch of the private loader never exceeds the calibration


def test_per_layer_bounds_one_per_layer_or_one_per_parameter():
    model, optimizer, loader = make_setup()
    _, per_layer, _ = PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=[1.0, 2.0], clipping="per_layer")  # fmt: skip
    assert [len(g) for g in per_layer.clipper.groups] == [2, 2] and per_layer.clipper.bounds == (1.0, 2.0)
    model, optimizer, loader = make_setup()
    _, per_param, _ = PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=[1.0, 2.0, 3.0, 4.0],
                                                   clipping="per_layer")  # fmt: skip
    assert per_param.clipper.num_groups == 4
    assert per_param.clipper.total_bound == pytest.approx(math.sqrt(30.0))


def test_without_poisson_sampling_the_loader_is_kept_with_a_warning():
    model, optimizer, loader = make_setup()
    with pytest.warns(UserWarning, match="approximation"):
        _, private_optimizer, same_loader = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=False,
        )  # fmt: skip
    assert same_loader is loader and private_optimizer.sample_rate == pytest.approx(1 / len(loader))


def test_bandmf_uses_cyclic_sampling_and_records_its_bands():
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        noise_mechanism="bandmf", num_bands=2, total_steps=10, noise_seed=0,
    )  # fmt: skip
    assert loader.num_groups == 2 and optimizer.num_bands == 2
    train_one_epoch(model, optimizer, loader)
    assert engine.accountant.history[0].num_bands == 2


def test_ghost_mode_returns_three_values_and_trains_like_hooks():
    def run(mode):
        model, optimizer, loader = make_setup()
        private_model, private_optimizer, private_loader = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=0.5,
            grad_sample_mode=mode, noise_seed=7, noise_generator=None,
        )  # fmt: skip
        torch.manual_seed(0)  # same Poisson batches in both runs (global generator)
        train_one_epoch(private_model, private_optimizer, private_loader)
        return [p.detach() for p in model.parameters()]

    for a, b in zip(run("hooks"), run("ghost")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_checkpoint_round_trip_restores_model_optimizer_and_ledger(tmp_path):
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0, noise_seed=3)  # fmt: skip
    train_one_epoch(model, optimizer, loader)
    engine.save_checkpoint(path=tmp_path / "run.pt", module=model, optimizer=optimizer)

    fresh_model, fresh_optimizer, fresh_loader = make_setup(seed=5)
    fresh_engine = PrivacyEngine(accountant="rdp")
    fresh_model, fresh_optimizer, fresh_loader = fresh_engine.make_private(
        module=fresh_model, optimizer=fresh_optimizer, data_loader=fresh_loader, noise_multiplier=1.0,
        max_grad_norm=1.0, noise_seed=4,
    )  # fmt: skip
    # Opacus's way (no data_loader=): the noise continues from new generators, with a warning that says so.
    with pytest.warns(UserWarning, match="new generators"):
        fresh_engine.load_checkpoint(path=tmp_path / "run.pt", module=fresh_model, optimizer=fresh_optimizer)
    assert fresh_engine.get_epsilon(1e-5) == engine.get_epsilon(1e-5)
    assert fresh_optimizer.steps_taken == optimizer.steps_taken
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)
    # ... and training goes on from there, each step recorded once more.
    train_one_epoch(fresh_model, fresh_optimizer, fresh_loader)
    train_one_epoch(model, optimizer, loader)
    assert fresh_optimizer.steps_taken == optimizer.steps_taken
    assert fresh_engine.get_epsilon(1e-5) == pytest.approx(engine.get_epsilon(1e-5), rel=1e-9)


# ---------------------------------------------------------------------------- refused before wrapping
class Stream(IterableDataset):
    def __iter__(self):
        yield from ((torch.zeros(6), 0) for _ in range(4))


def _foreign_optimizer(model, optimizer, loader):
    return model, torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(2))], lr=0.1), loader


def _partial_optimizer(model, optimizer, loader):
    return model, torch.optim.SGD(model[0].parameters(), lr=0.1), loader


def _batchnorm_model(model, optimizer, loader):
    bad = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3))
    return bad, torch.optim.SGD(bad.parameters(), lr=0.1), loader


def _stream_loader(model, optimizer, loader):
    return model, optimizer, DataLoader(Stream(), batch_size=2)


def _unchanged(model, optimizer, loader):
    return model, optimizer, loader


BAD_CALLS = [
    (_foreign_optimizer, {}, ValueError, "not a parameter of the module"),
    (_partial_optimizer, {}, ValueError, "not in the optimizer"),
    (_batchnorm_model, {}, UnsupportedModuleError, "BatchNorm1d"),
    (_stream_loader, {}, TypeError, "dataset"),
    (_unchanged, {"noise_multiplier": -0.5}, ValueError, "noise_multiplier"),
    (_unchanged, {"noise_multiplier": math.nan}, ValueError, "noise_multiplier"),
    (_unchanged, {"max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
    (_unchanged, {"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
    (_unchanged, {"max_grad_norm": math.inf}, ValueError, "max_grad_norm"),
    (_unchanged, {"max_grad_norm": [1.0, 1.0, 1.0], "clipping": "per_layer"}, ValueError, "one per layer"),
    (_unchanged, {"max_grad_norm": [1.0, 0.0], "clipping": "per_layer"}, ValueError, r"max_grad_norm\[1\]"),
    (_unchanged, {"max_grad_norm": [1.0, 1.0]}, TypeError, "per_layer"),
    (_unchanged, {"clipping": "adaptive"}, ValueError, "clipping"),
    (_unchanged, {"loss_reduction": "none"}, ValueError, "loss_reduction"),
    (_unchanged, {"grad_sample_mode": "ghost_fsdp"}, ValueError, "grad_sample_mode"),
    (_unchanged, {"noise_seed": -3}, ValueError, "noise_seed"),
    (_unchanged, {"noise_mechanism": "laplace"}, ValueError, "noise_mechanism"),
]


def _call_make_private(engine, model, optimizer, loader, overrides):
    arguments = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, **overrides}
    return engine.make_private(module=model, optimizer=optimizer, data_loader=loader, **arguments)


def _snapshot(model, optimizer, loader):
    return (
        module_fingerprint(model),
        copy.deepcopy(optimizer.state_dict()),
        [id(p) for g in optimizer.param_groups for p in g["params"]],
        type(optimizer),
        (loader.batch_size, type(loader.sampler)),
    )


@pytest.mark.parametrize("prepare, overrides, error, match", BAD_CALLS)
def test_bad_input_raises_before_anything_is_wrapped(prepare, overrides, error, match):
    model, optimizer, loader = prepare(*make_setup())
    before = _snapshot(model, optimizer, loader)
    engine = PrivacyEngine()
    with pytest.raises(error, match=match):
        _call_make_private(engine, model, optimizer, loader, overrides)
    assert _snapshot(model, optimizer, loader) == before
    assert engine.accountant.steps == 0 and not engine.accountant.history


def test_after_a_refused_call_the_same_objects_can_be_made_private():
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine()
    with pytest.raises(ValueError):
        _call_make_private(engine, model, optimizer, loader, {"max_grad_norm": -1.0})
    private_model, _, _ = _call_make_private(engine, model, optimizer, loader, {})  # not "already hooked"
    assert isinstance(private_model, GradSampleModule)


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"target_delta": 0.0}, ValueError, "target_delta"),
        ({"target_delta": 1.0}, ValueError, "target_delta"),
        ({"target_epsilon": -1.0}, ValueError, "target_epsilon"),
        ({"epochs": 0}, ValueError, "epochs"),
        ({"noise_multiplier": 1.0}, TypeError, "noise_multiplier"),
        ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
        ({"unknown_option": 1}, TypeError, "unknown_option"),
    ],
)
def test_make_private_with_epsilon_refuses_bad_targets(overrides, error, match):
    model, optimizer, loader = make_setup()
    before = _snapshot(model, optimizer, loader)
    arguments = {"target_epsilon": 3.0, "target_delta": 1e-5, "epochs": 2, "max_grad_norm": 1.0, **overrides}
    with pytest.raises(error, match=match):
        PrivacyEngine().make_private_with_epsilon(module=model, optimizer=optimizer, data_loader=loader, **arguments)
    assert _snapshot(model, optimizer, loader) == before


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, math.nan])
def test_get_epsilon_refuses_delta_outside_the_open_unit_interval(delta):
    with pytest.raises(ValueError, match="delta"):
        PrivacyEngine().get_epsilon(delta)


def test_secure_mode_refuses_seeds_and_still_trains():
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine(secure_mode=True)
    for seeding in ({"noise_seed": 1}, {"noise_generator": torch.Generator().manual_seed(1)}):
        with pytest.raises(ValueError, match="secure_mode"):
            _call_make_private(engine, model, optimizer, loader, seeding)
    model, optimizer, loader = _call_make_private(engine, model, optimizer, loader, {})
    assert optimizer.noise.secure_mode
    train_one_epoch(model, optimizer, loader)
    assert engine.accountant.steps == len(loader)


def test_accountant_names():
    assert PrivacyEngine(accountant="prv").accountant_name == "pld"  # Opacus's default name
    assert PrivacyEngine(accountant="RDP").accountant_name == "rdp"
    with pytest.raises(ValueError, match="accountant"):
        PrivacyEngine(accountant="gdp")
    coarse = make_accountant("pld", value_discretization_interval=1e-3)
    assert PrivacyEngine(accountant=coarse).accountant is coarse
    coarse.step(noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises(ValueError, match="empty"):
        PrivacyEngine(accountant=coarse)
