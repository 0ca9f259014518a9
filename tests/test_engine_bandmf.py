"""PrivacyEngine with noise_mechanism="bandmf": the amplified accounting it records, the number of
bands it picks, truncated (fixed-shape) batches, ghost mode, resuming, and the errors it raises
before wrapping anything."""

from __future__ import annotations

import copy
import logging
import math

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from accountants import calibrate_noise_multiplier, make_accountant
from privacy_engine.engine import CANDIDATE_NUM_BANDS, PrivacyEngine
from privacy_engine.noise import BandMFNoise
from privacy_engine.noise.strategy import optimize_banded_toeplitz, strategy_loss
from tests.conftest import module_fingerprint

NUM_EXAMPLES = 40
DELTA = 1e-5
# dp-accounting's PLD on a 1e-3 grid (instead of 1e-4) is ~10x faster; engine and reference use the
# same setting, so they are still compared exactly.
PLD_INTERVAL = 1e-3


def fast_pld():
    return make_accountant("pld", value_discretization_interval=PLD_INTERVAL)


def make_model():
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def make_setup(batch_size=5, seed=0, num_examples=NUM_EXAMPLES):
    torch.manual_seed(seed)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(num_examples, 6, generator=generator)
    labels = torch.randint(0, 3, (num_examples,), generator=generator)
    return model, optimizer, DataLoader(TensorDataset(features, labels), batch_size=batch_size)


def train(model, optimizer, batches, criterion=nn.functional.cross_entropy):
    for inputs, targets in batches:
        optimizer.zero_grad()
        criterion(model(inputs), targets).backward()
        optimizer.step()


def amplified_event(noise_multiplier, sample_rate, steps, num_bands, *, group_size=None, max_batch_size=None):
    """Amplified BandMF, written out with dp-accounting's classes: ceil(steps / b) participations,
    each a Poisson-subsampled (optionally truncated) Gaussian."""
    participations = math.ceil(steps / num_bands)
    if max_batch_size is None:
        one = dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    else:
        one = dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=group_size, sampling_probability=sample_rate, truncated_batch_size=max_batch_size,
            noise_multiplier=noise_multiplier,
        )  # fmt: skip
    return dp_accounting.SelfComposedDpEvent(one, participations)


def dp_accounting_epsilon(kind, event, delta=DELTA):
    if kind == "pld":
        accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL)
    else:
        accountant = dp_accounting.rdp.RdpAccountant()
    return accountant.compose(event).get_epsilon(delta)


def bandmf(engine, setup, **overrides):
    model, optimizer, loader = setup
    arguments = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "noise_mechanism": "bandmf", **overrides}
    return engine.make_private(module=model, optimizer=optimizer, data_loader=loader, **arguments)


