"""The loop contract, tested as users write their loops (privacy_engine.training.step_contract).

Each ``optimizer.step()`` releases the noised sum of exactly the examples the accounted sampling drew
for that step, each clipped on its own, or raises before anything is released or counted. Every test
here is one loop pattern; the reference for each released update is an independent computation
(per-example gradients from a plain loop over examples, clipped by hand).
"""

from __future__ import annotations

import math

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset, WeightedRandomSampler

from accountants import make_accountant
from privacy_engine import PrivacyEngine, connect_private
from privacy_engine.batches.tickets import move_to

NUM_EXAMPLES = 40
FEATURES = 6
CLASSES = 3
MODES = ["hooks", "functorch", "ghost"]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 5), nn.Tanh(), nn.Linear(5, CLASSES)).double()


def make_data(num_examples: int = NUM_EXAMPLES, seed: int = 1) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_examples, FEATURES, generator=generator, dtype=torch.float64) * 3
    y = torch.randint(0, CLASSES, (num_examples,), generator=generator)
    return TensorDataset(x, y)


def private(mode="hooks", *, batch_size=8, sigma=0.0, model=None, dataset=None, lr=1.0, clip=0.5, engine=None,
            loader=None, **kwargs):  # fmt: skip
    model = model if model is not None else make_model()
    dataset = dataset if dataset is not None else make_data()
    loader = loader if loader is not None else DataLoader(dataset, batch_size=batch_size)
    engine = engine if engine is not None else PrivacyEngine(accountant=kwargs.pop("accountant", "pld"))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad or kwargs.get("all_params")],
                                lr=lr)  # fmt: skip
    kwargs.pop("all_params", None)
    out = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma, max_grad_norm=clip,
        grad_sample_mode=mode, noise_generator=torch.Generator().manual_seed(3), **kwargs,
    )  # fmt: skip
    wrapped, optimizer, loader = out
    return engine, model, wrapped, optimizer, loader


def loss_of(wrapped, x, y):
    return nn.functional.cross_entropy(wrapped(x), y)


