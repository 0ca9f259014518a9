"""The privacy budget guard: the release that would take epsilon past the budget is refused before
anything is released or recorded, at exactly the step dp-accounting says passes it.

References are dp-accounting's own epsilon for the recorded event (same settings). PLD grids are
coarse (1e-2): which step crosses the budget is decided by dp-accounting on the same grid.
"""

from __future__ import annotations

import copy
import math

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accountants import PLDAccountant, RDPAccountant, make_accountant
from privacy_engine import PrivacyBudget, PrivacyBudgetExceeded, PrivacyEngine

DELTA = 1e-5


def dp_epsilon(accountant, delta=DELTA):
    if isinstance(accountant, PLDAccountant):
        fresh = dp_accounting.pld.PLDAccountant(value_discretization_interval=accountant.value_discretization_interval)
    else:
        fresh = dp_accounting.rdp.RdpAccountant(orders=list(accountant.orders))
    return fresh.compose(accountant.event()).get_epsilon(delta)


def make_setup(num_examples=64, batch_size=8, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(seed)
    dataset = TensorDataset(
        torch.randn(num_examples, 6, generator=generator), torch.randint(0, 3, (num_examples,), generator=generator)
    )
    return model, optimizer, DataLoader(dataset, batch_size=batch_size)


def same_state(first, second):
    if isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and torch.equal(first, second)
    if isinstance(first, dict):
        return first.keys() == second.keys() and all(same_state(first[key], second[key]) for key in first)
    if isinstance(first, list | tuple):
        return len(first) == len(second) and all(same_state(a, b) for a, b in zip(first, second, strict=True))
    return first == second


def train_until_refused(engine, model, optimizer, loader, epochs):
    """Train until PrivacyBudgetExceeded; return (released steps, the error, state before the refused step)."""
    released = 0
    with pytest.raises(PrivacyBudgetExceeded) as raised:
        for _ in range(epochs):
            for inputs, targets in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(inputs), targets).backward()
                before = {
                    "parameters": [parameter.detach().clone() for parameter in model.parameters()],
                    "noise": copy.deepcopy(optimizer.noise.state_dict()),
                    "history": engine.accountant.history,
                    "steps_taken": optimizer.steps_taken,
                }
                optimizer.step()
                released += 1
    return released, raised.value, before


# ---------------------------------------------------------------------------- the engine
def test_a_run_past_its_calibration_stops_at_the_step_that_would_pass_the_target():
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=1e-2))
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=2.0, target_delta=DELTA, epochs=2,
        max_grad_norm=1.0, noise_seed=0,
    )  # fmt: skip
    planned = engine.steps_left()
    released, error, before = train_until_refused(engine, model, optimizer, loader, epochs=4)

    # Exactly dp-accounting's boundary, and at least the calibrated run.
    assert released == planned == engine.accountant.steps >= 2 * len(loader)
    after_one_more = copy.deepcopy(engine.accountant)
    after_one_more.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=optimizer.sample_rate)
    assert dp_epsilon(engine.accountant) <= 2.0 < dp_epsilon(after_one_more)
    # Nothing of the refused step was released, drawn or recorded.
    assert all(torch.equal(now, then) for now, then in zip(model.parameters(), before["parameters"], strict=True))
    assert same_state(optimizer.noise.state_dict(), before["noise"])
    assert engine.accountant.history == before["history"] and optimizer.steps_taken == before["steps_taken"]
    assert all(parameter.grad is None for parameter in model.parameters())  # no un-noised sum left behind
    # The error says what was spent and what is left.
    assert error.epsilon_spent == engine.get_epsilon(DELTA) <= 2.0 < error.epsilon_after
    assert error.steps_left == 0 and engine.steps_left() == 0
    assert "spent" in str(error) and "0 more step" in str(error) and "max_epsilon=2" in str(error)


def test_make_private_takes_a_budget_and_steps_left_plans_with_it():
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=1e-2))
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=2.0, max_grad_norm=1.0,
        noise_seed=0, target_delta=DELTA, max_epsilon=1.5,
    )  # fmt: skip
    assert optimizer.budget is engine.budget and engine.budget.max_epsilon == 1.5
    planned = engine.steps_left()
    assert engine.steps_left(3.0, DELTA) > planned > 0
    released, _, _ = train_until_refused(engine, model, optimizer, loader, epochs=10)
    assert released == planned


