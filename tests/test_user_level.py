"""User-level DP (``make_private(privacy_unit="user", user_ids=..., examples_per_user=k)``, issue 23 part 3).

Each behaviour against an independent reference: the sampler's selection against a plain Python
re-statement of JAX Privacy's ``UserSelectionStrategy`` (``itertools.cycle`` per user) and against the
same generator's uniforms; the released gradient against a float64 loop over users of per-example
gradients (``conftest.per_example_reference``); the neighbouring release (one user removed) against the
clip norm; epsilon against dp-accounting's event with the user as the unit.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import math
import sys
from pathlib import Path

import dp_accounting
import pytest
import torch
from conftest import per_example_reference
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accountants import make_accountant
from privacy_engine import PrivacyEngine
from privacy_engine.auditing import AuditConfig
from privacy_engine.batches.tickets import find_ticket
from privacy_engine.batches.users import UserCycles, user_assignment
from privacy_engine.clipping.per_user import UserSplitError
from privacy_engine.training.data_loader import DPDataLoader
from privacy_engine.training.user_sampling import UserPoissonBatchSampler, user_level_loader
from privacy_engine.training.virtual_steps import VirtualSteps

DELTA = 1e-5
PLD_INTERVAL = 1e-3


def random_users(num_examples, num_users, seed):
    """A user id per example, every user owning at least one example, counts uneven."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.cat(
        [torch.arange(num_users), torch.randint(0, num_users, (num_examples - num_users,), generator=generator)]
    )
    return ids[torch.randperm(num_examples, generator=generator)].tolist()


def make_setup(*, num_examples=30, num_users=8, features=5, classes=3, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(num_examples, features, dtype=torch.float64) * 2
    y = torch.randint(0, classes, (num_examples,))
    model = nn.Sequential(nn.Linear(features, 4), nn.Tanh(), nn.Linear(4, classes)).double()
    return TensorDataset(x, y), random_users(num_examples, num_users, seed + 1), model


def private_run(dataset, user_ids, model, *, batch_size, k, sigma=0.0, mode="hooks", reduction="mean",
                engine=None, **settings):  # fmt: skip
    engine = engine or PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=PLD_INTERVAL))
    wrapped, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(dataset, batch_size=batch_size), noise_multiplier=sigma,
        max_grad_norm=settings.pop("max_grad_norm", 1.0), grad_sample_mode=mode, loss_reduction=reduction,
        privacy_unit="user", user_ids=user_ids, examples_per_user=k, noise_seed=0, **settings,
    )  # fmt: skip
    return engine, wrapped, optimizer, loader


def loss_of(output, targets, reduction):
    return nn.functional.cross_entropy(output, targets, reduction=reduction)


# ---------------------------------------------------------------------------------------- selection
def reference_rows(user_ids, sampled_users_per_step, k, orders=None):
    """JAX Privacy's UserSelectionStrategy restated: per user an itertools.cycle over its examples (in
    increasing index order unless ``orders`` gives one), k taken per sampled step."""
    labels = sorted(set(user_ids))
    examples = {label: [i for i, u in enumerate(user_ids) if u == label] for label in labels}
    cycles = {n: itertools.cycle(orders[n] if orders else examples[label]) for n, label in enumerate(labels)}
    return [[[next(cycles[u]) for _ in range(k)] for u in users] for users in sampled_users_per_step]


def test_the_jax_privacy_docstring_example_cycles_each_users_examples():
    cycles = UserCycles(user_assignment([0, 0, 0, 1, 1, 2], 6).examples_by_user())
    first, row_users = cycles.take(torch.tensor([0, 1, 2]), 2)
    second, _ = cycles.take(torch.tensor([0, 1, 2]), 2)
    assert first.tolist() == [0, 1, 3, 4, 5, 5] and second.tolist() == [2, 0, 3, 4, 5, 5]
    assert row_users.tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("k,seed", [(1, 0), (3, 1), (5, 2)])
def test_the_sampler_cycles_k_examples_of_each_sampled_user_as_jax_privacy_does(k, seed):
    user_ids = random_users(40, 9, seed)
    assignment = user_assignment(user_ids, 40)
    sampler = UserPoissonBatchSampler(assignment, 0.4, examples_per_user=k, steps=12,
                                      generator=torch.Generator().manual_seed(seed))  # fmt: skip
    drawn = [sampler._draw(step)[0] for step in range(12)]
    # Which users each step sampled: the same generator's float64 uniforms, one per user, below q.
    replay = torch.Generator().manual_seed(seed)
    sampled = [
        torch.nonzero(torch.rand(9, generator=replay, dtype=torch.float64) < 0.4).flatten().tolist() for _ in drawn
    ]
    expected = reference_rows(user_ids, sampled, k)
    assert drawn == [list(itertools.chain.from_iterable(step)) for step in expected]
    assert all(len(rows) == k * len(users) for rows, users in zip(drawn, sampled))