def clipped_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float, mask=None) -> list[torch.Tensor]:
    """Sum over examples of each example's gradient clipped to ``clip`` (flat), by a plain loop."""
    # A fresh copy of the architecture: deep-copying a wrapped model would copy its hooks too.
    reference = make_model()
    reference.load_state_dict(model.state_dict())
    for mine, theirs in zip(reference.parameters(), model.parameters()):
        mine.requires_grad_(theirs.requires_grad)
    params = [p for p in reference.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(x)):
        if mask is not None and mask[i]:
            continue
        grads = torch.autograd.grad(nn.functional.cross_entropy(reference(x[i : i + 1]), y[i : i + 1]), params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, clip / (float(norm) + 1e-12))
        total = [t + factor * g for t, g in zip(total, grads)]
    return total


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_update(before, model, expected_sums, *, lr, divisor, params=None):
    params = list(model.parameters()) if params is None else params
    for b, p, s in zip(before, params, expected_sums):
        torch.testing.assert_close(p.detach(), b - lr * s / divisor, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------------- 1 unfreezing
@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_unfrozen_after_make_private_is_clipped_with_the_rest(mode):
    model = make_model()
    model[0].weight.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the frozen weight sits in the optimizer
    engine = PrivacyEngine()
    out = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(make_data(), batch_size=8), noise_multiplier=0.0,
        max_grad_norm=0.5, grad_sample_mode=mode, noise_generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    wrapped, dp_optimizer, loader = out
    batches = iter(loader)
    x, y = next(batches)
    dp_optimizer.zero_grad()
    loss_of(wrapped, x, y).backward()
    dp_optimizer.step()
    model[0].weight.requires_grad_(True)  # gradual unfreezing
    x, y = next(batches)
    before = snapshot(model)
    expected = clipped_sum(model, x, y, 0.5)
    dp_optimizer.zero_grad()
    loss_of(wrapped, x, y).backward()
    dp_optimizer.step()
    assert_update(before, model, expected, lr=1.0, divisor=8.0)
    # ... and frozen again: no noise, no update for it, even with noise on
    model[0].weight.requires_grad_(False)
    dp_optimizer.noise_multiplier = 1.0
    frozen_before = model[0].weight.detach().clone()
    x, y = next(batches)
    dp_optimizer.zero_grad()
    loss_of(wrapped, x, y).backward()
    dp_optimizer.step()
    assert torch.equal(model[0].weight.detach(), frozen_before)


def test_unfreezing_in_the_middle_of_a_step_raises_naming_the_parameter():
    model = make_model()
    model[0].bias.requires_grad_(False)
    engine, model, wrapped, optimizer, loader = private(model=model, all_params=True)
    x, y = next(iter(loader))
    loss_of(wrapped, x, y).backward()
    model[0].bias.requires_grad_(True)
    with pytest.raises(ValueError, match="optimizer parameter #1"):
        optimizer.step()
    assert engine.accountant.steps == 0


# ------------------------------------------------------------------------------- 2 naive accumulation
@pytest.mark.parametrize("mode", MODES)
def test_two_batches_before_one_step_are_clipped_each_on_its_own(mode):
    engine, model, wrapped, optimizer, loader = private(mode)
    batches = iter(loader)
    (x1, y1), (x2, y2) = next(batches), next(batches)
    before = snapshot(model)
    expected = [a + b for a, b in zip(clipped_sum(model, x1, y1, 0.5), clipped_sum(model, x2, y2, 0.5))]
    optimizer.zero_grad()
    loss_of(wrapped, x1, y1).backward()
    loss_of(wrapped, x2, y2).backward()
    optimizer.step()
    assert_update(before, model, expected, lr=1.0, divisor=2 * 8.0)  # the expected size of 2 batches
    (entry,) = engine.accountant.history
    assert entry.batches_per_step == 2


def test_a_second_pass_of_one_example_is_never_broadcast_onto_the_first():
    engine, model, wrapped, optimizer, loader = private("hooks")
    batches = iter(loader)
    x1, y1 = next(batches)
    x2, y2 = next(batches)
    x2, y2 = x2[:1], y2[:1]  # a slice of the second batch: one example
    before = snapshot(model)
    expected = [a + b for a, b in zip(clipped_sum(model, x1, y1, 0.5), clipped_sum(model, x2, y2, 0.5))]
    loss_of(wrapped, x1, y1).backward()
    loss_of(wrapped, x2, y2).backward()
    optimizer.step()
    assert_update(before, model, expected, lr=1.0, divisor=2 * 8.0)


def test_accumulated_batches_are_accounted_as_a_mixture_of_gaussians():
    # A coarse PLD grid on both sides: the comparison does not depend on it, and the mixture is slow to
    # discretise finely.
    engine, model, wrapped, optimizer, loader = private(
        "hooks", sigma=1.0, batch_size=4, engine=PrivacyEngine(make_accountant("pld", value_discretization_interval=1e-2))
    )
    batches = iter(loader)
    for _ in range(3):
        for _ in range(2):
            x, y = next(batches)
            loss_of(wrapped, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    q = loader.sample_rate
    mixture = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(1.0, [0.0, 1.0, 2.0], [(1 - q) ** 2, 2 * q * (1 - q), q * q])
    reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-2).compose(
        dp_accounting.SelfComposedDpEvent(mixture, 3))
    assert engine.get_epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-6)


def test_accumulated_batches_with_the_rdp_accountant_raise_before_release():
    engine, model, wrapped, optimizer, loader = private("hooks", sigma=1.0, accountant="rdp")
    batches = iter(loader)
    before = snapshot(model)
    for _ in range(2):
        x, y = next(batches)
        loss_of(wrapped, x, y).backward()
    with pytest.raises(NotImplementedError, match="PLD"):
        optimizer.step()
    assert engine.accountant.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_manual_micro_batches_of_one_batch_are_one_draw(mode):
    engine, model, wrapped, optimizer, loader = private(mode)
    x, y = next(iter(loader))
    before = snapshot(model)
    expected = clipped_sum(model, x, y, 0.5)
    for xs, ys in zip(x.split(3), y.split(3)):
        loss_of(wrapped, xs, ys).backward()
    optimizer.step()
    assert_update(before, model, expected, lr=1.0, divisor=8.0)
    assert engine.accountant.history[0].batches_per_step == 1