@pytest.mark.slow
def test_truncated_sampling_is_guarded_with_its_own_accounting():
    model, optimizer, loader = make_setup(num_examples=200, batch_size=10)
    engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=1e-2))
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.2, max_grad_norm=1.0,
        noise_seed=0, max_batch_size=40, target_delta=DELTA, max_epsilon=1.5,
    )  # fmt: skip
    planned = engine.steps_left()
    assert planned > 20
    released, _, _ = train_until_refused(engine, model, optimizer, loader, epochs=3)
    assert released == planned and engine.accountant.history[-1].truncated
    last = engine.accountant.history[-1]
    after_one_more = copy.deepcopy(engine.accountant)
    after_one_more.step(noise_multiplier=last.noise_multiplier, sample_rate=last.sample_rate,
                        group_size=last.group_size, max_batch_size=last.max_batch_size)  # fmt: skip
    assert dp_epsilon(engine.accountant) <= 1.5 < dp_epsilon(after_one_more)


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"max_epsilon": 1.0}, "target_delta"),
        ({"target_delta": DELTA}, "max_epsilon"),
        ({"max_epsilon": -1.0, "target_delta": DELTA}, "max_epsilon"),
        ({"max_epsilon": 1.0, "target_delta": 2.0}, "delta"),
    ],
)
def test_bad_budgets_are_refused_before_anything_is_wrapped(arguments, match):
    model, optimizer, loader = make_setup()
    with pytest.raises(ValueError, match=match):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                                     max_grad_norm=1.0, **arguments)  # fmt: skip
    assert not any(module._forward_hooks or module._backward_hooks for module in model.modules())


def test_make_private_with_epsilon_budget_defaults_to_the_target_and_inf_turns_it_off():
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=1e-2))
    _, private_optimizer, _ = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=3.0, target_delta=DELTA, epochs=1,
        max_grad_norm=1.0,
    )  # fmt: skip
    assert (private_optimizer.budget.max_epsilon, private_optimizer.budget.delta) == (3.0, DELTA)
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=1e-2))
    _, private_optimizer, _ = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=3.0, target_delta=DELTA, epochs=1,
        max_grad_norm=1.0, max_epsilon=math.inf,
    )  # fmt: skip
    assert private_optimizer.budget is None and engine.budget is None
    with pytest.raises(ValueError, match="max_epsilon"):
        engine.steps_left()


# ---------------------------------------------------------------------------- the budget on its own
def run_with_budget(accountant, budget, steps):
    """Record steps[i % len(steps)] while the budget allows; return the refused step's arguments."""
    for index in range(10_000):
        step = steps[index % len(steps)]
        before = accountant.history
        try:
            budget.check_release(accountant, **step)
        except PrivacyBudgetExceeded:
            assert accountant.history == before
            return step
        assert accountant.history == before
        accountant.step(**step)
    raise AssertionError("the budget never ran out")


@pytest.mark.parametrize(
    ("kind", "steps"),
    [
        ("pld", [{"noise_multiplier": 1.0, "sample_rate": 0.05}]),
        ("pld", [{"noise_multiplier": 1.0, "sample_rate": 0.06, "num_bands": 3}]),
        ("rdp", [{"noise_multiplier": 1.0, "sample_rate": 0.05}]),
        # Two optimizers interleaving (entries of each merge in turn): decided step by step.
        ("pld", [{"noise_multiplier": 1.0, "sample_rate": 0.05},
                 {"noise_multiplier": 1.5, "sample_rate": 0.05, "source": "other"},
                 {"noise_multiplier": 1.0, "sample_rate": 0.05}]),
    ],
)  # fmt: skip
def test_the_budget_allows_exactly_the_steps_dp_accounting_allows(kind, steps):
    accountant = PLDAccountant(value_discretization_interval=1e-2) if kind == "pld" else RDPAccountant()
    budget = PrivacyBudget(2.0, DELTA)
    refused = run_with_budget(accountant, budget, steps)
    over = copy.deepcopy(accountant)
    over.step(**refused)
    assert dp_epsilon(accountant) <= 2.0 < dp_epsilon(over)
    assert accountant.steps > 5


def test_a_ledger_already_over_budget_is_refused_at_the_first_check():
    accountant = PLDAccountant(value_discretization_interval=1e-2)
    accountant.step(noise_multiplier=0.7, sample_rate=0.2, num_steps=100)
    with pytest.raises(PrivacyBudgetExceeded) as raised:
        PrivacyBudget(1.0, DELTA).check_release(accountant, noise_multiplier=1.0, sample_rate=0.0)
    assert raised.value.epsilon_spent > 1.0 and raised.value.steps_left == 0
    assert accountant.steps == 100


def test_a_budget_refuses_bad_settings():
    with pytest.raises(ValueError, match="max_epsilon"):
        PrivacyBudget(float("nan"), DELTA)
    with pytest.raises(ValueError, match="delta"):
        PrivacyBudget(1.0, 0.0)