def test_every_user_is_included_at_the_sample_rate_independently():
    user_ids = random_users(300, 200, 3)
    sampler = UserPoissonBatchSampler(user_assignment(user_ids, 300), 0.25, examples_per_user=2,
                                      generator=torch.Generator().manual_seed(4))  # fmt: skip
    counts = torch.zeros(200)
    steps = 400
    for step in range(steps):
        rows, _ = sampler._draw(step)
        users = {user_ids[i] for i in rows}
        assert len(rows) == 2 * len(users)  # k rows for each sampled user, never more
        counts[list(users)] += 1
    # 80,000 Bernoulli(0.25) draws: the mean within 4 standard errors (about 0.006).
    assert abs(float(counts.mean()) / steps - 0.25) < 4 * math.sqrt(0.25 * 0.75 / (200 * steps))


def test_shuffled_cycles_visit_each_users_examples_once_per_round_in_a_random_order():
    user_ids = [i % 4 for i in range(40)]  # 10 examples each
    assignment = user_assignment(user_ids, 40)
    sampler = UserPoissonBatchSampler(assignment, 1.0, examples_per_user=5, shuffle=True,
                                      generator=torch.Generator().manual_seed(0))  # fmt: skip
    rows = sampler._draw(0)[0] + sampler._draw(1)[0]  # two steps of 5: each user's whole round
    for user in range(4):
        mine = [i for i in rows if user_ids[i] == user]
        assert sorted(mine) == [i for i in range(40) if i % 4 == user]
    assert rows[:5] != sorted(rows[:5]) or rows[5:10] != sorted(rows[5:10])  # not the index order


def test_user_ids_may_be_a_function_of_the_index_and_strings():
    by_function = user_assignment(lambda i: f"author-{i // 3}", 10)
    by_sequence = user_assignment([f"author-{i // 3}" for i in range(10)], 10)
    assert torch.equal(by_function.user_of_example, by_sequence.user_of_example) and by_function.num_users == 4


@pytest.mark.parametrize("user_ids,error", [([0, 1], ValueError), ([0.5] * 6, TypeError), ("abcdef", TypeError),
                                            ([0, 1, 2, "a", 1, 1], TypeError), (42, TypeError)])  # fmt: skip
def test_bad_user_ids_are_refused_naming_them(user_ids, error):
    with pytest.raises(error, match="user_ids"):
        user_assignment(user_ids, 6)


# ---------------------------------------------------------------------------------------- the release
def reference_release(model, x, y, row_users, *, reduction, bounds, groups, expected_users):
    """Float64 loop: each example's own gradient, summed per user, each user's sum clipped once (per group of
    parameters for per-layer bounds), summed over users, divided by the expected users for "mean"."""
    per_example = per_example_reference(model, (x,), lambda out, i: loss_of(out, y[i : i + 1], "sum"))
    names = list(per_example)
    total = {name: torch.zeros_like(per_example[name][0]) for name in names}
    for user in row_users.unique().tolist():
        rows = row_users == user
        user_grad = {name: per_example[name][rows].sum(0) for name in names}
        for group, bound in zip(groups, bounds):
            norm = math.sqrt(sum(float(user_grad[name].pow(2).sum()) for name in group))
            factor = min(1.0, bound / norm) if norm > 0 else 0.0
            for name in group:
                total[name] += factor * user_grad[name]
    divisor = expected_users if reduction == "mean" else 1.0
    return {name: value / divisor for name, value in total.items()}


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_each_users_summed_gradient_is_clipped_once_as_a_float64_loop_over_users(mode, reduction, clipping):
    dataset, user_ids, model = make_setup(seed=7)
    k = 3
    names = [name for name, _ in model.named_parameters()]
    if clipping == "flat":
        bounds, groups, max_grad_norm = [0.7], [names], 0.7
    else:
        bounds, groups, max_grad_norm = [0.5, 0.3], [names[:2], names[2:]], [0.5, 0.3]
    plain = copy.deepcopy(model)  # the reference's model (lr 0: the parameters never move)
    _, wrapped, optimizer, loader = private_run(dataset, user_ids, model, batch_size=4, k=k, mode=mode,
                                                reduction=reduction, clipping=clipping, max_grad_norm=max_grad_norm)  # fmt: skip
    checked = 0
    for x, y in loader:
        row_users = find_ticket(x).user_rows()
        assert torch.equal(row_users, torch.arange(len(x)) // k)  # k consecutive rows per sampled user
        expected = reference_release(plain, x, y, row_users, reduction=reduction, bounds=bounds, groups=groups,
                                     expected_users=loader.expected_batch_size)  # fmt: skip
        optimizer.zero_grad()
        loss_of(wrapped(x), y, reduction).backward()
        optimizer.step()
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-12)
        checked += len(x) > 0
    assert checked >= 1 and optimizer.last_clipping_stats.num_examples == len(x) // k