# ---------------------------------------------------------------------------- accounting
@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_epsilon_is_dp_accountings_amplified_bandmf_event(kind):
    engine = PrivacyEngine(accountant=fast_pld() if kind == "pld" else "rdp")
    model, optimizer, loader = bandmf(engine, make_setup(), num_bands=4, total_steps=16, noise_multiplier=1.3,
                                      noise_generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert loader.num_groups == 4 and optimizer.num_bands == 4 and engine.num_bands == 4
    train(model, optimizer, loader)
    train(model, optimizer, loader)
    steps = 2 * len(loader)
    assert engine.accountant.steps == steps
    sample_rate = 4 * 5 / NUM_EXAMPLES  # each step samples one group of N / b with p = b * batch / N
    assert loader.sample_rate == pytest.approx(sample_rate)
    expected = dp_accounting_epsilon(kind, amplified_event(1.3, sample_rate, steps, 4))
    assert engine.get_epsilon(DELTA) == pytest.approx(expected, rel=1e-9)
    # The amplification is real: the same steps as DP-SGD at the cyclic rate cost more.
    assert engine.get_epsilon(DELTA) < dp_accounting_epsilon(kind, amplified_event(1.3, sample_rate, steps, 1))


@pytest.mark.slow
def test_truncated_epsilon_is_dp_accountings_truncated_event_over_the_worst_group():
    engine = PrivacyEngine(accountant=fast_pld())
    model, optimizer, loader = bandmf(engine, make_setup(num_examples=42), num_bands=4, total_steps=18,
                                      max_batch_size=6, noise_seed=0,
                                      noise_generator=None)  # fmt: skip
    train(model, optimizer, loader)
    steps = engine.accountant.steps
    assert steps == len(loader) == round(42 / 5)  # one epoch of the private loader
    sizes = sorted({len(group) for group in loader.batch_sampler.groups})
    # Groups are assigned independently per example (add/remove adjacency), so sizes vary around 42 / 4.
    assert sum(len(group) for group in loader.batch_sampler.groups) == 42
    # The accounted size is the one with the largest epsilon (chosen over the planned 18 steps), which
    # need not be the largest size: truncation's epsilon is not monotone in the group size. Candidates are
    # |g| (an example removed) and |g| + 1 (an example added joins a group of |g|).
    candidates = sorted(set(sizes) | {n + 1 for n in sizes})
    planned = {n: dp_accounting_epsilon("pld", amplified_event(1.0, loader.sample_rate, 18, 4, group_size=n,
                                                                max_batch_size=6)) for n in candidates}  # fmt: skip
    chosen = engine.noise_plan.group_size
    assert chosen in candidates and planned[chosen] == max(planned.values())
    event = amplified_event(1.0, loader.sample_rate, steps, 4, group_size=chosen, max_batch_size=6)
    assert engine.get_epsilon(DELTA) == pytest.approx(dp_accounting_epsilon("pld", event), rel=1e-9)


@pytest.mark.slow
def test_the_worst_group_size_is_not_the_largest_where_truncation_costs_most_in_the_middle():
    from accountants.events import EventSpec
    from privacy_engine.engine.truncation import worst_group_size

    # q = 0.1, cap 8: the expected batch crosses the cap between 50 and 200 examples.
    sizes, steps = (50, 100, 200), 20
    size, sigma = worst_group_size(sizes, accountant=fast_pld(), target=None, noise_multiplier=1.0, sample_rate=0.1,
                                   steps=steps, event=EventSpec(), max_batch_size=8, delta=DELTA)  # fmt: skip
    candidates = sorted(set(sizes) | {n + 1 for n in sizes})  # |g| and |g| + 1 (an added example's group)
    reference = {n: dp_accounting_epsilon("pld", amplified_event(1.0, 0.1, steps, 1, group_size=n, max_batch_size=8))
                 for n in candidates}  # fmt: skip
    assert sigma == 1.0 and reference[size] == max(reference.values())
    assert size < max(sizes)
    # With a target, sigma is the largest calibrated one: the target holds for every size.
    size, sigma = worst_group_size(sizes, accountant=fast_pld(), target=(8.0, DELTA), noise_multiplier=0.0,
                                   sample_rate=0.1, steps=steps, event=EventSpec(), max_batch_size=8, delta=None)  # fmt: skip
    epsilons = [dp_accounting_epsilon("pld", amplified_event(sigma, 0.1, steps, 1, group_size=n, max_batch_size=8))
                for n in candidates]  # fmt: skip
    assert max(epsilons) <= 8.0 and max(epsilons) > 8.0 * 0.97


@pytest.mark.parametrize("max_batch_size", [None, 7])
def test_make_private_with_epsilon_calibrates_bandmf_within_the_target(max_batch_size):
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine(accountant=fast_pld())
    _, private_optimizer, private_loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=2.0, target_delta=DELTA, epochs=3,
        max_grad_norm=1.0, noise_mechanism="bandmf", num_bands=2, max_batch_size=max_batch_size,
    )  # fmt: skip
    sigma, steps = private_optimizer.noise_multiplier, 3 * len(loader)
    sizes = [None] if max_batch_size is None else sorted({len(g) + extra for g in private_loader.batch_sampler.groups
                                                          for extra in (0, 1)})  # fmt: skip
    # Every group, with an example removed or added, is within the target (truncation: sigma is
    # calibrated for the worst size).
    epsilons = [dp_accounting_epsilon("pld", amplified_event(sigma, private_loader.sample_rate, steps, 2, group_size=n,
                                                             max_batch_size=max_batch_size)) for n in sizes]  # fmt: skip
    assert 2.0 * 0.97 < max(epsilons) <= 2.0
    assert len(private_loader) <= len(loader)  # an epoch never exceeds what calibration assumed


