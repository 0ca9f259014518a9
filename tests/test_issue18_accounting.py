"""Issue 18, "parameters, ledgers, ranks and seeds": each test is the user's own loop or pipeline, and
every privacy number is compared with dp-accounting on the same event.

- a parameter the private optimizer does not hold, unfrozen and stepped by another optimizer (item 9);
- a checkpoint of one model restored on an engine shared by two models (item 10);
- the Opacus namespace's hand-built pipeline: one sampling rate for the loader and the hook (item 12);
- truncated sampling accounted for an added example's group, |g| + 1 (item 13);
- several fixed-size (shuffled) batches accumulated into one release (item 15).

DDP ranks holding different datasets (item 11) are in tests/test_distributed.py (spawned ranks).
"""

from __future__ import annotations

import math

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accountants import make_accountant
from privacy_engine import PrivacyEngine, connect_private

DELTA = 1e-5
PLD_INTERVAL = 1e-3  # engine and reference on the same grid: compared exactly, ~10x faster than 1e-4


def fast_pld():
    return make_accountant("pld", value_discretization_interval=PLD_INTERVAL)


def reference_epsilon(event, delta=DELTA):
    return dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL).compose(event).get_epsilon(delta)


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def make_data(num_examples=40, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_examples, 6, generator=generator, dtype=torch.float64) * 3
    y = torch.randint(0, 3, (num_examples,), generator=generator)
    return TensorDataset(x, y)


def train_epoch(model, optimizer, loader):
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


# ------------------------------------------------------------------------ 13 truncation: |g| + 1
def truncated_event(group_size, sample_rate, cap, sigma, steps):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=group_size, sampling_probability=sample_rate, truncated_batch_size=cap,
            noise_multiplier=sigma,
        ),
        steps,
    )


@pytest.mark.parametrize("num_examples,batch_size,cap", [(40, 4, 4), (60, 6, 5)])
def test_truncated_sampling_covers_an_example_added_to_the_group(num_examples, batch_size, cap):
    engine, model = PrivacyEngine(accountant=fast_pld()), make_model()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(make_data(num_examples), batch_size=batch_size), noise_multiplier=1.0,
        max_grad_norm=1.0, max_batch_size=cap,
    )  # fmt: skip
    train_epoch(model, optimizer, loader)
    steps, q = engine.accountant.steps, loader.sample_rate
    # One group of N examples: an example removed leaves the run on N (dataset_size N); an example
    # added makes it N + 1 (dp-accounting's dataset_size counts the example measured).
    removed = reference_epsilon(truncated_event(num_examples, q, cap, 1.0, steps))
    added = reference_epsilon(truncated_event(num_examples + 1, q, cap, 1.0, steps))
    assert engine.get_epsilon(DELTA) == pytest.approx(max(removed, added), rel=1e-9)
    assert engine.get_epsilon(DELTA) >= added


# ------------------------------------------------------------------------ 12 Opacus's hand-built pipeline
def dpsgd_event(sigma, sample_rate, steps):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(sigma)), steps
    )


def observed_rate(loader, draws=400):
    """Mean fraction of the examples in a batch, over ``draws`` batches of the loader's sampler."""
    sampler, total, seen = loader.batch_sampler, 0, 0
    while seen < draws:
        for batch in sampler:
            total, seen = total + len(batch), seen + 1
            if seen == draws:
                break
    return total / (draws * sampler.num_samples)


