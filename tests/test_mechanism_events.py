"""Noise mechanisms state their own privacy event (``NoiseMechanism.privacy_event`` / ``dp_event``); the
accountant composes what they state, a mechanism that states nothing is refused, and ledgers saved before
event kinds existed load with the same epsilon. References: dp-accounting's own events and accountants."""

from __future__ import annotations

import math
import random

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accountants import HistoryEntry, make_accountant
from accountants.events import EventSpec, Sampling, event_kinds, register_event_kind
from privacy_engine.engine import PrivacyEngine
from privacy_engine.noise import BandMFNoise, GaussianNoise, NoiseMechanism
from privacy_engine.training.distributed_noise import RankZeroNoise
from privacy_engine.training.optimizer import DPOptimizer

DELTA = 1e-5
NUM_EXAMPLES = 40


def dp_accounting_epsilon(kind: str, event: dp_accounting.DpEvent) -> float:
    accountant = dp_accounting.pld.PLDAccountant() if kind == "pld" else dp_accounting.rdp.RdpAccountant()
    return accountant.compose(event).get_epsilon(DELTA)


def poisson_gaussian(sigma: float, q: float, count: int) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count
    )


def random_setting(seed: int) -> tuple[float, float, int]:
    rng = random.Random(seed)
    return rng.uniform(0.6, 3.0), rng.uniform(0.001, 0.2), rng.randint(1, 60)


# ---------------------------------------------------------------------------- built-in mechanisms
@pytest.mark.parametrize("seed", range(3))
def test_gaussian_noise_states_poisson_subsampled_gaussian_per_step(seed):
    sigma, q, steps = random_setting(seed)
    event = GaussianNoise(seed=0).dp_event(noise_multiplier=sigma, sampling=Sampling(sample_rate=q), steps=steps)
    assert event == poisson_gaussian(sigma, q, steps)


@pytest.mark.parametrize("num_bands", [1, 2, 5])
@pytest.mark.parametrize("seed", range(2))
def test_bandmf_states_ceil_steps_over_bands_participations(num_bands, seed):
    sigma, q, steps = random_setting(seed)
    noise = BandMFNoise([1.0, 0.4, 0.2, 0.1, 0.05][:num_bands], seed=0)
    event = noise.dp_event(noise_multiplier=sigma, sampling=Sampling(sample_rate=q), steps=steps)
    assert event == poisson_gaussian(sigma, q, math.ceil(steps / num_bands))


def test_truncated_sampling_states_truncated_subsampled_gaussian():
    sampling = Sampling(sample_rate=0.05, group_size=300, max_batch_size=20)
    event = BandMFNoise([1.0, 0.5], seed=0).dp_event(noise_multiplier=1.3, sampling=sampling, steps=7)
    assert event == dp_accounting.SelfComposedDpEvent(
        dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=300, sampling_probability=0.05, truncated_batch_size=20, noise_multiplier=1.3
        ),
        4,
    )


def test_several_batches_per_release_state_a_binomial_mixture_of_gaussians():
    k, q, sigma = 3, 0.1, 1.2
    event = GaussianNoise(seed=0).dp_event(
        noise_multiplier=sigma, sampling=Sampling(sample_rate=q, batches_per_step=k), steps=5
    )
    mixture = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(
        standard_deviation=sigma,
        sensitivities=[0.0, 1.0, 2.0, 3.0],
        sampling_probs=[math.comb(k, m) * q**m * (1 - q) ** (k - m) for m in range(k + 1)],
    )
    assert event == dp_accounting.SelfComposedDpEvent(mixture, 5)


def test_rank_zero_noise_states_its_inner_mechanisms_event():
    inner = BandMFNoise([1.0, 0.3, 0.1], seed=0)
    assert RankZeroNoise(inner, job=object()).privacy_event() == inner.privacy_event() == EventSpec(num_bands=3)


@pytest.mark.parametrize("kind", ["pld", "rdp"])
@pytest.mark.parametrize(
    "noise", [GaussianNoise(seed=0), BandMFNoise([1.0, 0.5, 0.25], seed=0)], ids=["gaussian", "bandmf"]
)
def test_accountant_epsilon_of_a_stated_event_equals_dp_accountings(kind, noise):
    sigma, q, steps = 1.1, 0.05, 40
    accountant = make_accountant(kind)
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=q, **noise.privacy_event().step_kwargs())
    event = noise.dp_event(noise_multiplier=sigma, sampling=Sampling(sample_rate=q), steps=steps)
    assert accountant.get_epsilon(DELTA) == pytest.approx(dp_accounting_epsilon(kind, event), rel=1e-9)