# ---------------------------------------------------------------------------- b = 1 is DP-SGD
def test_one_band_through_the_engine_is_dp_sgd():
    def run(mechanism):
        engine = PrivacyEngine(accountant=fast_pld())
        extra = {"num_bands": 1, "total_steps": 8} if mechanism == "bandmf" else {}
        model, optimizer, loader = engine.make_private(
            module=(setup := make_setup())[0], optimizer=setup[1], data_loader=setup[2], noise_multiplier=0.8,
            max_grad_norm=0.7, noise_mechanism=mechanism, noise_generator=torch.Generator().manual_seed(3), **extra,
        )  # fmt: skip
        train(model, optimizer, loader)
        return [p.detach().clone() for p in model.parameters()], engine.get_epsilon(DELTA), engine.accountant.history

    dpsgd_params, dpsgd_epsilon, dpsgd_history = run("gaussian")
    bandmf_params, bandmf_epsilon, bandmf_history = run("bandmf")
    for a, b in zip(dpsgd_params, bandmf_params):
        assert torch.equal(a, b)  # same batches, same noise
    assert bandmf_epsilon == dpsgd_epsilon and bandmf_history == dpsgd_history


def test_one_band_calibrates_to_the_dp_sgd_noise_multiplier():
    sigmas = []
    for extra in ({}, {"noise_mechanism": "bandmf", "num_bands": 1}):
        model, optimizer, loader = make_setup()
        _, private_optimizer, _ = PrivacyEngine(accountant=fast_pld()).make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader, target_epsilon=3.0, target_delta=DELTA, epochs=2,
            max_grad_norm=1.0, **extra,
        )  # fmt: skip
        sigmas.append(private_optimizer.noise_multiplier)
    assert sigmas[0] == sigmas[1]


# ---------------------------------------------------------------------------- choosing b
def _allowed_bands(batch_size, num_examples, steps):
    steps_per_epoch = math.ceil(num_examples / batch_size)
    return [b for b in CANDIDATE_NUM_BANDS if b <= steps_per_epoch and b * batch_size <= num_examples and b <= steps]


def test_with_a_given_sigma_num_bands_is_required_before_anything_is_wrapped():
    # At one sigma more bands always give less error but cost more epsilon: no fair automatic choice.
    engine = PrivacyEngine()
    model, optimizer, loader = make_setup(batch_size=2)
    fingerprint = module_fingerprint(model)
    with pytest.raises(ValueError, match="needs num_bands") as error:
        bandmf(engine, (model, optimizer, loader), total_steps=30, noise_multiplier=1.1)
    assert "make_private_with_epsilon" in str(error.value)
    assert module_fingerprint(model) == fingerprint and engine.noise_plan is None


def test_with_a_target_each_band_count_gets_its_own_sigma_and_the_best_is_chosen(caplog):
    batch_size, epochs = 4, 3
    model, optimizer, loader = make_setup(batch_size=batch_size)
    engine = PrivacyEngine(accountant=fast_pld())
    with caplog.at_level(logging.INFO, logger="privacy_engine.engine"):
        _, private_optimizer, private_loader = engine.make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader, target_epsilon=4.0, target_delta=DELTA,
            epochs=epochs, max_grad_norm=1.0, noise_mechanism="bandmf",
        )  # fmt: skip
    steps = epochs * len(loader)
    allowed = _allowed_bands(batch_size, NUM_EXAMPLES, steps)
    assert [c.num_bands for c in engine.noise_plan.candidates] == allowed == [1, 2, 4, 8]
    # The criterion, recomputed independently: each b calibrated on the default PLD accountant.
    errors = {}
    for b in allowed:
        sigma = calibrate_noise_multiplier(4.0, DELTA, b * batch_size / NUM_EXAMPLES, steps, num_bands=b,
                                           accountant=fast_pld())  # fmt: skip
        errors[b] = strategy_loss(optimize_banded_toeplitz(steps, b), steps) * sigma**2
    chosen = engine.num_bands
    assert chosen == private_optimizer.num_bands == private_loader.num_groups
    # The engine compares with a coarser search tolerance; its pick is the argmin up to that.
    assert errors[chosen] <= min(errors.values()) * 1.01
    assert f"num_bands={chosen} chosen" in caplog.text
    # The final sigma is calibrated on the engine's own accountant for the chosen b.
    event = amplified_event(private_optimizer.noise_multiplier, private_loader.sample_rate, steps, chosen)
    assert dp_accounting_epsilon("pld", event) <= 4.0


def test_given_coefficients_fix_the_bands_and_are_used_as_given():
    coefficients = [1.0, 0.4, 0.2]
    engine = PrivacyEngine()
    _, optimizer, loader = bandmf(engine, make_setup(), bandmf_coefficients=coefficients)
    assert isinstance(optimizer.noise, BandMFNoise) and optimizer.noise.coefficients.tolist() == coefficients
    assert engine.num_bands == loader.num_groups == 3 and not engine.noise_plan.candidates


