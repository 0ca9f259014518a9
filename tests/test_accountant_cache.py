"""Cached compositions: the same epsilon as dp-accounting's own composition of the same event, asked
every step, whatever entry a step lands in; "what if" questions that change nothing.

Every reference is dp-accounting composing `accountant.event()` from scratch with the same
settings. PLD grids are coarse (1e-3, 1e-2): equality to dp-accounting does not depend on the grid.
"""

from __future__ import annotations

import copy
import math
import pickle

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from accountants import PLDAccountant, RDPAccountant, _pld_ops
from accountants import pld as pld_module

DELTA = 1e-5


def dp_epsilon(accountant, delta=DELTA):
    """dp-accounting's epsilon for everything `accountant` recorded, composed from scratch."""
    if isinstance(accountant, PLDAccountant):
        fresh = dp_accounting.pld.PLDAccountant(value_discretization_interval=accountant.value_discretization_interval)
    else:
        fresh = dp_accounting.rdp.RdpAccountant(orders=list(accountant.orders))
    return fresh.compose(accountant.event()).get_epsilon(delta)


def pld_atoms(grid):
    return {
        "poisson_gaussian": pld_lib.from_gaussian_mechanism(1.1, value_discretization_interval=grid, sampling_prob=0.03),
        "truncated": pld_lib.from_truncated_subsampled_gaussian_mechanism(
            dataset_size=400, sampling_probability=0.05, truncated_batch_size=25, noise_multiplier=1.2,
            value_discretization_interval=grid,
        ),
        "mixture": pld_lib.from_mixture_gaussian_mechanism(
            standard_deviation=1.5, sensitivities=[0.0, 1.0, 2.0], sampling_probs=[0.9025, 0.095, 0.0025],
            value_discretization_interval=grid,
        ),
    }  # fmt: skip


def same_pmf(first, second):
    first, second = first.to_dense_pmf(), second.to_dense_pmf()
    return (
        np.array_equal(first._probs, second._probs)
        and first._lower_loss == second._lower_loss
        and first._infinity_mass == second._infinity_mass
    )


# ---------------------------------------------------------------------------- dp-accounting's operations
@pytest.mark.parametrize("kind", ["poisson_gaussian", "truncated", "mixture"])
def test_fast_compose_is_dp_accountings_bit_for_bit_and_epsilon_search_its_value(kind):
    atom = pld_atoms(1e-2)[kind]
    composed = atom.self_compose(40)
    ours, theirs = _pld_ops.compose(composed, atom), composed.compose(atom)
    assert same_pmf(ours._pmf_remove, theirs._pmf_remove) and same_pmf(ours._pmf_add, theirs._pmf_add)
    # The cached spectrum of the second operand is reused on the second call: still identical.
    again = _pld_ops.compose(composed, atom)
    assert same_pmf(again._pmf_remove, theirs._pmf_remove)
    start = _pld_ops.identity(1e-2)
    assert same_pmf(_pld_ops.compose(start, composed)._pmf_add, pld_lib.identity(1e-2).compose(composed)._pmf_add)
    for delta in (0.3, 1e-3, 1e-5, 1e-9, 1e-14):
        # Same sums in the same order; only numpy's exp against math.exp could differ (last bit).
        assert _pld_ops.epsilon_for_delta(theirs, delta) == pytest.approx(
            theirs.get_epsilon_for_delta(delta), rel=1e-14
        )


def test_epsilon_search_edge_cases_match_dp_accounting():
    atom = pld_atoms(1e-2)["poisson_gaussian"].self_compose(3)
    # delta below the infinity mass: inf; delta near 1: 0.
    for delta in (1e-300, 0.999999):
        assert _pld_ops.epsilon_for_delta(atom, delta) == pytest.approx(atom.get_epsilon_for_delta(delta), rel=1e-14)
    assert _pld_ops.epsilon_for_delta(pld_lib.identity(1e-2), 1e-5) == pld_lib.identity(1e-2).get_epsilon_for_delta(
        1e-5
    )


# ---------------------------------------------------------------------------- one entry, exactly dp-accounting's
STEP_KINDS = {
    "dpsgd": {"noise_multiplier": 1.1, "sample_rate": 0.03},
    "bandmf": {"noise_multiplier": 1.1, "sample_rate": 0.06, "num_bands": 3},
    "truncated": {"noise_multiplier": 1.2, "sample_rate": 0.05, "group_size": 400, "max_batch_size": 25},
    "accumulated": {"noise_multiplier": 1.5, "sample_rate": 0.05, "batches_per_step": 2},
}


