"""Accountants against dp-accounting's own numbers on independently built DpEvents."""

from __future__ import annotations

import dataclasses
import json
import math

import dp_accounting
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accountants import (
    Accountant,
    HistoryEntry,
    PLDAccountant,
    RDPAccountant,
    bandmf_event,
    dpsgd_event,
    make_accountant,
    truncated_bandmf_event,
)

# A coarser PLD grid than the default keeps the tests fast; the comparison with dp-accounting
# uses the same grid, so it stays exact. One test covers the default grid.
FAST_GRID = 1e-3
DELTA = 1e-5


def fast_pld() -> PLDAccountant:
    return PLDAccountant(value_discretization_interval=FAST_GRID)


def reference_accountant(kind: str) -> dp_accounting.PrivacyAccountant:
    if kind == "pld":
        return dp_accounting.pld.PLDAccountant(value_discretization_interval=FAST_GRID)
    return dp_accounting.rdp.RdpAccountant()


def ours(kind: str) -> Accountant:
    return fast_pld() if kind == "pld" else RDPAccountant()


def subsampled_gaussian(sigma: float, q: float, count: int) -> dp_accounting.DpEvent:
    """Reference event, built by hand with dp-accounting's classes."""
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
        count,
    )


def reference_epsilon(
    kind: str, event: dp_accounting.DpEvent, delta: float = DELTA
) -> float:
    return reference_accountant(kind).compose(event).get_epsilon(delta)


KINDS = ["pld", "rdp"]


# ----------------------------------------------------------------------------- DP-SGD
@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=8, deadline=None)
@given(
    sigma=st.floats(0.8, 4.0),
    q=st.floats(0.001, 0.1),
    steps=st.integers(1, 300),
    delta=st.sampled_from([1e-3, 1e-5, 1e-7]),
)
def test_dpsgd_epsilon_equals_dp_accounting(kind, sigma, q, steps, delta):
    accountant = ours(kind)
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    expected = reference_epsilon(kind, subsampled_gaussian(sigma, q, steps), delta)
    assert accountant.get_epsilon(delta) == pytest.approx(expected, rel=1e-12)


def test_default_pld_grid_equals_dp_accounting_default():
    accountant = PLDAccountant()
    accountant.step(noise_multiplier=1.3, sample_rate=0.05, num_steps=40)
    expected = (
        dp_accounting.pld.PLDAccountant()
        .compose(subsampled_gaussian(1.3, 0.05, 40))
        .get_epsilon(DELTA)
    )
    assert accountant.get_epsilon(DELTA) == pytest.approx(expected, rel=1e-12)


def test_rdp_orders_are_passed_to_dp_accounting():
    orders = [1.5, 2.0, 4.0, 8.0, 16.0, 32.0]
    accountant = RDPAccountant(orders=orders)
    accountant.step(noise_multiplier=1.1, sample_rate=0.02, num_steps=100)
    event = subsampled_gaussian(1.1, 0.02, 100)
    expected = (
        dp_accounting.rdp.RdpAccountant(orders=orders).compose(event).get_epsilon(DELTA)
    )
    default = reference_epsilon("rdp", event)
    assert accountant.get_epsilon(DELTA) == pytest.approx(expected, rel=1e-12)
    assert expected != pytest.approx(default, rel=1e-6)  # the orders really matter here