@pytest.mark.parametrize("batch_size", [35, 40])  # 35 does not divide 1000 (the case), 40 does
@pytest.mark.parametrize("hook_rate_of", ["data_loader", "private_loader"])
@pytest.mark.parametrize("accountant_kind", ["rdp", "prv"])
def test_opacus_pipeline_by_hand_records_the_rate_its_loader_samples(batch_size, hook_rate_of, accountant_kind):
    from privacy_engine.opacus import GradSampleModule
    from privacy_engine.opacus.accountants import PRVAccountant, RDPAccountant
    from privacy_engine.opacus.data_loader import DPDataLoader
    from privacy_engine.opacus.optimizers import DPOptimizer

    num_examples, sigma = 1000, 1.0
    data_loader = DataLoader(make_data(num_examples), batch_size=batch_size)
    private_loader = DPDataLoader.from_data_loader(data_loader, generator=torch.Generator().manual_seed(0))
    model = GradSampleModule(make_model())
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=sigma, max_grad_norm=1.0,
                            expected_batch_size=batch_size)  # fmt: skip
    accountant = RDPAccountant() if accountant_kind == "rdp" else PRVAccountant(PLD_INTERVAL)
    loader_for_rate = data_loader if hook_rate_of == "data_loader" else private_loader
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=1 / len(loader_for_rate)))
    for step, (x, y) in enumerate(private_loader):
        if step == 5:
            break
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    sampled = private_loader.sample_rate
    assert sampled == pytest.approx(1 / len(data_loader), rel=1e-12) == pytest.approx(1 / len(private_loader))
    # The sampler really draws at that rate (mean batch fraction within 5 standard errors).
    standard_error = math.sqrt(sampled * (1 - sampled) / (400 * num_examples))
    assert abs(observed_rate(private_loader) - sampled) < 5 * standard_error
    assert [entry.sample_rate for entry in accountant.history] == [pytest.approx(sampled, rel=1e-12)]
    event = dpsgd_event(sigma, sampled, 5)
    if accountant_kind == "rdp":
        expected = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(DELTA)
    else:
        expected = reference_epsilon(event)
    assert accountant.get_epsilon(DELTA) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("sample_rate", [0.035, 0.04, 1 / 29, 0.3])
def test_opacus_uniform_sampler_hook_rate_never_below_the_sampled_rate(sample_rate):
    from privacy_engine.opacus.data_loader import DPDataLoader
    from privacy_engine.opacus.utils.uniform_sampler import UniformWithReplacementSampler

    dataset = make_data(1000)
    sampler = UniformWithReplacementSampler(num_samples=len(dataset), sample_rate=sample_rate)
    loader = DataLoader(dataset, batch_sampler=sampler)
    # As Opacus: int(1 / q) batches per pass, so the hook's 1 / len(loader) is at least the rate sampled.
    assert len(loader) == int(1 / sample_rate + 1e-9)
    assert 1 / len(loader) >= sample_rate
    assert 1 / len(DPDataLoader(dataset, sample_rate=sample_rate)) >= sample_rate


# ------------------------------------------------------------------------ 9 a parameter the optimizer does not hold
MODES = ["hooks", "functorch", "ghost"]


def neighbouring_datasets(num_examples=16):
    """D and D' = D plus one example with a huge input (its raw gradient is far above the clip norm)."""
    base = make_data(num_examples)
    x, y = base.tensors
    outlier = torch.full((1, 6), 1e3, dtype=torch.float64)
    return TensorDataset(x, y), TensorDataset(torch.cat([x, outlier]), torch.cat([y, torch.tensor([2])]))


def make_private_with_first_layer_frozen(dataset, mode, poisson, *, in_optimizer):
    model = make_model()
    model[0].requires_grad_(False)
    params = model.parameters() if in_optimizer else [p for p in model.parameters() if p.requires_grad]
    engine = PrivacyEngine(accountant=fast_pld())
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(params, lr=1.0), data_loader=DataLoader(dataset, batch_size=len(dataset)),
        noise_multiplier=0.0, max_grad_norm=0.5, grad_sample_mode=mode, poisson_sampling=poisson, loss_reduction="sum",
        noise_generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    wrapped, optimizer, loader = out
    return engine, model, wrapped, optimizer, loader


def loss_sum(wrapped, x, y):
    return nn.functional.cross_entropy(wrapped(x), y, reduction="sum")


@pytest.mark.filterwarnings("ignore:poisson_sampling=False")
@pytest.mark.parametrize("poisson", [True, False])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("other_optimizer", [True, False])
def test_a_layer_unfrozen_outside_the_private_optimizer_is_refused_before_any_update(mode, poisson, other_optimizer):
    for dataset in neighbouring_datasets():
        engine, model, wrapped, optimizer, loader = make_private_with_first_layer_frozen(dataset, mode, poisson,
                                                                                         in_optimizer=False)  # fmt: skip
        model[0].requires_grad_(True)  # unfrozen later...
        plain = torch.optim.SGD(model[0].parameters(), lr=1.0) if other_optimizer else None  # ...with its own optimizer
        before = [p.detach().clone() for p in model.parameters()]
        x, y = next(iter(loader))
        with pytest.raises(RuntimeError, match=r"parameter '0\.weight' of the wrapped model is trainable but not held"):
            loss_sum(wrapped, x, y).backward()
            if plain is not None:
                plain.step()
            optimizer.step()
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert all(p.grad is None for p in model.parameters())  # the refused forward computed nothing
        assert engine.accountant.steps == 0
        model[0].requires_grad_(False)  # frozen again: training goes on
        x, y = next(iter(loader))
        optimizer.zero_grad()
        loss_sum(wrapped, x, y).backward()
        optimizer.step()
        assert engine.accountant.steps == 1