def test_two_losses_over_one_batch_are_summed_per_example_then_clipped_once():
    engine, model, wrapped, optimizer, loader = private("hooks")
    x, y = next(iter(loader))
    before = snapshot(model)
    expected = clipped_sum(model, torch.cat([x]), y, 0.5)
    # the same examples, loss split in two halves of the logits' classes: per example the sum is the full loss
    out = wrapped(x)
    (0.5 * nn.functional.cross_entropy(out, y)).backward()
    (0.5 * nn.functional.cross_entropy(wrapped(x), y)).backward()
    optimizer.step()
    assert_update(before, model, expected, lr=1.0, divisor=8.0)


def test_ghost_mode_refuses_a_second_pass_over_the_same_batch():
    engine, model, wrapped, optimizer, loader = private("ghost")
    x, y = next(iter(loader))
    loss_of(wrapped, x, y).backward()
    with pytest.raises(RuntimeError, match="second backward pass over the same batch"):
        wrapped(x)


# ------------------------------------------------------------------------------ 3 eval / unwrapped
@pytest.mark.parametrize("mode", MODES)
def test_a_step_after_an_eval_mode_backward_raises_and_releases_nothing(mode):
    engine, model, wrapped, optimizer, loader = private(mode, sigma=1.0)
    x, y = next(iter(loader))
    wrapped.eval()
    before = snapshot(model)
    loss_of(wrapped, x, y).backward()
    with pytest.raises(RuntimeError, match="eval"):
        optimizer.step()
    assert engine.accountant.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("mode", MODES)
def test_a_step_after_a_forward_whose_backward_never_ran_raises_then_the_backward_releases_the_batch(mode):
    # The step would release noise alone in place of the batch's clipped sum: refused, nothing counted. The
    # forward is still there: its backward then releases exactly that batch, clipped.
    engine, model, wrapped, optimizer, loader = private(mode, sigma=0.0)
    x, y = next(iter(loader))
    assert len(x) > 0
    before = snapshot(model)
    loss = loss_of(wrapped, x, y)
    with pytest.raises(RuntimeError, match="backward pass never ran"):
        optimizer.step()
    assert engine.accountant.steps == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    expected = clipped_sum(model, x, y, clip=0.5)
    loss.backward()
    optimizer.step()
    assert engine.accountant.steps == 1
    assert_update(before, model, expected, lr=1.0, divisor=8.0)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_batch_skipped_after_its_forward_is_never_released_and_the_next_one_is(mode):
    # A loop that skips a batch after its forward (a NaN loss) leaves out step(): the next batch is stepped alone.
    engine, model, wrapped, optimizer, loader = private(mode, sigma=0.0)
    batches = iter(loader)
    x, y = next(batches)
    loss_of(wrapped, x, y)  # looked at, then skipped: no backward, no step
    optimizer.zero_grad()
    x, y = next(batches)
    while len(x) == 0:
        x, y = next(batches)
    before = snapshot(model)
    expected = clipped_sum(model, x, y, clip=0.5)
    loss_of(wrapped, x, y).backward()
    optimizer.step()
    assert engine.accountant.steps == 1
    assert_update(before, model, expected, lr=1.0, divisor=8.0)


def test_a_private_optimizer_over_a_model_never_wrapped_raises():
    from privacy_engine import DPOptimizer

    model = make_model()
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
                            expected_batch_size=8)  # fmt: skip
    x, y = make_data().tensors
    nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
    with pytest.raises(RuntimeError, match="no per-sample gradients"):
        optimizer.step()


# ------------------------------------------------------------------------- 4 a non-private optimizer
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_another_optimizer_stepping_the_model_is_detected_at_the_next_forward(mode):
    engine, model, wrapped, optimizer, loader = private(mode)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter(loader)
    x, y = next(batches)
    loss_of(wrapped, x, y).backward()
    if mode == "ghost":  # fast clipping writes no .grad: the plain optimizer finds none, so give it one
        for p in model.parameters():
            p.grad = torch.ones_like(p)
    plain.step()
    plain.zero_grad()
    x, y = next(batches)
    with pytest.raises(RuntimeError, match="another optimizer"):
        loss_of(wrapped, x, y).backward()
        optimizer.step()
    assert engine.accountant.steps == 0