def test_rdp_default_orders_are_dp_accountings():
    assert list(RDPAccountant().orders) == [
        float(o) for o in dp_accounting.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_get_delta_equals_dp_accounting(kind):
    accountant = ours(kind)
    accountant.step(noise_multiplier=1.0, sample_rate=0.05, num_steps=50)
    expected = (
        reference_accountant(kind)
        .compose(subsampled_gaussian(1.0, 0.05, 50))
        .get_delta(2.0)
    )
    assert accountant.get_delta(2.0) == pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------------------------- BandMF
@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=8, deadline=None)
@given(steps=st.integers(1, 80), num_bands=st.integers(1, 9), sigma=st.floats(0.7, 3.0))
def test_bandmf_composes_ceil_steps_over_bands(kind, steps, num_bands, sigma):
    q = 0.05
    accountant = ours(kind)
    accountant.step(
        noise_multiplier=sigma, sample_rate=q, num_steps=steps, num_bands=num_bands
    )
    participations = math.ceil(steps / num_bands)
    expected = reference_epsilon(kind, subsampled_gaussian(sigma, q, participations))
    assert accountant.get_epsilon(DELTA) == pytest.approx(expected, rel=1e-12)
    assert accountant.steps == steps  # steps, not participations


@pytest.mark.parametrize("kind", KINDS)
def test_bandmf_with_one_band_equals_dpsgd(kind):
    bandmf, dpsgd = ours(kind), ours(kind)
    bandmf.step(noise_multiplier=1.2, sample_rate=0.03, num_steps=70, num_bands=1)
    dpsgd.step(noise_multiplier=1.2, sample_rate=0.03, num_steps=70)
    assert bandmf_event(1.2, 0.03, 70, 1) == dpsgd_event(1.2, 0.03, 70)
    assert bandmf.get_epsilon(DELTA) == dpsgd.get_epsilon(DELTA)


@pytest.mark.parametrize("kind", KINDS)
def test_changed_mechanism_composes_each_entrys_own_ceil(kind):
    accountant = ours(kind)
    accountant.step(noise_multiplier=1.0, sample_rate=0.05, num_steps=5, num_bands=4)
    accountant.step(noise_multiplier=1.5, sample_rate=0.05, num_steps=3, num_bands=4)
    expected_event = dp_accounting.ComposedDpEvent(
        [subsampled_gaussian(1.0, 0.05, 2), subsampled_gaussian(1.5, 0.05, 1)]
    )
    assert accountant.event() == expected_event
    assert accountant.get_epsilon(DELTA) == pytest.approx(
        reference_epsilon(kind, expected_event), rel=1e-12
    )


# ----------------------------------------------------------------------------- truncated
@settings(max_examples=4, deadline=None)
@given(
    steps=st.integers(1, 40),
    num_bands=st.integers(1, 4),
    group_size=st.integers(50, 1000),
    cap_fraction=st.floats(0.5, 2.0),
)
def test_truncated_epsilon_equals_dp_accounting(
    steps, num_bands, group_size, cap_fraction
):
    q, sigma = 0.05, 1.2
    max_batch_size = max(1, round(cap_fraction * q * group_size))
    # A coarse grid: the truncated PLD is a mixture of two PLDs, several times dearer to build.
    grid = 5e-3
    accountant = PLDAccountant(value_discretization_interval=grid)
    accountant.step(
        noise_multiplier=sigma,
        sample_rate=q,
        num_steps=steps,
        num_bands=num_bands,
        group_size=group_size,
        max_batch_size=max_batch_size,
    )
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=group_size,
            sampling_probability=q,
            truncated_batch_size=max_batch_size,
            noise_multiplier=sigma,
        ),
        math.ceil(steps / num_bands),
    )
    assert accountant.event() == event
    expected = (
        dp_accounting.pld.PLDAccountant(value_discretization_interval=grid)
        .compose(event)
        .get_epsilon(DELTA)
    )
    assert accountant.get_epsilon(DELTA) == pytest.approx(expected, rel=1e-12)


def test_truncation_costs_privacy_when_it_binds():
    untruncated, truncated = fast_pld(), fast_pld()
    untruncated.step(noise_multiplier=1.0, sample_rate=0.05, num_steps=30)
    truncated.step(
        noise_multiplier=1.0,
        sample_rate=0.05,
        num_steps=30,
        group_size=400,
        max_batch_size=15,
    )
    assert truncated.get_epsilon(DELTA) > untruncated.get_epsilon(DELTA)