@pytest.mark.filterwarnings("ignore:poisson_sampling=False")
@pytest.mark.parametrize("mode", MODES)
def test_a_layer_unfrozen_inside_the_private_optimizer_moves_by_at_most_the_clip_norm(mode):
    """Black box: noise 0, SGD lr 1, sum reduction, neighbouring datasets; the released update of the
    unfrozen layer (and of everything else) differs by at most C between D and D'."""
    updates = []
    for dataset in neighbouring_datasets():
        _, model, wrapped, optimizer, loader = make_private_with_first_layer_frozen(dataset, mode, False,
                                                                                   in_optimizer=True)  # fmt: skip
        model[0].requires_grad_(True)
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        x, y = next(iter(loader))
        optimizer.zero_grad()
        loss_sum(wrapped, x, y).backward()
        optimizer.step()
        updates.append(torch.cat([p.detach().flatten() for p in model.parameters()]) - before)
    assert float((updates[0] - updates[1]).norm()) <= 0.5 * (1 + 1e-9)
    assert float(updates[1][: 5 * 6].norm()) > 0  # the unfrozen layer was trained


# ------------------------------------------------------------------------ 10 one engine, two models, one rollback
def two_models_on_one_engine(engine, **settings):
    runs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 3)).double()
        loader = DataLoader(make_data(40, seed=seed + 1), batch_size=8 if seed == 0 else 5)
        runs.append(engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
            noise_multiplier=1.0 if seed == 0 else 1.3, max_grad_norm=1.0, **settings,
        ))  # fmt: skip
    return runs


def take_steps(run, count):
    model, optimizer, loader = run
    taken = 0
    while taken < count:
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            taken += 1
            if taken == count:
                return


def two_model_epsilon(steps_a, steps_b):
    """dp-accounting: model A (sigma 1, q = 8/40) and model B (sigma 1.3, q = 5/40), composed."""
    events = [dpsgd_event(1.0, 8 / 40, steps_a)] if steps_a else []
    events += [dpsgd_event(1.3, 5 / 40, steps_b)] if steps_b else []
    return reference_epsilon(dp_accounting.ComposedDpEvent(events))


def save(engine, run, path):
    engine.save_checkpoint(path=path, module=run[0], optimizer=run[1], data_loader=run[2])


def load(engine, run, path, with_optimizer=True):
    engine.load_checkpoint(path=path, module=run[0], optimizer=run[1] if with_optimizer else None,
                           data_loader=run[2] if with_optimizer else None)  # fmt: skip


@pytest.mark.parametrize("a_steps_after_save", [0, 10])
def test_rolling_back_one_model_keeps_the_other_models_steps(tmp_path, a_steps_after_save):
    engine = PrivacyEngine(accountant=fast_pld())
    run_a, run_b = two_models_on_one_engine(engine)
    take_steps(run_a, 5)
    save(engine, run_a, tmp_path / "a.ckpt")
    take_steps(run_b, 20)
    take_steps(run_a, a_steps_after_save)
    load(engine, run_a, tmp_path / "a.ckpt")  # roll A back to its 5th step
    assert engine.accountant.steps == 25
    assert engine.get_epsilon(DELTA) == pytest.approx(two_model_epsilon(5, 20), rel=1e-9)
    take_steps(run_b, 1)  # and both go on from there, B's entries still B's
    take_steps(run_a, 1)
    assert engine.get_epsilon(DELTA) == pytest.approx(two_model_epsilon(6, 21), rel=1e-9)