def test_built_in_mechanisms_record_exactly_the_public_step_arguments():
    # No mechanism key for DP-SGD / BandMF: their steps merge with entries recorded by hand or loaded.
    assert GaussianNoise(seed=0).privacy_event().step_kwargs() == {"num_bands": 1}
    assert BandMFNoise([1.0, 0.5], seed=0).privacy_event().step_kwargs() == {"num_bands": 2}


# ---------------------------------------------------------------------------- a custom mechanism
def doubled_gaussian_event(*, noise_multiplier, sampling, steps, num_bands):
    """The event of a mechanism that adds twice DP-SGD's noise (Poisson sampling only)."""
    assert num_bands == 1 and not sampling.truncated and sampling.batches_per_step == 1
    return poisson_gaussian(2 * noise_multiplier, sampling.sample_rate, steps)


register_event_kind("test_doubled_gaussian", doubled_gaussian_event)


class DoubledNoise(GaussianNoise):
    """Twice DP-SGD's noise standard deviation; states so."""

    def noise_std(self, noise_multiplier: float, max_grad_norm: float) -> float:
        return 2 * super().noise_std(noise_multiplier, max_grad_norm)

    def privacy_event(self) -> EventSpec:
        return EventSpec(kind="test_doubled_gaussian")


class SilentNoise(NoiseMechanism):
    """A mechanism that does not say what its steps are."""

    def noise_std(self, noise_multiplier: float, max_grad_norm: float) -> float:
        return noise_multiplier * max_grad_norm


def make_setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(seed)
    dataset = TensorDataset(
        torch.randn(NUM_EXAMPLES, 6, generator=generator), torch.randint(0, 3, (NUM_EXAMPLES,), generator=generator)
    )
    return model, optimizer, DataLoader(dataset, batch_size=8)


def test_custom_mechanism_dp_event_is_the_one_it_states():
    event = DoubledNoise(seed=0).dp_event(noise_multiplier=0.7, sampling=Sampling(sample_rate=0.1), steps=9)
    assert event == poisson_gaussian(1.4, 0.1, 9)


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_engine_accounts_a_custom_mechanism_as_it_states(kind):
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine(accountant=kind)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=0.8, max_grad_norm=1.0,
        noise_mechanism=DoubledNoise(seed=0),
    )  # fmt: skip
    for inputs, targets in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    steps = optimizer.steps_taken
    assert steps > 0
    (entry,) = engine.accountant.history
    assert (entry.mechanism, entry.num_steps) == ("test_doubled_gaussian", steps)
    expected = dp_accounting_epsilon(kind, poisson_gaussian(1.6, loader.sample_rate, steps))
    assert engine.get_epsilon(DELTA) == pytest.approx(expected, rel=1e-9)
    assert engine.get_epsilon(DELTA) < dp_accounting_epsilon(kind, poisson_gaussian(0.8, loader.sample_rate, steps))


def test_make_private_with_epsilon_calibrates_a_custom_mechanism_for_the_event_it_states():
    # DoubledNoise adds 2 sigma C: calibrated for its own event, sigma is half of DP-SGD's for the same target.
    target_epsilon, epochs = 2.0, 2
    sigmas = {}
    for name, mechanism in [("custom", DoubledNoise(seed=0)), ("gaussian", "gaussian")]:
        model, optimizer, loader = make_setup()
        engine = PrivacyEngine(accountant="pld")
        engine.make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader, target_epsilon=target_epsilon, target_delta=DELTA,
            epochs=epochs, max_grad_norm=1.0, noise_mechanism=mechanism,
        )  # fmt: skip
        sigmas[name] = engine.noise_plan.noise_multiplier
        steps = epochs * len(loader)
        what_if = engine.accountant.fresh().epsilon_if(
            DELTA, noise_multiplier=sigmas[name], sample_rate=engine.noise_plan.sample_rate, num_steps=steps,
            **({"mechanism": "test_doubled_gaussian"} if name == "custom" else {}),
        )  # fmt: skip
        assert what_if <= target_epsilon * (1 + 1e-6)
        assert what_if > 0.95 * target_epsilon
    assert sigmas["custom"] == pytest.approx(sigmas["gaussian"] / 2, rel=2e-2)