# ---------------------------------------------------------------------------- truncated batches
@pytest.mark.parametrize("grad_sample_mode", ["hooks", "ghost"])
def test_truncated_batches_have_one_shape_and_padding_contributes_zero(grad_sample_mode):
    max_grad_norm, max_batch_size = 0.5, 9
    model, optimizer, loader = make_setup(batch_size=5)
    wrapped = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=0.0, max_grad_norm=max_grad_norm,
        noise_mechanism="bandmf", num_bands=2, total_steps=16, max_batch_size=max_batch_size,
        grad_sample_mode=grad_sample_mode, noise_generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    private_model, private_optimizer, private_loader = wrapped
    padded_batches = 0
    for inputs, targets in private_loader:
        assert inputs.shape == (max_batch_size, 6) and targets.shape == (max_batch_size,)
        mask = private_loader.padding_mask
        assert mask is not None and mask.shape == (max_batch_size,)
        padded_batches += bool(mask.any())
        # Reference, float64: clip each real example's own gradient, sum, divide by the expected batch.
        reference = make_model().double()
        reference.load_state_dict(model.state_dict())
        expected = [torch.zeros_like(p) for p in reference.parameters()]
        for i in torch.nonzero(~mask).flatten().tolist():
            reference.zero_grad()
            loss = nn.functional.cross_entropy(reference(inputs[i : i + 1].double()), targets[i : i + 1])
            grads = torch.autograd.grad(loss, list(reference.parameters()))
            factor = min(1.0, max_grad_norm / float(torch.sqrt(sum((g**2).sum() for g in grads))))
            for total, grad in zip(expected, grads):
                total += factor * grad
        private_optimizer.zero_grad()
        nn.functional.cross_entropy(private_model(inputs), targets).backward()
        private_optimizer.step()
        for param, total in zip(model.parameters(), expected):
            torch.testing.assert_close(param.grad.double(), total / private_optimizer.expected_batch_size,
                                       rtol=1e-5, atol=1e-7)  # fmt: skip
    assert padded_batches > 0  # the cap is above the expected 5, so padding occurs


# ---------------------------------------------------------------------------- ghost mode, resume
def test_bandmf_trains_the_same_in_ghost_and_hooks_mode():
    def run(mode):
        model, optimizer, loader = make_setup()
        private_model, private_optimizer, private_loader = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=0.5,
            noise_mechanism="bandmf", num_bands=2, total_steps=16, grad_sample_mode=mode,
            noise_generator=torch.Generator().manual_seed(5),
        )  # fmt: skip
        for _ in range(2):
            train(private_model, private_optimizer, private_loader)
        return [p.detach() for p in model.parameters()]

    for a, b in zip(run("hooks"), run("ghost")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_resuming_from_a_checkpoint_continues_the_bandmf_noise_sequence(tmp_path):
    settings = {"num_bands": 4, "total_steps": 16, "max_grad_norm": 0.5}
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = bandmf(engine, make_setup(), noise_seed=11, **settings)
    batches = iter(loader)
    train(model, optimizer, [next(batches) for _ in range(5)])
    engine.save_checkpoint(path=tmp_path / "run.pt", module=model, optimizer=optimizer, data_loader=loader)
    # The rest of the run, fed identically to every run below: only the noise can differ.
    later_batches = [next(batches) for _ in range(3)]

    def last_steps(run_model, run_optimizer, run_batches):
        grads = []
        for inputs, targets in run_batches:
            run_optimizer.zero_grad()
            nn.functional.cross_entropy(run_model(inputs), targets).backward()
            run_optimizer.step()
            grads.append([p.grad.clone() for p in run_model.parameters()])
        return grads

    resumed_engine = PrivacyEngine(accountant="rdp")
    def other_setup():  # another initialisation (the checkpoint restores it), the same examples
        return (*make_setup(seed=3)[:2], make_setup()[2])

    resumed_model, resumed_optimizer, resumed_loader = bandmf(resumed_engine, other_setup(), noise_seed=99,
                                                              **settings)  # fmt: skip
    resumed_engine.load_checkpoint(path=tmp_path / "run.pt", module=resumed_model, optimizer=resumed_optimizer,
                                   data_loader=resumed_loader)  # fmt: skip
    other_model, other_optimizer, other_loader = bandmf(PrivacyEngine(accountant="rdp"), other_setup(),
                                                        noise_seed=99, **settings)  # fmt: skip
    other_model.load_state_dict(resumed_model.state_dict())  # same weights, but the noise state not restored
    other_loader.load_state_dict(resumed_loader.state_dict())  # and the same batches
    # Each optimizer releases only its own loader's batches: the restored samplers draw the same ones.
    resumed_batches = [batch for batch, _ in zip(resumed_loader, range(3))]
    other_batches = [batch for batch, _ in zip(other_loader, range(3))]
    for mine, theirs, other in zip(later_batches, resumed_batches, other_batches):
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(mine, theirs, other))

    expected = last_steps(model, optimizer, later_batches)
    for step_grads, resumed_grads in zip(expected, last_steps(resumed_model, resumed_optimizer, resumed_batches)):
        for a, b in zip(step_grads, resumed_grads):
            assert torch.equal(a, b)
    assert not torch.equal(last_steps(other_model, other_optimizer, other_batches)[0][0], expected[0][0])
    assert resumed_engine.get_epsilon(DELTA) == engine.get_epsilon(DELTA)
    # Sampling resumes with the same groups at step 5 (group 5 mod 4), keeping participations b apart.
    for saved_group, resumed_group in zip(loader.batch_sampler.groups, resumed_loader.batch_sampler.groups):
        assert torch.equal(saved_group, resumed_group)
    features = loader.dataset.tensors[0]
    group = set(loader.batch_sampler.groups[5 % 4].tolist())
    inputs = resumed_batches[0][0]  # the resumed loader's first batch: step 5
    rows = [i for i in range(len(features)) if any(torch.equal(features[i], x) for x in inputs)]
    assert set(rows) <= group