# ------------------------------------------------------------------------------- 5 exceptions
class Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model()
        self.fail = False

    def forward(self, x):
        out = self.inner(x)
        if self.fail:
            raise RuntimeError("boom")
        return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_batch_abandoned_by_an_exception_leaves_nothing_behind(mode, where):
    model = Flaky()
    engine, _, wrapped, optimizer, loader = private(mode, model=model)
    batches = iter(loader)
    x, y = next(batches)
    if where == "forward":
        model.fail = True
        with pytest.raises(RuntimeError, match="boom"):
            wrapped(x)
        model.fail = False
    else:
        out = wrapped(x)

        def explode(grad):
            raise RuntimeError("boom")

        out.register_hook(lambda g: g)
        loss = nn.functional.cross_entropy(out, y)
        loss.register_hook(explode)
        with pytest.raises(RuntimeError, match="boom"):
            loss.backward()
    x2, y2 = next(batches)
    before = snapshot(model)
    expected = clipped_sum(model.inner, x2, y2, 0.5)
    optimizer.zero_grad()
    loss_of(wrapped, x2, y2).backward()
    optimizer.step()
    assert_update(before, model, expected, lr=1.0, divisor=8.0)


def test_a_backward_half_done_is_discarded_at_the_next_forward():
    model = nn.Sequential(nn.Linear(FEATURES, 5), nn.Tanh(), nn.Linear(5, CLASSES)).double()
    engine, _, wrapped, optimizer, loader = private("hooks", model=model, batch_size=10)
    batches = iter(loader)
    x, y = next(batches)

    def fail_in_the_middle(grad):  # on the hidden activations: the last layer already has its grad_sample
        raise RuntimeError("interrupted")

    handle = model[1].register_forward_hook(lambda m, i, o: o.register_hook(fail_in_the_middle) and None)
    out = wrapped(x)
    with pytest.raises(RuntimeError, match="interrupted"):
        nn.functional.cross_entropy(out, y).backward()
    assert model[2].weight.grad_sample is not None  # half a backward pass was recorded
    handle.remove()
    x2, y2 = next(batches)
    before = snapshot(model)
    expected = clipped_sum(model, x2, y2, 0.5)
    optimizer.zero_grad()
    loss_of(wrapped, x2, y2).backward()
    optimizer.step()
    assert_update(before, model, expected, lr=1.0, divisor=10.0)


# ---------------------------------------------------------------------- 6 calibration over real steps
@pytest.mark.parametrize("kind", ["drop_last", "subset"])
def test_make_private_with_epsilon_counts_the_steps_the_private_loader_runs(kind):
    dataset = make_data(170)
    if kind == "drop_last":
        loader = DataLoader(dataset, batch_size=60, drop_last=True)  # len 2, private loader: round(170/60) = 3
    else:
        loader = DataLoader(dataset, batch_size=10, sampler=SubsetRandomSampler(list(range(100))))
    engine = PrivacyEngine()
    model = make_model()
    _, optimizer, private_loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        target_epsilon=1.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0,
    )  # fmt: skip
    steps = 2 * len(private_loader)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(private_loader.sample_rate,
                                            dp_accounting.GaussianDpEvent(optimizer.noise_multiplier)), steps)  # fmt: skip
    epsilon = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(1e-5)
    assert epsilon <= 1.0
    if kind == "subset":
        assert private_loader.sample_rate == pytest.approx(10 / 100)


# ------------------------------------------------------------------------------- 7 custom samplers
def test_a_subset_sampler_is_poisson_sampled_within_its_indices():
    train_indices = list(range(0, NUM_EXAMPLES, 2))
    loader = DataLoader(make_data(), batch_size=4, sampler=SubsetRandomSampler(train_indices))
    engine, model, wrapped, optimizer, private_loader = private(loader=loader)
    seen = set()
    x_all = make_data().tensors[0]
    for _ in range(5):
        for x, _ in private_loader:
            for row in x:
                seen.add(int((x_all == row).all(1).nonzero()))
    assert seen <= set(train_indices) and len(seen) > len(train_indices) // 2
    assert private_loader.sample_rate == pytest.approx(4 / len(train_indices))