@pytest.mark.parametrize("physical", [4, 5])
def test_virtual_steps_cut_between_users_and_release_what_the_whole_batch_releases(physical):
    """k = 2: micro-batches of 4 rows, or 5 rounded down to 4 (never half a user); the releases are the whole
    batches' releases."""
    dataset, user_ids, model = make_setup(seed=3)
    releases, pieces = [], []
    for micro in (False, True):
        torch.manual_seed(11)
        _, wrapped, optimizer, loader = private_run(dataset, user_ids, copy.deepcopy(model), batch_size=5, k=2)
        released = []
        optimizer.attach_step_hook(
            lambda opt, out=released: out.append(torch.cat([p.grad.flatten() for p in opt.params]))
        )
        batches = (
            VirtualSteps(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer) if micro else loader
        )
        for x, y in batches:
            pieces.append((micro, len(x)))
            optimizer.zero_grad()
            loss_of(wrapped(x), y, "mean").backward()
            optimizer.step()
        releases.append(torch.stack(released))
        assert optimizer.steps_taken == len(loader) == len(released)
    assert max(n for micro, n in pieces if not micro) > 4  # some logical batch was split
    assert {n for micro, n in pieces if micro} <= {0, 2, 4}
    torch.testing.assert_close(releases[0], releases[1], rtol=1e-10, atol=1e-13)


def test_virtual_steps_smaller_than_a_user_are_refused():
    dataset, user_ids, model = make_setup(seed=3)
    _, _, optimizer, loader = private_run(dataset, user_ids, model, batch_size=8, k=3)
    with pytest.raises(ValueError, match="max_physical_batch_size >= examples_per_user"):
        next(iter(VirtualSteps(data_loader=loader, max_physical_batch_size=2, optimizer=optimizer)))


def test_a_slice_that_cuts_a_user_is_refused_before_anything_is_clipped():
    dataset, user_ids, model = make_setup(seed=3)
    _, wrapped, optimizer, loader = private_run(dataset, user_ids, model, batch_size=8, k=2)
    x, y = next(iter(loader))
    assert len(x) > 3
    loss_of(wrapped(x[:3]), y[:3], "mean").backward()  # rows 0-2: user 1's rows cut in two
    with pytest.raises(UserSplitError, match="multiple of examples_per_user"):
        optimizer.step()
    assert not optimizer.clipper.has_accumulated and optimizer.steps_taken == 0