def test_rdp_refuses_truncation_naming_pld_and_records_nothing():
    accountant = RDPAccountant()
    accountant.step(noise_multiplier=1.0, sample_rate=0.01)
    with pytest.raises(NotImplementedError, match="PLDAccountant"):
        accountant.step(
            noise_multiplier=1.0, sample_rate=0.01, group_size=1000, max_batch_size=20
        )
    assert accountant.steps == 1


# ----------------------------------------------------------------------------- history
@pytest.mark.parametrize("kind", KINDS)
def test_merged_history_equals_step_by_step(kind):
    schedule = [(1.0, 0.02, 4)] * 7 + [(1.4, 0.02, 4)] * 5 + [(1.0, 0.02, 4)] * 3
    one_by_one, in_bulk = ours(kind), ours(kind)
    for sigma, q, bands in schedule:
        one_by_one.step(noise_multiplier=sigma, sample_rate=q, num_bands=bands)
    in_bulk.step(noise_multiplier=1.0, sample_rate=0.02, num_steps=7, num_bands=4)
    in_bulk.step(noise_multiplier=1.4, sample_rate=0.02, num_steps=5, num_bands=4)
    in_bulk.step(noise_multiplier=1.0, sample_rate=0.02, num_steps=3, num_bands=4)
    assert one_by_one.history == in_bulk.history
    assert [entry.num_steps for entry in one_by_one.history] == [7, 5, 3]
    assert one_by_one.steps == in_bulk.steps == len(schedule)
    assert one_by_one.get_epsilon(DELTA) == in_bulk.get_epsilon(DELTA)


def test_history_entries_are_frozen_with_a_count():
    accountant = RDPAccountant()
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=3)
    (entry,) = accountant.history
    assert (entry.count, entry.num_steps, entry.num_bands) == (3, 3, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.num_steps = 4


def test_numpy_scalars_are_normalised():
    accountant = RDPAccountant()
    accountant.step(
        noise_multiplier=np.float32(1.5),
        sample_rate=np.float64(0.25),
        num_steps=np.int64(2),
    )
    accountant.step(noise_multiplier=1.5, sample_rate=0.25, num_steps=1)
    (entry,) = accountant.history
    assert (
        entry.num_steps == 3
        and type(entry.num_steps) is int
        and type(entry.noise_multiplier) is float
    )
    json.dumps(accountant.state_dict())


def test_event_is_noop_single_or_composed():
    accountant = RDPAccountant()
    assert accountant.event() == dp_accounting.NoOpDpEvent()
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=4)
    assert accountant.event() == subsampled_gaussian(1.0, 0.1, 4)
    accountant.step(noise_multiplier=2.0, sample_rate=0.1, num_steps=2)
    assert accountant.event() == dp_accounting.ComposedDpEvent(
        [subsampled_gaussian(1.0, 0.1, 4), subsampled_gaussian(2.0, 0.1, 2)]
    )


# ----------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("kind", KINDS)
def test_no_steps_gives_zero_epsilon(kind):
    accountant = ours(kind)
    assert accountant.get_epsilon(DELTA) == 0.0
    accountant.step(noise_multiplier=1.0, sample_rate=0.5, num_steps=0)
    assert accountant.history == () and accountant.get_epsilon(DELTA) == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_zero_noise_gives_infinite_epsilon(kind):
    accountant = ours(kind)
    accountant.step(noise_multiplier=2.0, sample_rate=0.01, num_steps=10)
    accountant.step(noise_multiplier=0.0, sample_rate=0.01)
    assert accountant.get_epsilon(DELTA) == math.inf
    # dp-accounting agrees.
    assert reference_epsilon(kind, accountant.event()) == math.inf