def test_a_weighted_sampler_is_refused_before_anything_is_wrapped():
    loader = DataLoader(make_data(), batch_size=4, sampler=WeightedRandomSampler([1.0] * NUM_EXAMPLES, NUM_EXAMPLES))
    model = make_model()
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        private(model=model, loader=loader)
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


# ------------------------------------------------------------------------------- 8 cyclic groups
def test_bandmf_groups_are_assigned_independently_by_default():
    engine, model, wrapped, optimizer, loader = private(noise_mechanism="bandmf", num_bands=2, total_steps=10)
    sampler = loader.batch_sampler
    assert sampler.public_size is False
    sizes = [len(g) for g in sampler.groups]
    assert sum(sizes) == NUM_EXAMPLES
    # with independent assignment, removing one example changes no other example's group: rebuild with the
    # same generator state over one example less and compare memberships
    generator = torch.Generator().manual_seed(5)
    from privacy_engine.training.sampling import CyclicPoissonBatchSampler

    full = CyclicPoissonBatchSampler(NUM_EXAMPLES, 2, 0.5, generator=generator)
    generator = torch.Generator().manual_seed(5)
    fewer = CyclicPoissonBatchSampler(NUM_EXAMPLES, 2, 0.5, generator=generator, indices=range(NUM_EXAMPLES - 1))
    for group_full, group_fewer in zip(full.groups, fewer.groups):
        assert set(group_fewer.tolist()) == set(group_full.tolist()) - {NUM_EXAMPLES - 1}


# ------------------------------------------------------------------------- 9 BandMF schedule ties
def test_a_skipped_bandmf_batch_keeps_noise_rows_and_groups_tied_to_loader_steps():
    engine, model, wrapped, optimizer, loader = private(sigma=1.0, noise_mechanism="bandmf", num_bands=2,
                                                        total_steps=20, batch_size=5)  # fmt: skip
    released_steps = []
    for index, (x, y) in enumerate(loader):
        if index == 1:
            continue  # skip a batch (an empty one, a NaN loss, ...)
        optimizer.zero_grad()
        loss_of(wrapped, x, y).backward()
        optimizer.step()
        released_steps.append(index)
        assert optimizer.noise.step == index + 1  # the noise row is the loader step
        if index == 4:
            break  # a step budget: the next epoch resumes after the last drawn batch
    # every drawn row counted (the skipped one too): participations never exceed ceil(rows / b)
    assert engine.accountant.steps == 5
    x, y = next(iter(loader))
    loss_of(wrapped, x, y).backward()
    optimizer.step()
    assert optimizer.noise.step == 6


def test_a_bandmf_batch_released_out_of_order_raises():
    engine, model, wrapped, optimizer, loader = private(sigma=1.0, noise_mechanism="bandmf", num_bands=2,
                                                        total_steps=20, batch_size=5)  # fmt: skip
    batches = list(loader)
    x, y = batches[3]
    loss_of(wrapped, x, y).backward()
    optimizer.step()
    x, y = batches[1]
    loss_of(wrapped, x, y).backward()
    with pytest.raises(RuntimeError, match="noise row"):
        optimizer.step()
    assert engine.accountant.steps == 4


def test_the_same_batch_is_never_released_twice():
    engine, model, wrapped, optimizer, loader = private(sigma=1.0)
    x, y = next(iter(loader))
    loss_of(wrapped, x, y).backward()
    optimizer.step()
    optimizer.zero_grad()
    loss_of(wrapped, x, y).backward()
    with pytest.raises(RuntimeError, match="already released"):
        optimizer.step()
    assert engine.accountant.steps == 1