@pytest.mark.parametrize("kind", sorted(STEP_KINDS))
def test_one_entry_is_dp_accountings_composition(kind):
    accountant = PLDAccountant(value_discretization_interval=1e-2)
    accountant.step(**STEP_KINDS[kind], num_steps=25)
    assert accountant.get_epsilon(DELTA) == pytest.approx(dp_epsilon(accountant), rel=1e-14)
    assert accountant._composition().drift == 0


# ---------------------------------------------------------------------------- asked every step
def test_epsilon_asked_every_step_is_within_1e9_of_dp_accounting_and_reuses_the_cache():
    accountant = PLDAccountant(value_discretization_interval=1e-2)
    drifts = []
    for _ in range(pld_module.MAX_DRIFT + 12):
        accountant.step(noise_multiplier=1.0, sample_rate=0.02)
        assert accountant.get_epsilon(DELTA) == pytest.approx(dp_epsilon(accountant), abs=1e-9, rel=0)
        drifts.append(accountant._composition().drift)
    # Composed onto the cached value step by step, then rebuilt as dp-accounting builds it.
    assert max(drifts) == pld_module.MAX_DRIFT and drifts[pld_module.MAX_DRIFT + 1] == 0


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_alternating_mechanisms_interleaved_sources_bandmf_and_truncation_match_dp_accounting(kind):
    accountant = PLDAccountant(value_discretization_interval=1e-2) if kind == "pld" else RDPAccountant()
    steps = [
        {"noise_multiplier": 1.0, "sample_rate": 0.02},
        {"noise_multiplier": 1.3, "sample_rate": 0.02},
        {"noise_multiplier": 1.1, "sample_rate": 0.05, "num_bands": 3, "source": "second"},
    ]
    if kind == "pld":
        steps.append({"noise_multiplier": 1.2, "sample_rate": 0.05, "group_size": 400, "max_batch_size": 25,
                      "source": "third"})  # fmt: skip
    for index in range(24):
        # Alternating mechanisms (a new entry each step), other sources merged into earlier entries.
        accountant.step(**steps[index % 2])
        if index % 3 == 0:
            accountant.step(**steps[2 + (index // 3) % (len(steps) - 2)])
        epsilon = accountant.get_epsilon(DELTA)  # asked every step: extends the cached composition
        if index in (4, 23):
            if kind == "rdp":
                assert epsilon == dp_epsilon(accountant)
            else:
                assert epsilon == pytest.approx(dp_epsilon(accountant), abs=1e-9, rel=0)
    assert len(accountant.history) > 24


def test_rdp_computes_each_atom_once(monkeypatch):
    from dp_accounting.rdp import rdp_privacy_accountant

    calls = []
    original = rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(rdp_privacy_accountant, "_compute_rdp_poisson_subsampled_gaussian", counting)
    accountant = RDPAccountant()
    for index in range(30):
        accountant.step(noise_multiplier=1.0 + (index % 2), sample_rate=0.01)
        accountant.get_epsilon(DELTA)
        accountant.get_epsilon(1e-6)
        accountant.epsilon_if(DELTA, noise_multiplier=1.0, sample_rate=0.01)
    assert len(calls) == 2  # one RDP evaluation per distinct mechanism, ever


# ---------------------------------------------------------------------------- what if
def test_epsilon_if_is_the_epsilon_after_the_step_and_changes_nothing():
    accountant = PLDAccountant(value_discretization_interval=1e-3)
    accountant.step(noise_multiplier=1.0, sample_rate=0.02, num_steps=30)
    before = accountant.history
    predicted = accountant.epsilon_if(DELTA, noise_multiplier=1.0, sample_rate=0.02, source="other")
    assert accountant.history == before
    built = []
    original = accountant._build_composition
    accountant._build_composition = lambda sequence: built.append(1) or original(sequence)
    accountant.step(noise_multiplier=1.0, sample_rate=0.02, source="other")
    assert accountant.get_epsilon(DELTA) == predicted and not built  # found in the cache
    assert predicted == pytest.approx(dp_epsilon(accountant), abs=1e-9, rel=0)


def test_what_if_questions_refuse_bad_steps_like_step_does():
    accountant = RDPAccountant()
    with pytest.raises(NotImplementedError, match="PLDAccountant"):
        accountant.epsilon_if(DELTA, noise_multiplier=1.0, sample_rate=0.1, group_size=10, max_batch_size=2)
    with pytest.raises(ValueError, match="noise_multiplier"):
        accountant.would_exceed(1.0, DELTA, noise_multiplier=-1.0, sample_rate=0.1)
    with pytest.raises(TypeError, match="num_steps"):
        accountant.steps_left(1.0, DELTA, noise_multiplier=1.0, sample_rate=0.1, num_steps=2)
    with pytest.raises(ValueError, match="max_epsilon"):
        accountant.steps_left(-1.0, DELTA, noise_multiplier=1.0, sample_rate=0.1)
    assert accountant.history == ()


@pytest.mark.parametrize(
    ("kind", "step"),
    [
        ("pld", {"noise_multiplier": 1.0, "sample_rate": 0.05}),
        ("pld", {"noise_multiplier": 1.0, "sample_rate": 0.1, "num_bands": 3}),
        ("pld", {"noise_multiplier": 1.0, "sample_rate": 0.05, "group_size": 400, "max_batch_size": 40}),
        ("rdp", {"noise_multiplier": 1.0, "sample_rate": 0.05}),
    ],
)
def test_steps_left_is_the_boundary_dp_accounting_draws(kind, step):
    accountant = PLDAccountant(value_discretization_interval=1e-2) if kind == "pld" else RDPAccountant()
    accountant.step(noise_multiplier=1.3, sample_rate=0.05, num_steps=7, source="before")
    max_epsilon = 2.5
    left = accountant.steps_left(max_epsilon, DELTA, **step)
    assert left > 3
    within, over = copy.deepcopy(accountant), copy.deepcopy(accountant)
    within.step(**step, num_steps=left)
    over.step(**step, num_steps=left + 1)
    assert dp_epsilon(within) <= max_epsilon < dp_epsilon(over)
    # The guard's one-step decision agrees at both ends, and nothing was recorded.
    assert not within.would_exceed(max_epsilon, DELTA, num_steps=0, **step)
    assert accountant.history[-1].source == "before" and accountant.steps == 7
    last = copy.deepcopy(accountant)
    last.step(**step, num_steps=left)
    assert last.would_exceed(max_epsilon, DELTA, **step)


def test_steps_left_edge_cases():
    accountant = PLDAccountant(value_discretization_interval=1e-2)
    assert accountant.steps_left(1.0, DELTA, noise_multiplier=1.0, sample_rate=0.0, limit=1000) == 1000
    assert accountant.steps_left(1.0, DELTA, noise_multiplier=0.0, sample_rate=0.1) == 0
    accountant.step(noise_multiplier=0.8, sample_rate=0.2, num_steps=50)
    assert accountant.get_epsilon(DELTA) > 1.0
    assert accountant.steps_left(1.0, DELTA, noise_multiplier=5.0, sample_rate=0.01) == 0


def test_the_decision_at_the_boundary_is_dp_accountings_not_the_cached_value():
    accountant = PLDAccountant(value_discretization_interval=1e-3)
    accountant.step(noise_multiplier=1.0, sample_rate=0.02, num_steps=20)
    accountant.get_epsilon(DELTA)
    for _ in range(5):  # drifted: composed onto the cached value
        accountant.step(noise_multiplier=1.0, sample_rate=0.02)
        cached = accountant.get_epsilon(DELTA)
    assert accountant._composition().drift == 5
    exact = dp_epsilon(accountant)
    assert cached != exact and abs(cached - exact) < 1e-9
    # A budget exactly at dp-accounting's value holds; one a hair below it does not, whichever side
    # of it the cached value lies.
    assert not accountant.would_exceed(exact, DELTA, noise_multiplier=1.0, sample_rate=0.02, num_steps=0)
    assert accountant.would_exceed(math.nextafter(exact, 0.0), DELTA, noise_multiplier=1.0, sample_rate=0.02,
                                   num_steps=0)  # fmt: skip


# ---------------------------------------------------------------------------- state
def test_loading_another_history_gives_its_own_epsilon():
    first = PLDAccountant(value_discretization_interval=1e-2)
    first.step(noise_multiplier=1.0, sample_rate=0.05, num_steps=40)
    first.get_epsilon(DELTA)
    second = PLDAccountant(value_discretization_interval=1e-2)
    second.step(noise_multiplier=1.0, sample_rate=0.05, num_steps=10)
    first.load_state_dict(second.state_dict())
    assert first.get_epsilon(DELTA) == dp_epsilon(second)


def test_copies_and_pickles_carry_the_ledger_not_the_cache():
    accountant = PLDAccountant(value_discretization_interval=1e-2)
    accountant.step(noise_multiplier=1.0, sample_rate=0.05, num_steps=40)
    epsilon = accountant.get_epsilon(DELTA)
    for copied in (copy.deepcopy(accountant), pickle.loads(pickle.dumps(accountant)), copy.copy(accountant)):
        assert copied._cache is not accountant._cache and copied._cache.recent() == []
        assert copied.get_epsilon(DELTA) == epsilon
    copied.step(noise_multiplier=1.0, sample_rate=0.05)
    assert accountant.steps == 40