# ---------------------------------------------------------------------------------------- black box
def release_of(dataset, user_ids, *, unit, k=3, max_grad_norm=1.0):
    """The noiseless released sum of one step at sample rate 1 (every user, or every example, sampled)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3)).double()
    engine = PrivacyEngine()
    size = len(set(user_ids)) if unit == "user" else len(dataset)
    settings = {"privacy_unit": "user", "user_ids": user_ids, "examples_per_user": k} if unit == "user" else {}
    wrapped, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(dataset, batch_size=size), noise_multiplier=0.0, max_grad_norm=max_grad_norm,
        loss_reduction="sum", **settings,
    )  # fmt: skip
    x, y = next(iter(loader))
    loss_of(wrapped(x), y, "sum").backward()
    optimizer.step()
    return torch.cat([p.grad.flatten() for p in optimizer.params])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_removing_one_user_moves_the_release_by_at_most_the_clip_norm(seed):
    """Noise off, every user sampled, "sum": D and D' = D without every example of one user (three
    outliers). User level: the release moves by at most C (and by about C: the user's sum is clipped).
    Example level, same removal: by up to 3 C, which is what user-level clipping prevents."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 5, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (24,), generator=generator)
    user_ids = random_users(21, 6, seed) + [99, 99, 99]  # user 99: three outliers, last
    x[21:] = 50.0 * torch.randn(3, 5, generator=generator, dtype=torch.float64).abs()
    y[21:] = torch.tensor([0, 0, 0])
    full, without = TensorDataset(x, y), TensorDataset(x[:21], y[:21])
    user_move = float(
        (release_of(full, user_ids, unit="user") - release_of(without, user_ids[:21], unit="user")).norm()
    )
    assert 0.9 < user_move <= 1.0 + 1e-9
    example_move = float(
        (release_of(full, user_ids, unit="example") - release_of(without, user_ids[:21], unit="example")).norm()
    )
    assert example_move > 2.0


# ---------------------------------------------------------------------------------------- accounting
def test_epsilon_is_dp_accountings_poisson_gaussian_with_the_user_as_the_unit():
    dataset, user_ids, model = make_setup(num_examples=60, num_users=20, seed=2)
    engine, wrapped, optimizer, loader = private_run(dataset, user_ids, model, batch_size=5, k=2, sigma=1.3)
    assert loader.sample_rate == 5 / 20 and loader.expected_batch_size == 5.0 and len(loader) == 4
    steps = 0
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            loss_of(wrapped(x), y, "mean").backward()
            optimizer.step()
            steps += 1
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(5 / 20, dp_accounting.GaussianDpEvent(1.3)), steps
    )
    expected = (
        dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL).compose(event).get_epsilon(DELTA)
    )
    assert steps == 8 and engine.get_epsilon(DELTA) == pytest.approx(expected, rel=1e-12)


def test_make_private_with_epsilon_calibrates_over_user_epochs():
    dataset, user_ids, model = make_setup(num_examples=60, num_users=20, seed=2)
    engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=PLD_INTERVAL))
    _, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=DataLoader(dataset, batch_size=4),
        target_epsilon=3.0, target_delta=DELTA, epochs=3, max_grad_norm=1.0, privacy_unit="user", user_ids=user_ids,
    )  # fmt: skip
    steps = 3 * round(20 / 4)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(4 / 20, dp_accounting.GaussianDpEvent(optimizer.noise_multiplier)), steps
    )
    epsilon = (
        dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL).compose(event).get_epsilon(DELTA)
    )
    assert len(loader) == 5 and optimizer.sample_rate == 0.2
    assert 2.9 < epsilon <= 3.0 + 1e-9


def test_a_user_level_audit_with_gradient_canaries_stays_below_the_claimed_epsilon():
    """Gradient canaries take part as a user does (the optimizer's rate over users, the clip norm)."""
    dataset, user_ids, model = make_setup(num_examples=40, num_users=10, seed=5)
    engine, wrapped, optimizer, loader = private_run(dataset, user_ids, model, batch_size=10, k=2, sigma=1.0,
                                                     audit=AuditConfig(num_canaries=500, seed=3))  # fmt: skip
    x, y = next(iter(loader))
    loss_of(wrapped(x), y, "mean").backward()
    optimizer.step()
    report = engine.audit_report()
    assert report.steps == 1 and 0 <= report.epsilon_lower_bound < report.claimed_epsilon


# ---------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("settings,match", [
    ({"max_batch_size": 8}, "max_batch_size"),
    ({"poisson_sampling": False}, "poisson_sampling"),
    ({"audit": AuditConfig(num_canaries=4, kind="input", num_classes=3)}, "input"),
    ({"user_ids": None}, "needs user_ids"),
    ({"examples_per_user": 0}, "examples_per_user"),
])  # fmt: skip
def test_what_user_level_does_not_support_is_refused_before_anything_is_wrapped(settings, match):
    dataset, user_ids, model = make_setup()
    settings = {"privacy_unit": "user", "user_ids": user_ids, **settings}
    with pytest.raises(ValueError, match=match):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(dataset, batch_size=4), noise_multiplier=1.0,
                                     max_grad_norm=1.0, **settings)  # fmt: skip
    assert not any(hasattr(p, "grad_sample") for p in model.parameters()) and not model._forward_hooks