@pytest.mark.parametrize("kind", KINDS)
def test_zero_sample_rate_gives_zero_epsilon(kind):
    accountant = ours(kind)
    accountant.step(noise_multiplier=0.0, sample_rate=0.0, num_steps=10)
    assert (
        accountant.get_epsilon(DELTA)
        == 0.0
        == reference_epsilon(kind, subsampled_gaussian(0.0, 0.0, 10))
    )


def test_builders_give_dp_accountings_structures():
    assert dpsgd_event(1.1, 0.01, 50) == subsampled_gaussian(1.1, 0.01, 50)
    assert bandmf_event(1.1, 0.01, 50, 4) == subsampled_gaussian(1.1, 0.01, 13)
    assert dpsgd_event(1.1, 0.01, 0) == dp_accounting.NoOpDpEvent()
    assert truncated_bandmf_event(
        1.1, 0.01, 9, 2, 100, 5
    ) == dp_accounting.SelfComposedDpEvent(
        dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=100,
            sampling_probability=0.01,
            truncated_batch_size=5,
            noise_multiplier=1.1,
        ),
        5,
    )


# ----------------------------------------------------------------------------- state dict
@pytest.mark.parametrize(
    "make",
    [
        lambda: PLDAccountant(value_discretization_interval=2e-3),
        lambda: RDPAccountant(orders=[2.0, 3.5, 8.0, 32.0]),
    ],
)
def test_state_dict_round_trip_through_json(make):
    accountant = make()
    accountant.step(noise_multiplier=1.1, sample_rate=0.02, num_steps=30)
    accountant.step(noise_multiplier=0.9, sample_rate=0.04, num_steps=9, num_bands=3)
    if isinstance(accountant, PLDAccountant):
        accountant.step(
            noise_multiplier=1.3,
            sample_rate=0.04,
            num_steps=5,
            group_size=500,
            max_batch_size=25,
        )
    # Default settings: loading must restore the saved ones.
    restored = type(accountant)()
    restored.load_state_dict(json.loads(json.dumps(accountant.state_dict())))
    assert restored.history == accountant.history
    assert restored.settings() == accountant.settings()
    assert restored.get_epsilon(DELTA) == accountant.get_epsilon(DELTA)
    # Recording continues where it left off (merging into the last entry).
    for acc in (accountant, restored):
        acc.step(
            noise_multiplier=acc.history[-1].noise_multiplier,
            sample_rate=acc.history[-1].sample_rate,
            num_bands=acc.history[-1].num_bands,
            group_size=acc.history[-1].group_size,
            max_batch_size=acc.history[-1].max_batch_size,
        )
    assert restored.history == accountant.history


def test_load_state_dict_of_other_kind_raises_and_changes_nothing():
    rdp = RDPAccountant()
    rdp.step(noise_multiplier=1.0, sample_rate=0.1)
    pld = fast_pld()
    pld.step(noise_multiplier=2.0, sample_rate=0.1, num_steps=2)
    before = pld.state_dict()
    with pytest.raises(ValueError, match="make_accountant\\('rdp'\\)"):
        pld.load_state_dict(rdp.state_dict())
    assert pld.state_dict() == before