# ---------------------------------------------------------------------------- refused before wrapping
class Stream(IterableDataset):
    def __iter__(self):
        yield from ((torch.zeros(6), 0) for _ in range(4))


BAD_CALLS = [
    ({"poisson_sampling": False}, ValueError, "poisson_sampling"),
    ({"num_bands": 9}, ValueError, "num_bands=9 exceeds the 8 steps per epoch"),
    ({"num_bands": 0}, ValueError, "num_bands"),
    ({"bandmf_coefficients": [-1.0, 0.5]}, ValueError, r"bandmf_coefficients\[0\]"),
    ({"bandmf_coefficients": [0.0, 0.5]}, ValueError, r"bandmf_coefficients\[0\]"),
    ({"bandmf_coefficients": [1.0, math.nan]}, ValueError, "bandmf_coefficients"),
    ({"bandmf_coefficients": [1.0, 0.5], "num_bands": 3}, ValueError, "num_bands=3"),
    ({"num_bands": 2, "total_steps": None}, ValueError, "total_steps"),
    ({"max_batch_size": 0}, ValueError, "max_batch_size"),
]


def _snapshot(model, optimizer, loader):
    return (module_fingerprint(model), copy.deepcopy(optimizer.state_dict()), (loader.batch_size, type(loader.sampler)))


@pytest.mark.parametrize("overrides, error, match", BAD_CALLS)
def test_bad_bandmf_input_raises_before_anything_is_wrapped(overrides, error, match):
    setup = make_setup()
    before = _snapshot(*setup)
    engine = PrivacyEngine()
    with pytest.raises(error, match=match):
        bandmf(engine, setup, **{"total_steps": 16, **overrides})
    assert _snapshot(*setup) == before and engine.noise_plan is None and not engine.accountant.history


def test_a_loader_over_an_iterable_dataset_cannot_be_sampled_cyclically():
    model, optimizer, _ = make_setup()
    with pytest.raises(TypeError, match="cyclic Poisson sampling"):
        bandmf(PrivacyEngine(), (model, optimizer, DataLoader(Stream(), batch_size=2)), num_bands=2, total_steps=4)


def test_more_bands_than_the_dataset_can_fill_is_refused():
    # 40 examples, batch 7: 6 steps per epoch, but 6 groups of ~6 examples cannot give batches of 7.
    with pytest.raises(ValueError, match="num_bands=6 with batch_size=7 needs 42 examples"):
        bandmf(PrivacyEngine(), make_setup(batch_size=7), num_bands=6, total_steps=12)


def test_truncation_with_the_rdp_accountant_names_the_pld_accountant():
    setup = make_setup()
    with pytest.raises(NotImplementedError, match="PLDAccountant"):
        bandmf(PrivacyEngine(accountant="rdp"), setup, num_bands=2, total_steps=16, max_batch_size=8)