@pytest.mark.parametrize(
    "settings", [{"user_ids": [0] * 30}, {"examples_per_user": 2}, {"shuffle_user_examples": True}]
)
def test_user_settings_without_the_user_unit_are_refused(settings):
    dataset, _, model = make_setup()
    with pytest.raises(ValueError, match="privacy_unit='user'"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(dataset, batch_size=4), noise_multiplier=1.0,
                                     max_grad_norm=1.0, **settings)  # fmt: skip


def test_a_batch_size_above_the_number_of_users_is_refused():
    dataset, user_ids, model = make_setup(num_users=8)
    with pytest.raises(ValueError, match="expected number of users"):
        private_run(dataset, user_ids, model, batch_size=9, k=1)


def test_per_user_group_ids_stay_refused_on_an_example_level_optimizer():
    dataset, _, model = make_setup()
    _, optimizer, _ = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(dataset, batch_size=4),
        noise_multiplier=1.0, max_grad_norm=1.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="privacy_unit='user'"):
        optimizer.clip_and_accumulate(group_ids=torch.zeros(3, dtype=torch.long))


# ---------------------------------------------------------------------------------------- resume
def test_the_loader_state_resumes_every_users_cycle_and_the_sampling():
    dataset, user_ids, _ = make_setup(seed=4)
    assignment = user_assignment(user_ids, len(dataset))

    def loader():
        return user_level_loader(DataLoader(dataset, batch_size=3), assignment, examples_per_user=2, shuffle=True,
                                 generator=torch.Generator().manual_seed(8), steps=6)  # fmt: skip

    uninterrupted = loader()  # two epochs of 6 steps
    straight = [x.clone() for x, _ in itertools.islice(itertools.chain(uninterrupted, uninterrupted), 9)]
    first = loader()
    seen = [x.clone() for x, _ in itertools.islice(first, 4)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    seen += [x.clone() for x, _ in itertools.islice(resumed, 5)]
    assert all(torch.equal(a, b) for a, b in zip(straight, seen)) and len(seen) == 9
    other = user_level_loader(DataLoader(dataset, batch_size=1), user_assignment([0] * len(dataset), len(dataset)),
                              generator=torch.Generator().manual_seed(8))  # fmt: skip
    with pytest.raises(ValueError, match="this loader's 1 users"):
        other.load_state_dict(state)


def test_the_users_sampled_follow_torch_manual_seed():
    dataset, user_ids, _ = make_setup(seed=6)
    draws = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        model = nn.Linear(5, 3).double()
        _, _, _, loader = private_run(dataset, user_ids, model, batch_size=3, k=1, shuffle_user_examples=True)
        draws.append([x.clone() for x, _ in loader])
    same = all(torch.equal(a, b) for a, b in zip(draws[0], draws[1]))
    different = any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(draws[0], draws[2]))
    assert same and different


# ---------------------------------------------------------------------------------------- the tutorial
@pytest.mark.slow
def test_the_user_level_tutorial_runs_in_its_quick_mode(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tutorials"))
    tutorial = importlib.import_module("user_level_digits")
    rows = tutorial.main(["--quick"])
    assert set(rows) == {"example-level", "user-level"} and all(0.1 < accuracy <= 1.0 for accuracy in rows.values())
    out = capsys.readouterr().out
    assert "user-level" in out and "group privacy" in out


@pytest.mark.parametrize("mechanism", ["gaussian", "bandmf"])
def test_a_checkpointed_user_level_run_resumes_exactly(tmp_path, mechanism):
    """Save after 3 steps (mid-epoch), restore into a fresh run: the next releases (users sampled, each user's
    next examples, noise, BandMF's correlated rows and cyclic groups) are those of the uninterrupted run, and so
    is epsilon."""
    dataset, user_ids, model = make_setup(num_examples=40, num_users=12, seed=9)
    noise = {"noise_mechanism": "bandmf", "num_bands": 2, "total_steps": 12} if mechanism == "bandmf" else {}

    def fresh():
        torch.manual_seed(3)
        return private_run(dataset, user_ids, copy.deepcopy(model), batch_size=3, k=2, sigma=0.8,
                           shuffle_user_examples=True, **noise)  # fmt: skip

    def steps(run, count, stream):
        _, wrapped, optimizer, _ = run
        out = []
        for _ in range(count):
            x, y = next(stream)
            optimizer.zero_grad()
            loss_of(wrapped(x), y, "mean").backward()
            optimizer.step()
            out.append(torch.cat([p.grad.flatten() for p in optimizer.params]))
        return out

    def stream(loader):
        return (batch for _ in range(10) for batch in loader)

    run = fresh()
    batches = stream(run[3])
    steps(run, 3, batches)
    run[0].save_checkpoint(path=tmp_path / "ckpt.pt", module=run[1], optimizer=run[2], data_loader=run[3])
    expected = steps(run, 4, batches)
    resumed = fresh()
    resumed[0].load_checkpoint(
        path=tmp_path / "ckpt.pt", module=resumed[1], optimizer=resumed[2], data_loader=resumed[3]
    )
    got = steps(resumed, 4, stream(resumed[3]))
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert resumed[0].get_epsilon(DELTA) == run[0].get_epsilon(DELTA)


def test_no_op_mode_clips_the_loops_per_sample_gradients_per_user():
    dataset, user_ids, model = make_setup(seed=2)
    plain = copy.deepcopy(model)
    _, wrapped, optimizer, loader = private_run(
        dataset, user_ids, model, batch_size=4, k=2, mode="no_op", reduction="sum"
    )
    x, y = next(batch for batch in loader if len(batch[0]) > 0)
    per_example = per_example_reference(plain, (x,), lambda out, i: loss_of(out, y[i : i + 1], "sum"))
    loss_of(wrapped(x), y, "sum").backward()
    for name, param in model.named_parameters():
        param.grad_sample = per_example[name].clone()
    optimizer.step()
    expected = reference_release(plain, x, y, torch.arange(len(x)) // 2, reduction="sum", bounds=[1.0],
                                 groups=[list(per_example)], expected_users=1.0)  # fmt: skip
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-12)