# ---------------------------------------------------------------- 10 the padding mask travels with its batch
def truncated_run(mode, loop):
    engine, model, wrapped, optimizer, loader = private(mode, noise_mechanism="gaussian", max_batch_size=6,
                                                        batch_size=8, clip=0.5)  # fmt: skip
    loader.batch_sampler.generator.manual_seed(11) if loader.batch_sampler.generator else None
    updates = []
    for x, y in loop(loader):
        before = snapshot(model)
        optimizer.zero_grad()
        loss_of(wrapped, x, y).backward()
        optimizer.step()
        updates.append([b - p.detach() for b, p in zip(before, model.parameters())])
    return updates


def one_ahead(loader):
    iterator = iter(loader)
    upcoming = next(iterator, None)
    while upcoming is not None:
        current, upcoming = upcoming, next(iterator, None)
        yield current


def one_ahead_copied(loader):
    """A prefetcher that copies each batch ahead of its use (as ``.to(device, non_blocking=True)`` does)."""
    for x, y in one_ahead(loader):
        yield x.clone(), y.clone()


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("loop", [one_ahead, list, one_ahead_copied], ids=["prefetch", "list", "prefetch-copied"])
def test_each_batch_is_clipped_with_its_own_padding_mask_whatever_the_iteration_order(mode, loop):
    torch.manual_seed(0)
    plain = truncated_run(mode, lambda loader: loader)
    torch.manual_seed(0)
    reordered = truncated_run(mode, loop)
    assert len(plain) == len(reordered)
    for a, b in zip(plain, reordered):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_a_copy_of_a_batch_yielded_long_before_is_refused_and_move_to_keeps_its_tag():
    # batch_size 4 of 40 capped at 6: the padded batches differ in padding. The old rule matched an untagged
    # copy to the oldest queued batch of its size; a copy is now recognised only by its values, and only
    # among the loader's last RECENT_BATCHES batches.
    engine, model, wrapped, optimizer, loader = private(max_batch_size=6, batch_size=4)
    iterator = iter(loader)
    first = next(iterator)
    queued = [next(iterator) for _ in range(6)]
    loss_of(wrapped, first[0].clone(), first[1]).backward()  # a copy (as .to(device) makes): no tag
    with pytest.raises(RuntimeError, match=r"privacy_engine\.move_to"):
        optimizer.step()
    assert engine.accountant.steps == 0
    optimizer.zero_grad()
    moved = move_to(queued[0], "cpu", copy=True)  # the tag-keeping copy works
    loss_of(wrapped, *moved).backward()
    optimizer.step()
    assert engine.accountant.steps == 1


# ------------------------------------------------------------------ 11 several optimizers on one engine
def test_two_bandmf_optimizers_on_one_engine_compose_as_separate_mechanisms():
    engine = PrivacyEngine(accountant="pld")
    runs = []
    for seed in (0, 1):
        _, model, wrapped, optimizer, loader = private(engine=engine, sigma=1.0, noise_mechanism="bandmf",
                                                       num_bands=2, total_steps=10, batch_size=5,
                                                       model=make_model(seed))  # fmt: skip
        runs.append((wrapped, optimizer, loader))
    iterators = [iter(r[2]) for r in runs]
    for _ in range(3):  # alternate the two optimizers' steps
        for (wrapped, optimizer, _), iterator in zip(runs, iterators):
            x, y = next(iterator)
            optimizer.zero_grad()
            loss_of(wrapped, x, y).backward()
            optimizer.step()
    sources = {entry.source for entry in engine.accountant.history}
    assert len(sources) == 2 and all(entry.num_steps == 3 for entry in engine.accountant.history)
    q = runs[0][2].sample_rate
    one = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)), math.ceil(3 / 2))
    reference = dp_accounting.pld.PLDAccountant().compose(dp_accounting.ComposedDpEvent([one, one]))
    assert engine.get_epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-6)


# ------------------------------------------------------------------------------- 12 per-user clipping
def test_per_user_clipping_is_refused_with_example_level_sampling():
    engine, model, wrapped, optimizer, loader = private()
    x, y = next(iter(loader))
    loss_of(wrapped, x, y).backward()
    with pytest.raises(ValueError, match="per-user clipping"):
        optimizer.clip_and_accumulate(group_ids=torch.zeros(len(x), dtype=torch.long))