def test_the_budget_still_counts_the_other_models_steps_after_a_rollback(tmp_path):
    from privacy_engine.engine.budget import PrivacyBudgetExceeded

    engine = PrivacyEngine(accountant=fast_pld())
    limit = two_model_epsilon(5, 20) * 1.0001  # room for B's 20 steps and A's 5, not one more step of B
    run_a, run_b = two_models_on_one_engine(engine, max_epsilon=limit, target_delta=DELTA)
    take_steps(run_a, 5)
    save(engine, run_a, tmp_path / "a.ckpt")
    take_steps(run_b, 20)
    load(engine, run_a, tmp_path / "a.ckpt")
    with pytest.raises(PrivacyBudgetExceeded):
        take_steps(run_b, 1)
    assert engine.accountant.steps == 25


def test_a_restore_without_the_optimizer_rolls_back_no_model(tmp_path):
    engine = PrivacyEngine(accountant=fast_pld())
    run_a, run_b = two_models_on_one_engine(engine)
    take_steps(run_a, 5)
    save(engine, run_a, tmp_path / "a.ckpt")
    take_steps(run_a, 3)
    take_steps(run_b, 4)
    with pytest.warns(UserWarning, match="no optimizer= was given"):
        load(engine, run_a, tmp_path / "a.ckpt", with_optimizer=False)
    # Which optimizer's entries the module-only restore meant is unknown: nothing is removed.
    assert engine.get_epsilon(DELTA) == pytest.approx(two_model_epsilon(8, 4), rel=1e-9)


def test_a_resume_of_both_models_in_a_new_engine_restores_each_models_steps(tmp_path):
    engine = PrivacyEngine(accountant=fast_pld())
    run_a, run_b = two_models_on_one_engine(engine)
    take_steps(run_a, 5)
    take_steps(run_b, 7)
    save(engine, run_a, tmp_path / "a.ckpt")
    save(engine, run_b, tmp_path / "b.ckpt")
    resumed = PrivacyEngine(accountant=fast_pld())
    new_a, new_b = two_models_on_one_engine(resumed)
    load(resumed, new_a, tmp_path / "a.ckpt")
    # B's steps are in A's file too: the new engine has none of them yet, so they are kept.
    assert resumed.get_epsilon(DELTA) == pytest.approx(two_model_epsilon(5, 7), rel=1e-9)
    load(resumed, new_b, tmp_path / "b.ckpt")
    assert resumed.get_epsilon(DELTA) == pytest.approx(two_model_epsilon(5, 7), rel=1e-9)


def test_a_checkpoint_restored_into_the_optimizer_made_private_in_another_position_is_refused(tmp_path):
    from privacy_engine.engine.checkpoint import CheckpointError

    engine = PrivacyEngine(accountant=fast_pld())
    run_a, run_b = two_models_on_one_engine(engine)
    take_steps(run_a, 2)
    take_steps(run_b, 3)
    save(engine, run_b, tmp_path / "b.ckpt")
    history = engine.accountant.history
    with pytest.raises(CheckpointError, match="same order"):
        engine.load_checkpoint(path=tmp_path / "b.ckpt", module=run_b[0], optimizer=run_a[1], data_loader=run_b[2])
    assert engine.accountant.history == history