def test_an_example_level_checkpoint_is_refused_by_a_user_level_run(tmp_path):
    dataset, user_ids, model = make_setup(num_examples=40, num_users=12, seed=9)
    engine, example_model = PrivacyEngine(), copy.deepcopy(model)
    wrapped, optimizer, loader = engine.make_private(
        module=example_model, optimizer=torch.optim.SGD(example_model.parameters(), lr=0.1),
        data_loader=DataLoader(dataset, batch_size=3), noise_multiplier=0.8, max_grad_norm=1.0,
    )  # fmt: skip
    engine.save_checkpoint(path=tmp_path / "examples.pt", module=wrapped, optimizer=optimizer, data_loader=loader)
    user_engine, user_model, user_optimizer, user_loader = private_run(dataset, user_ids, model, batch_size=3, k=2)
    before = [p.detach().clone() for p in user_model.parameters()]
    with pytest.raises(ValueError):
        user_engine.load_checkpoint(path=tmp_path / "examples.pt", module=user_model, optimizer=user_optimizer,
                                    data_loader=user_loader)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, user_model.parameters()))
    assert user_loader.state_dict()["next_step"] == 0


def test_a_user_level_loader_state_is_refused_by_an_example_level_loader():
    dataset, user_ids, _ = make_setup(num_examples=40, num_users=10, seed=9)
    generator = torch.Generator().manual_seed(0)
    users = user_level_loader(DataLoader(dataset, batch_size=2), user_assignment(user_ids, 40), generator=generator)
    examples = DPDataLoader.from_data_loader(DataLoader(dataset, batch_size=8), generator=torch.Generator())
    assert users.sample_rate == examples.sample_rate == 0.2
    with pytest.raises(ValueError, match="privacy_unit"):
        examples.load_state_dict(users.state_dict())


# ---------------------------------------------------------------------------------------- BandMF over users
def test_cyclic_user_sampling_keeps_each_users_participations_num_bands_apart():
    user_ids = random_users(90, 30, 5)
    sampler = UserPoissonBatchSampler(user_assignment(user_ids, 90), 0.6, examples_per_user=2, num_groups=3,
                                      generator=torch.Generator().manual_seed(2))  # fmt: skip
    assert sorted(torch.cat(sampler.groups).tolist()) == list(range(30))
    last_step = {}
    for step in range(30):
        rows, _ = sampler._draw(step)
        for user in {user_ids[i] for i in rows}:
            assert user in sampler.groups[step % 3].tolist()
            assert step - last_step.get(user, -3) >= 3
            last_step[user] = step
    assert sampler.expected_batch_size == pytest.approx(0.6 * 30 / 3)