# ------------------------------------------------------------------------------- data from elsewhere
def test_a_batch_the_private_loader_did_not_draw_is_not_released():
    engine, model, wrapped, optimizer, loader = private(sigma=1.0)
    x, y = make_data(8, seed=9).tensors
    loss_of(wrapped, x, y).backward()
    with pytest.raises(RuntimeError, match="did not draw"):
        optimizer.step()
    assert engine.accountant.steps == 0


def test_accountant_history_keeps_one_entry_per_source():
    accountant = make_accountant("pld")
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, source="a")
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, source="b")
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, source="a")
    assert [(e.source, e.num_steps) for e in accountant.history] == [("a", 2), ("b", 1)]


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_generated_inputs_before_the_backward_of_a_drawn_batch_are_joined_to_its_examples(mode):
    # A GAN discriminator: the real batch and a generated (public) batch of the same size, one backward.
    engine, model, wrapped, optimizer, loader = private(mode)
    x, y = next(iter(loader))
    fake = torch.randn_like(x)
    before = snapshot(model)
    out_real, out_fake = wrapped(x), wrapped(fake)
    (nn.functional.cross_entropy(out_real, y) + nn.functional.cross_entropy(out_fake, y)).backward()
    optimizer.step()
    assert engine.accountant.steps == 1 and engine.accountant.history[0].batches_per_step == 1
    # each example i's contribution (real_i + fake_i) is clipped as one: the update is at most C per example
    moved = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])
    assert float(moved.norm()) * 8 <= 8 * 0.5 * (1 + 1e-9)


def test_a_model_held_in_bfloat16_releases_a_clipped_sum_within_the_bound():
    from privacy_engine import DPOptimizer, GradSampleModule

    torch.manual_seed(0)
    model = nn.Linear(64, 64).to(torch.bfloat16)
    wrapped = GradSampleModule(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=1.0,
                            loss_reduction="sum")  # fmt: skip
    connect_private(wrapped, optimizer)
    x = torch.randn(1, 64, dtype=torch.bfloat16) * 30
    wrapped(x).square().sum().backward()
    optimizer.step()
    # the sum the noise is added to (kept in float32): one example's contribution is within C
    released = torch.cat([s.flatten().double() for s in optimizer.clipper.released_sums])
    assert float(released.norm()) <= 1.0 * (1 + 1e-6)
    assert all(s.dtype == torch.float32 for s in optimizer.clipper.released_sums)
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_a_grad_scaler_the_optimizer_does_not_know_is_refused_before_anything_is_released():
    engine, model, wrapped, optimizer, loader = private("hooks", sigma=1.0, model=make_model().float(),
                                                        dataset=TensorDataset(make_data().tensors[0].float(),
                                                                              make_data().tensors[1]))  # fmt: skip
    scaler = torch.amp.GradScaler("cpu")
    x, y = next(iter(loader))
    before = snapshot(model)
    scaler.scale(loss_of(wrapped, x, y)).backward()
    with pytest.raises(RuntimeError, match="grad_scaler=scaler"):
        scaler.step(optimizer)
    assert engine.accountant.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("poisson", [True, False], ids=["poisson", "shuffled"])
def test_a_loop_without_zero_grad_releases_the_same_as_with_it(mode, poisson):
    """README's loop-contract row: no ``zero_grad()`` between steps changes nothing (each step releases its own
    batch and overwrites ``p.grad``); Opacus raises ValueError there instead."""
    def train(zero_grad: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
        private, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=8),
            noise_multiplier=0.5, max_grad_norm=1.0, grad_sample_mode=mode, poisson_sampling=poisson,
        )  # fmt: skip
        torch.manual_seed(1)
        for step, (x, y) in enumerate(loader):
            if zero_grad:
                optimizer.zero_grad()
            nn.functional.cross_entropy(private(x), y).backward()
            optimizer.step()
            if step == 2:
                break
        return [p.detach().clone() for p in model.parameters()]

    with_zero_grad, without = train(True), train(False)
    assert all(torch.equal(a, b) for a, b in zip(with_zero_grad, without))