# ------------------------------------------------------------------------ 15 accumulation without Poisson sampling
def clipped_sum_by_hand(model, x, y, clip):
    """Sum over examples of each example's gradient clipped to ``clip``, by a plain loop."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(x)):
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, clip / (float(norm) + 1e-12))
        total = [t + factor * g for t, g in zip(total, grads)]
    return total


def shuffled_run(mode, dataset, *, sigma=1.0, batch_size=16, shuffle=True):
    model = make_model()
    reference = make_model()
    engine = PrivacyEngine(accountant=fast_pld())
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(dataset, batch_size=batch_size, shuffle=shuffle), noise_multiplier=sigma,
        max_grad_norm=0.5, grad_sample_mode=mode, poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    wrapped, optimizer, loader = out
    return engine, model, reference, wrapped, optimizer, loader


@pytest.mark.filterwarnings("ignore:poisson_sampling=False")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batches_per_step", [1, 2, 4, 8])
def test_accumulated_fixed_size_batches_are_accounted_and_divided_for_every_example_released(mode, batches_per_step):
    torch.manual_seed(0)
    engine, model, reference, wrapped, optimizer, loader = shuffled_run(mode, make_data(128), sigma=0.0)
    assert len(loader) == 8
    batches = iter(loader)
    inputs, targets = [], []
    optimizer.zero_grad()
    for _ in range(batches_per_step):
        x, y = next(batches)
        inputs.append(x), targets.append(y)
        nn.functional.cross_entropy(wrapped(x), y).backward()
    x, y = torch.cat(inputs), torch.cat(targets)
    reference.load_state_dict(model.state_dict())
    expected = clipped_sum_by_hand(reference, x, y, 0.5)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    for b, p, s in zip(before, model.parameters(), expected):  # lr 1, divided by k x the batch size
        torch.testing.assert_close(p.detach(), b - s / (16 * batches_per_step), rtol=1e-9, atol=1e-12)
    [entry] = engine.accountant.history
    assert entry.sample_rate == min(1.0, batches_per_step / 8) and entry.batches_per_step == 1


@pytest.mark.filterwarnings("ignore:poisson_sampling=False")
def test_a_whole_epoch_in_one_release_is_the_full_batch_gaussian():
    engine, _, _, wrapped, optimizer, loader = shuffled_run("hooks", make_data(128), sigma=1.0)
    optimizer.zero_grad()
    for x, y in loader:  # eight batches of 16, then one step: every example released once
        nn.functional.cross_entropy(wrapped(x), y).backward()
    optimizer.step()
    full_batch = reference_epsilon(dp_accounting.GaussianDpEvent(1.0))
    assert engine.get_epsilon(DELTA) == pytest.approx(full_batch, rel=1e-9)
    one_batch = reference_epsilon(dpsgd_event(1.0, 1 / 8, 1))  # what was reported before (one batch)
    assert engine.get_epsilon(DELTA) > 2 * one_batch


@pytest.mark.filterwarnings("ignore:poisson_sampling=False")
@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_of_one_fixed_size_batch_are_one_batch(mode):
    engine, model, reference, wrapped, optimizer, loader = shuffled_run(mode, make_data(128), sigma=0.0)
    x, y = next(iter(loader))
    reference.load_state_dict(model.state_dict())
    expected = clipped_sum_by_hand(reference, x, y, 0.5)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    for xs, ys in zip(x.split(4), y.split(4)):
        nn.functional.cross_entropy(wrapped(xs), ys).backward()
    optimizer.step()
    for b, p, s in zip(before, model.parameters(), expected):
        torch.testing.assert_close(p.detach(), b - s / 16, rtol=1e-9, atol=1e-12)
    assert engine.accountant.history[0].sample_rate == 1 / 8


@pytest.mark.filterwarnings("ignore:poisson_sampling=False")
@pytest.mark.parametrize("mode", MODES)
def test_accumulating_a_number_of_batches_that_does_not_divide_the_epoch_is_refused(mode):
    engine, model, _, wrapped, optimizer, loader = shuffled_run(mode, make_data(128))
    batches = iter(loader)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    for _ in range(3):  # 3 does not divide 8: a release could hold an example twice
        x, y = next(batches)
        nn.functional.cross_entropy(wrapped(x), y).backward()
    with pytest.raises(ValueError, match="3 does not divide 8"):
        optimizer.step()
    assert engine.accountant.steps == 0
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.filterwarnings("ignore:poisson_sampling=False")
@pytest.mark.parametrize("mode", MODES)
def test_an_accumulated_release_moves_by_at_most_the_clip_norm_between_neighbours(mode):
    """Black box: noise 0, SGD lr 1, D and D' = D without its last example (an outlier); the update after
    a whole epoch accumulated differs by at most C / (k * batch size)."""
    dataset, neighbour = neighbouring_datasets(127)  # 127 examples and 128 with the outlier last
    updates = []
    for data in (neighbour, dataset):
        engine, model, _, wrapped, optimizer, loader = shuffled_run(mode, data, sigma=0.0, shuffle=False)
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        optimizer.zero_grad()
        for x, y in loader:
            nn.functional.cross_entropy(wrapped(x), y).backward()
        optimizer.step()
        updates.append(torch.cat([p.detach().flatten() for p in model.parameters()]) - before)
        assert engine.accountant.history[0].sample_rate == 1.0
    assert float((updates[0] - updates[1]).norm()) <= 0.5 / (8 * 16) * (1 + 1e-9)


def test_an_opacus_file_restored_for_one_model_keeps_the_other_models_steps(tmp_path):
    from privacy_engine.opacus import PrivacyEngine as OpacusPrivacyEngine
    from privacy_engine.opacus.accountants import PRVAccountant

    engine = OpacusPrivacyEngine(accountant=PRVAccountant(PLD_INTERVAL))  # the reference's grid
    run_a, run_b = two_models_on_one_engine(engine)
    take_steps(run_b, 20)
    path = tmp_path / "opacus.pt"
    # A file with exactly the keys Opacus's save_checkpoint writes: model A after 5 steps of its own.
    torch.save({"module_state_dict": run_a[0].state_dict(),
                "privacy_accountant_state_dict": {"history": [(1.0, 8 / 40, 5)], "mechanism": "prv"}}, path)  # fmt: skip
    engine.load_checkpoint(path=path, module=run_a[0], optimizer=run_a[1])
    assert engine.get_epsilon(DELTA) == pytest.approx(two_model_epsilon(5, 20), rel=1e-9)


def test_a_hand_built_pair_refuses_a_layer_unfrozen_outside_its_optimizer():
    from privacy_engine import GradSampleModule
    from privacy_engine.training.optimizer import DPOptimizer

    model = make_model()
    model[0].requires_grad_(False)
    wrapped = GradSampleModule(model)
    optimizer = DPOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0),
                            noise_multiplier=0.0, max_grad_norm=0.5, expected_batch_size=8)  # fmt: skip
    connect_private(wrapped, optimizer)
    x, y = make_data(8).tensors
    nn.functional.cross_entropy(wrapped(x), y).backward()
    optimizer.step()  # trains the last layer only
    model[0].requires_grad_(True)
    plain = torch.optim.SGD(model[0].parameters(), lr=1.0)
    before = model[0].weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"'0\.weight' of the wrapped model is trainable but not held"):
        nn.functional.cross_entropy(wrapped(x), y).backward()
        plain.step()
    assert torch.equal(model[0].weight.detach(), before)


def accumulate_poisson_batches(mode, batches_per_step, sigma):
    model, reference = make_model(), make_model()
    engine = PrivacyEngine(accountant=fast_pld())
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(make_data(128), batch_size=16), noise_multiplier=sigma, max_grad_norm=0.5,
        grad_sample_mode=mode, noise_generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    wrapped, optimizer, loader = out
    batches = iter(loader)
    inputs, targets = [], []
    optimizer.zero_grad()
    for _ in range(batches_per_step):
        x, y = next(batches)
        inputs.append(x), targets.append(y)
        nn.functional.cross_entropy(wrapped(x), y).backward()
    reference.load_state_dict(model.state_dict())
    expected = clipped_sum_by_hand(reference, torch.cat(inputs), torch.cat(targets), 0.5)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    return engine, before, model, expected


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batches_per_step", [2, 4])
def test_accumulated_poisson_batches_are_accounted_as_their_mixture_and_divided_by_k_batches(mode, batches_per_step):
    engine, before, model, expected = accumulate_poisson_batches(mode, batches_per_step, sigma=0.0)
    for b, p, s in zip(before, model.parameters(), expected):  # divided by k x the expected batch size
        torch.testing.assert_close(p.detach(), b - s / (16 * batches_per_step), rtol=1e-9, atol=1e-12)
    [entry] = engine.accountant.history
    assert (entry.sample_rate, entry.batches_per_step) == (16 / 128, batches_per_step)
    engine, *_ = accumulate_poisson_batches(mode, batches_per_step, sigma=2.0)
    # Each example is in Binomial(k, q) of the k independent Poisson batches: a mixture of Gaussians.
    q = 16 / 128
    mixture = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(
        standard_deviation=2.0, sensitivities=[float(m) for m in range(batches_per_step + 1)],
        sampling_probs=[math.comb(batches_per_step, m) * q**m * (1 - q) ** (batches_per_step - m)
                        for m in range(batches_per_step + 1)],
    )  # fmt: skip
    assert engine.get_epsilon(DELTA) == pytest.approx(reference_epsilon(mixture), rel=1e-9)