@pytest.mark.parametrize(
    "corrupt, error, name",
    [
        (
            lambda d: d["history"][0].update(noise_multiplier=-1.0),
            ValueError,
            "noise_multiplier",
        ),
        (lambda d: d["history"][0].update(num_steps=0), ValueError, "num_steps"),
        (lambda d: d["history"][0].update(unknown=1), ValueError, "unknown"),
        (
            lambda d: d["settings"].update(value_discretization_interval=0.0),
            ValueError,
            "value_discretization",
        ),
        (lambda d: d.pop("history"), ValueError, "history"),
    ],
)
def test_load_state_dict_validates_before_changing_anything(corrupt, error, name):
    accountant = fast_pld()
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=3)
    before = accountant.state_dict()
    state = json.loads(json.dumps(before))
    corrupt(state)
    with pytest.raises(error, match=name):
        accountant.load_state_dict(state)
    assert accountant.state_dict() == before


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"noise_multiplier": -0.1}, ValueError, "noise_multiplier"),
        ({"noise_multiplier": math.nan}, ValueError, "noise_multiplier"),
        ({"noise_multiplier": math.inf}, ValueError, "noise_multiplier"),
        ({"noise_multiplier": "1.0x"}, TypeError, "noise_multiplier"),
        ({"noise_multiplier": True}, TypeError, "noise_multiplier"),
        ({"sample_rate": -0.01}, ValueError, "sample_rate"),
        ({"sample_rate": 1.01}, ValueError, "sample_rate"),
        ({"num_steps": -1}, ValueError, "num_steps"),
        ({"num_steps": 2.0}, TypeError, "num_steps"),
        ({"num_bands": 0}, ValueError, "num_bands"),
        ({"num_bands": 1.5}, TypeError, "num_bands"),
        ({"group_size": 100}, ValueError, "max_batch_size"),
        ({"max_batch_size": 10}, ValueError, "group_size"),
        ({"group_size": 0, "max_batch_size": 10}, ValueError, "group_size"),
        ({"group_size": 100, "max_batch_size": 0}, ValueError, "max_batch_size"),
    ],
)
@pytest.mark.parametrize("num_steps_default", [1, 0])
def test_bad_step_input_raises_naming_the_argument(
    kwargs, error, name, num_steps_default
):
    accountant = fast_pld()
    arguments = {
        "noise_multiplier": 1.0,
        "sample_rate": 0.1,
        "num_steps": num_steps_default,
        **kwargs,
    }
    with pytest.raises(error, match=name):
        accountant.step(**arguments)
    assert accountant.history == ()


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, math.nan, "1e-5"])
def test_bad_delta_raises_naming_delta(delta):
    accountant = RDPAccountant()
    accountant.step(noise_multiplier=1.0, sample_rate=0.1)
    with pytest.raises((ValueError, TypeError), match="delta"):
        accountant.get_epsilon(delta)


@pytest.mark.parametrize(
    "build, name",
    [
        (
            lambda: PLDAccountant(value_discretization_interval=-1e-4),
            "value_discretization_interval",
        ),
        (lambda: RDPAccountant(orders=[0.5, 2.0]), "orders"),
        (lambda: RDPAccountant(orders=[]), "orders"),
        (lambda: dpsgd_event(1.0, 2.0, 10), "sample_rate"),
        (lambda: bandmf_event(1.0, 0.1, 10, 0), "num_bands"),
        (lambda: truncated_bandmf_event(1.0, 0.1, 10, 1, None, 5), "group_size"),
        (
            lambda: HistoryEntry(noise_multiplier=1.0, sample_rate=0.1, num_steps=0),
            "num_steps",
        ),
    ],
)
def test_bad_constructor_and_builder_input_names_the_argument(build, name):
    with pytest.raises((ValueError, TypeError), match=name):
        build()


def test_make_accountant_by_name():
    assert isinstance(make_accountant("pld"), PLDAccountant)
    assert isinstance(make_accountant(" RDP "), RDPAccountant)
    assert (
        make_accountant(
            "pld", value_discretization_interval=1e-3
        ).value_discretization_interval
        == 1e-3
    )
    assert isinstance(make_accountant("rdp"), Accountant) and isinstance(
        make_accountant("pld"), Accountant
    )


def test_make_accountant_bad_name_lists_choices():
    with pytest.raises(ValueError, match=r"name.*\['pld', 'rdp'\].*'gdp'"):
        make_accountant("gdp")


def test_fresh_keeps_settings_drops_history():
    accountant = PLDAccountant(value_discretization_interval=5e-4)
    accountant.step(noise_multiplier=1.0, sample_rate=0.1)
    fresh = accountant.fresh()
    assert fresh.settings() == accountant.settings() and fresh.steps == 0