def test_ledger_of_a_custom_kind_round_trips_as_plain_data():
    accountant = make_accountant("pld")
    accountant.step(noise_multiplier=0.9, sample_rate=0.1, num_steps=4, **DoubledNoise(seed=0).privacy_event().step_kwargs())
    state = accountant.state_dict()
    assert state["history"][0]["mechanism"] == "test_doubled_gaussian"
    restored = make_accountant("pld")
    restored.load_state_dict(state)
    assert restored.get_epsilon(DELTA) == accountant.get_epsilon(DELTA)


def test_dp_optimizer_refuses_a_mechanism_that_states_no_event():
    _, optimizer, _ = make_setup()
    accountant = make_accountant("pld")
    with pytest.raises(TypeError, match=r"SilentNoise does not state its privacy event.*privacy_event"):
        DPOptimizer(optimizer, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=8,
                    noise=SilentNoise(seed=0), accountant=accountant, sample_rate=0.2)  # fmt: skip
    assert accountant.steps == 0


def test_make_private_refuses_a_mechanism_that_states_no_event():
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine()
    with pytest.raises(TypeError, match=r"SilentNoise does not state its privacy event.*privacy_event"):
        engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                            max_grad_norm=1.0, noise_mechanism=SilentNoise(seed=0))  # fmt: skip
    assert engine.accountant.steps == 0


# ---------------------------------------------------------------------------- ledgers and the registry
#: ``HistoryEntry.to_dict`` entries as written before event kinds existed (no ``mechanism`` key).
OLD_LEDGER = [
    {"noise_multiplier": 1.1, "sample_rate": 0.02, "num_steps": 30, "num_bands": 1, "group_size": None,
     "max_batch_size": None, "source": "", "batches_per_step": 1},
    {"noise_multiplier": 0.9, "sample_rate": 0.05, "num_steps": 17, "num_bands": 4, "group_size": None,
     "max_batch_size": None, "source": "", "batches_per_step": 1},
]  # fmt: skip


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_old_format_ledger_loads_with_the_same_epsilon(kind):
    accountant = make_accountant(kind)
    accountant.load_state_dict(
        {"format": "privacy_engine.accountants/1", "accountant": kind, "settings": make_accountant(kind).settings(),
         "history": [dict(entry) for entry in OLD_LEDGER]}
    )  # fmt: skip
    expected = dp_accounting.ComposedDpEvent([poisson_gaussian(1.1, 0.02, 30), poisson_gaussian(0.9, 0.05, 5)])
    assert accountant.get_epsilon(DELTA) == pytest.approx(dp_accounting_epsilon(kind, expected), rel=1e-9)
    # and it is written back in the same format, key for key
    assert accountant.state_dict()["history"] == OLD_LEDGER


def test_old_format_entry_and_a_stated_event_merge():
    entry = HistoryEntry.from_dict(dict(OLD_LEDGER[1]))
    accountant = make_accountant("pld")
    accountant.step(noise_multiplier=0.9, sample_rate=0.05, num_steps=17, num_bands=4)
    accountant.step(noise_multiplier=0.9, sample_rate=0.05, **BandMFNoise([1.0, 0.5, 0.2, 0.1], seed=0)
                    .privacy_event().step_kwargs())  # fmt: skip
    assert accountant.history == (HistoryEntry(**{**entry.to_dict(), "num_steps": 18}),)


def test_ledger_with_an_unregistered_kind_is_refused_naming_it():
    entry = {**OLD_LEDGER[0], "mechanism": "not_a_registered_kind", "mechanism_parameters": {}}
    with pytest.raises(ValueError, match="not_a_registered_kind.*register_event_kind"):
        HistoryEntry.from_dict(entry)


def test_a_kind_cannot_be_registered_to_another_builder():
    assert "test_doubled_gaussian" in event_kinds()
    with pytest.raises(ValueError, match="already registered"):
        register_event_kind("test_doubled_gaussian", lambda **kwargs: dp_accounting.NoOpDpEvent())
    register_event_kind("test_doubled_gaussian", doubled_gaussian_event)  # the same builder again: a no-op


def test_event_parameters_must_be_plain_data():
    with pytest.raises(TypeError, match="'strategy'.*plain data"):
        EventSpec(parameters={"strategy": torch.ones(2)})