def test_bandmf_at_the_user_level_is_accounted_as_dp_accountings_amplified_event_over_users():
    dataset, user_ids, model = make_setup(num_examples=80, num_users=24, seed=4)
    engine, wrapped, optimizer, loader = private_run(dataset, user_ids, model, batch_size=3, k=2, sigma=1.1,
                                                     noise_mechanism="bandmf", num_bands=2, total_steps=16)  # fmt: skip
    assert loader.num_groups == 2 and loader.sample_rate == 2 * 3 / 24 and len(loader) == 8
    steps = 0
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            loss_of(wrapped(x), y, "mean").backward()
            optimizer.step()
            steps += 1
    one = dp_accounting.PoissonSampledDpEvent(2 * 3 / 24, dp_accounting.GaussianDpEvent(1.1))
    event = dp_accounting.SelfComposedDpEvent(one, math.ceil(steps / 2))
    expected = dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL).compose(event)
    assert engine.get_epsilon(DELTA) == pytest.approx(expected.get_epsilon(DELTA), rel=1e-9)


def test_bandmf_at_the_user_level_clips_each_user_once():
    dataset, user_ids, model = make_setup(num_examples=80, num_users=24, seed=4)
    plain = copy.deepcopy(model)
    _, wrapped, optimizer, loader = private_run(dataset, user_ids, model, batch_size=3, k=2, sigma=0.0,
                                                noise_mechanism="bandmf", num_bands=2, total_steps=16)  # fmt: skip
    for x, y in itertools.islice(loader, 3):
        expected = reference_release(plain, x, y, torch.arange(len(x)) // 2, reduction="mean", bounds=[1.0],
                                     groups=[[n for n, _ in plain.named_parameters()]],
                                     expected_users=loader.expected_batch_size)  # fmt: skip
        optimizer.zero_grad()
        loss_of(wrapped(x), y, "mean").backward()
        optimizer.step()
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------- BLT and "auto" over users
def blt_run(dataset, user_ids, model, sigma):
    """Two epochs of BLT noise (2 cyclic groups, 16 steps) at the user level (user_ids given) or the example level."""
    torch.manual_seed(0)
    engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=PLD_INTERVAL))
    unit = {} if user_ids is None else {"privacy_unit": "user", "user_ids": user_ids, "examples_per_user": 2}
    wrapped, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=DataLoader(dataset, batch_size=3),
        noise_multiplier=sigma, max_grad_norm=1.0, noise_mechanism="blt", num_bands=2, total_steps=16, noise_seed=0,
        **unit,
    )  # fmt: skip
    return engine, wrapped, optimizer, loader


@pytest.mark.slow  # BLT calibration over a run: ~3 s
def test_blt_at_the_user_level_is_accounted_as_blt_over_as_many_examples_as_users():
    """The user is the unit: 24 users sampled as 24 examples would be (same rate, groups, steps, event)."""
    dataset, user_ids, model = make_setup(num_examples=80, num_users=24, seed=4)
    x, y = dataset.tensors
    epsilons = []
    for data, ids in ((dataset, user_ids), (TensorDataset(x[:24], y[:24]), None)):
        engine, wrapped, optimizer, loader = blt_run(data, ids, copy.deepcopy(model), sigma=1.1)
        assert loader.num_groups == 2 and loader.sample_rate == 0.25 and len(loader) == 8
        for _ in range(2):
            for inputs, targets in loader:
                optimizer.zero_grad()
                loss_of(wrapped(inputs), targets, "mean").backward()
                optimizer.step()
        assert engine.accountant.steps == 16 and engine.noise_plan.mechanism == "blt"
        epsilons.append(engine.get_epsilon(DELTA))
    assert epsilons[0] == epsilons[1] and math.isfinite(epsilons[0])


def test_blt_at_the_user_level_clips_each_user_once():
    dataset, user_ids, model = make_setup(num_examples=80, num_users=24, seed=4)
    plain = copy.deepcopy(model)
    _, wrapped, optimizer, loader = blt_run(dataset, user_ids, model, sigma=0.0)
    for x, y in itertools.islice(loader, 3):
        expected = reference_release(plain, x, y, torch.arange(len(x)) // 2, reduction="mean", bounds=[1.0],
                                     groups=[[n for n, _ in plain.named_parameters()]],
                                     expected_users=loader.expected_batch_size)  # fmt: skip
        optimizer.zero_grad()
        loss_of(wrapped(x), y, "mean").backward()
        optimizer.step()
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_the_automatic_mechanism_choice_calibrates_over_users():
    dataset, user_ids, model = make_setup(num_examples=80, num_users=24, seed=4)
    engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=PLD_INTERVAL))
    wrapped, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=DataLoader(dataset, batch_size=3),
        target_epsilon=4.0, target_delta=DELTA, epochs=2, max_grad_norm=1.0, noise_mechanism="auto",
        privacy_unit="user", user_ids=user_ids, examples_per_user=2,
    )  # fmt: skip
    assert loader.expected_batch_size == pytest.approx(3.0) and len(loader) == 8
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            loss_of(wrapped(x), y, "mean").backward()
            optimizer.step()
    assert 3.5 < engine.get_epsilon(DELTA) <= 4.0 + 1e-9


def test_user_level_with_a_one_rank_ddp_job_samples_every_user_at_the_global_rate(tmp_path):
    """The 2-rank job is tests/test_user_level_ddp.py (slow); one rank owns every user."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dataset, user_ids, model = make_setup()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        _, optimizer, loader = PrivacyEngine().make_private(
            module=ddp, optimizer=torch.optim.SGD(ddp.parameters(), lr=0.1), data_loader=DataLoader(dataset, batch_size=4),
            noise_multiplier=1.0, max_grad_norm=1.0, privacy_unit="user", user_ids=user_ids,
        )  # fmt: skip
        sampler = loader.batch_sampler
        assert (sampler.rank, sampler.world_size) == (0, 1) and loader.distributed_job is not None
        assert loader.sample_rate == 4 / 8 and optimizer.expected_batch_size == 4.0
    finally:
        dist.destroy_process_group()


def test_a_train_split_samples_only_its_own_examples_and_counts_only_its_users():
    from torch.utils.data import SubsetRandomSampler

    dataset, _, model = make_setup(num_examples=30)
    user_ids = [i // 3 for i in range(30)]  # 10 users of 3 examples
    split = list(range(12, 30))  # users 4..9 only
    engine = PrivacyEngine()
    _, _, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(dataset, batch_size=3, sampler=SubsetRandomSampler(split)), noise_multiplier=1.0,
        max_grad_norm=1.0, privacy_unit="user", user_ids=user_ids, examples_per_user=2,
    )  # fmt: skip
    assert loader.batch_sampler.num_users == 6 and loader.sample_rate == 0.5 and len(loader) == 2
    seen = set()
    for _ in range(5):
        for x, _ in loader:
            rows = {int(i) for i in torch.nonzero((dataset.tensors[0][:, None] == x[None]).all(-1))[:, 0]}
            seen |= rows
    assert seen and seen <= set(split)


def test_a_user_sampler_state_of_another_rank_is_refused():
    """Each DDP rank samples its own users from its own stream: a state saved by another rank would give this
    rank that rank's generator (both ranks' users included together)."""
    assignment = user_assignment([i % 6 for i in range(18)], 18)
    ranks = [UserPoissonBatchSampler(assignment, 0.5, examples_per_user=2, rank=r, world_size=2,
                                     generator=torch.Generator().manual_seed(r)) for r in range(2)]  # fmt: skip
    assert {int(u) % 2 for g in ranks[1]._local_groups for u in g} == {1}
    rows = ranks[1]._draw(0)[0]
    assert all(i % 6 % 2 == 1 for i in rows)  # rank 1 draws only the odd users' examples
    with pytest.raises(ValueError, match="saved by rank 0 of 2"):
        ranks[1].load_state_dict(ranks[0].state_dict())
    ranks[1].load_state_dict(ranks[1].state_dict())


def test_each_ddp_rank_samples_its_users_from_a_stream_of_its_own():
    """Rank 0's seed is broadcast and keyed by rank: equal streams on two ranks would include their users
    together (not independently). A stand-in job: the broadcast returns the proposal (rank 0's)."""
    from types import SimpleNamespace

    from privacy_engine.training.user_sampling import distributed_user_level_loader

    dataset, user_ids, _ = make_setup(num_examples=40, num_users=10)
    assignment = user_assignment(user_ids, 40)

    def states(rank):
        job = SimpleNamespace(sampling_seed=5, rank=rank, world_size=2, loader_step=None,
                              broadcast_int=lambda value, what: value)  # fmt: skip
        loader = distributed_user_level_loader(DataLoader(dataset, batch_size=4), assignment, job, examples_per_user=2)
        assert loader.distributed_job is job and job.loader_step() == -1 and loader.expected_batch_size == 4.0
        return loader.batch_sampler.generator.get_state()

    assert torch.equal(states(0), states(0)) and not torch.equal(states(0), states(1))
