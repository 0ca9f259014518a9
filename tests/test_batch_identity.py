"""A batch's identity, tested as users write their loops (issue 18, "A batch's identity is guessed").

One ``optimizer.step()`` releases the noised sum of exactly the examples the accounted sampling drew for
that step, each clipped on its own; the engine identifies the batch a forward runs on exactly (its tag,
a view of the tagged tensor, an exact copy of a recent batch of the optimizer's own loader), never by
its size, and refuses what it cannot identify before anything is released or counted. References are
per-example gradients from a plain loop (``clipped_sum``), as in ``test_loop_contract``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from privacy_engine import DPOptimizer, GradSampleModule, PrivacyEngine, connect_private
from privacy_engine.batches.tickets import RECENT_BATCHES, BatchTicket, find_ticket, move_to, row_runs, tag_batch
from privacy_engine.training.data_loader import DPDataLoader
from tests.test_loop_contract import (
    FEATURES,
    assert_update,
    clipped_sum,
    loss_of,
    make_data,
    make_model,
    private,
    snapshot,
)


def unchanged(before, model) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def refused_at_step(engine, model, optimizer, match):
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=match):
        optimizer.step()
    assert engine.accountant.steps == 0 and unchanged(before, model)


# ------------------------------------------------------------------------ 5 each optimizer has its own loader
@pytest.mark.parametrize("mode", ["hooks", "ghost", "no_op"])
def test_a_model_fed_another_make_private_calls_batches_releases_nothing(mode):
    # One engine, two models made private over one DataLoader: each call returns its own private loader.
    engine = PrivacyEngine(accountant="pld")
    dataset = make_data()
    _, _, _wrapped_a, _optimizer_a, loader_a = private(mode, engine=engine, dataset=dataset, batch_size=20)
    _, model_b, wrapped_b, optimizer_b, _loader_b = private(mode, engine=engine, dataset=dataset, batch_size=4,
                                                          model=make_model(1))  # fmt: skip
    x, y = next(iter(loader_a))  # sampled at q = 0.5; optimizer B accounts q = 0.1
    loss_of(wrapped_b, x, y).backward()
    if mode == "no_op":
        for p in model_b.parameters():
            p.grad_sample = torch.zeros(len(x), *p.shape, dtype=p.dtype)
    refused_at_step(engine, model_b, optimizer_b, "drawn by DPDataLoader")


def test_an_exact_copy_of_another_loaders_batch_is_refused_too():
    engine = PrivacyEngine(accountant="pld")
    _, _, _, _, loader_a = private(engine=engine, batch_size=20)
    _, model_b, wrapped_b, optimizer_b, loader_b = private(engine=engine, batch_size=4, model=make_model(1))
    iter(loader_b)  # optimizer B's loader exists and yielded nothing of this
    x, y = next(iter(loader_a))
    loss_of(wrapped_b, x.clone(), y).backward()
    refused_at_step(engine, model_b, optimizer_b, "did not draw")


def test_each_of_two_models_trains_on_its_own_loader():
    engine = PrivacyEngine(accountant="pld")
    runs = [private(engine=engine, batch_size=size, model=make_model(seed)) for seed, size in ((0, 20), (1, 4))]
    for _, model, wrapped, optimizer, loader in runs:
        x, y = next(iter(loader))
        before = snapshot(model)
        expected = clipped_sum(model, x, y, 0.5)
        loss_of(wrapped, x, y).backward()
        optimizer.step()
        assert_update(before, model, expected, lr=1.0, divisor=float(loader.expected_batch_size))
    assert sorted(entry.sample_rate for entry in engine.accountant.history) == [0.1, 0.5]


def test_a_hand_built_optimizer_refuses_a_second_loaders_batches():
    model = make_model()
    wrapped = GradSampleModule(model)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=0.5,
                            expected_batch_size=8)  # fmt: skip
    connect_private(wrapped, optimizer)
    first, second = (DPDataLoader.from_data_loader(DataLoader(make_data(), batch_size=8)) for _ in range(2))
    x, y = next(iter(first))
    loss_of(wrapped, x, y).backward()
    optimizer.step()  # the first loader it trains on is its own
    optimizer.zero_grad()
    x, y = next(iter(second))
    loss_of(wrapped, x, y).backward()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="drawn by DPDataLoader"):
        optimizer.step()
    assert optimizer.steps_taken == 1 and unchanged(before, model)


def test_an_optimizer_is_tied_to_one_loader():
    _engine, _model, _wrapped, optimizer, loader = private()
    other = DPDataLoader.from_data_loader(DataLoader(make_data(), batch_size=8))
    optimizer.attach_loader(loader)  # the same loader again: nothing changes
    with pytest.raises(ValueError, match="one optimizer releases the draws of one private loader"):
        optimizer.attach_loader(other)


# ------------------------------------------------------------------------ 6 identified exactly, never by size
def test_a_forward_on_a_batch_joined_to_itself_releases_nothing():
    # list(loader) then cat([x, x]): the old rule matched it to a queued batch of twice the size.
    engine, model, wrapped, optimizer, loader = private(batch_size=8)
    batches = list(loader)
    x, y = batches[0]
    loss_of(wrapped, torch.cat([x, x]), torch.cat([y, y])).backward()
    refused_at_step(engine, model, optimizer, "no batch tag")


@pytest.mark.parametrize("rows", ["first half twice", "reversed", "one row dropped"])
def test_rows_rearranged_from_a_batch_are_not_that_batch(rows):
    engine, model, wrapped, optimizer, loader = private(batch_size=8)
    batches = list(loader)
    x, y = batches[1]
    half = len(x) // 2
    build = {
        "first half twice": lambda t: torch.cat([t[:half], t[:half]]),
        "reversed": lambda t: t.flip(0),
        "one row dropped": lambda t: torch.cat([t[:1], t[2:]]),
    }[rows]
    loss_of(wrapped, build(x), build(y)).backward()
    refused_at_step(engine, model, optimizer, "no batch tag")


@pytest.mark.parametrize("copy", ["clone", "contiguous of a transpose", "pin-like copy", "to(dtype same)"])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_an_exact_copy_of_a_recent_batch_is_that_batch(copy, mode):
    engine, model, wrapped, optimizer, loader = private(mode)
    batches = iter(loader)
    x, y = next(batches)
    next(batches)  # one batch of look-ahead: the copy is of an older one
    make = {
        "clone": lambda t: t.clone(),
        "contiguous of a transpose": lambda t: t.t().contiguous().t(),  # new memory, same values
        "pin-like copy": lambda t: torch.empty_like(t).copy_(t),
        "to(dtype same)": lambda t: t.to(torch.float64, copy=True),
    }[copy]
    before = snapshot(model)
    expected = clipped_sum(model, x, y, 0.5)
    loss_of(wrapped, make(x), y).backward()
    optimizer.step()
    assert_update(before, model, expected, lr=1.0, divisor=8.0)
    assert engine.accountant.history[0].batches_per_step == 1


def test_micro_batches_of_a_copy_are_slices_of_one_draw():
    engine, model, wrapped, optimizer, loader = private("hooks")
    x, y = next(iter(loader))
    copied = x.clone()  # as .to(device) would, then split into micro-batches
    before = snapshot(model)
    expected = clipped_sum(model, x, y, 0.5)
    for xs, ys in zip(copied.split(3), y.split(3)):
        loss_of(wrapped, xs, ys).backward()
    optimizer.step()
    assert_update(before, model, expected, lr=1.0, divisor=8.0)
    assert engine.accountant.history[0].batches_per_step == 1


def test_a_copy_of_a_slice_of_a_batch_is_those_rows():
    _engine, model, wrapped, optimizer, loader = private("hooks")
    x, y = next(iter(loader))
    before = snapshot(model)
    expected = clipped_sum(model, x[2:5], y[2:5], 0.5)
    loss_of(wrapped, x[2:5].clone(), y[2:5]).backward()
    optimizer.step()
    assert_update(before, model, expected, lr=1.0, divisor=8.0)


class Flatten(nn.Module):
    """The reference model behind a reshape of its input (it receives (B, 2, FEATURES / 2))."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model()

    def forward(self, x):
        return self.inner(x.reshape(len(x), -1))


@pytest.mark.parametrize("view", ["view (B, 2, F/2)", "unsqueeze then squeeze", "row slice"])
def test_views_that_keep_the_batch_dimension_are_the_batch(view):
    model = Flatten()
    _engine, _, wrapped, optimizer, loader = private("hooks", model=model)
    x, y = next(iter(loader))
    make, rows = {
        "view (B, 2, F/2)": (lambda t: t.view(len(t), 2, FEATURES // 2), slice(None)),
        "unsqueeze then squeeze": (lambda t: t.unsqueeze(1).view(len(t), 2, FEATURES // 2), slice(None)),
        "row slice": (lambda t: t[1:6].view(5, 2, FEATURES // 2), slice(1, 6)),
    }[view]
    before = snapshot(model)
    expected = clipped_sum(model.inner, x[rows], y[rows], 0.5)
    loss_of(wrapped, make(x), y[rows]).backward()
    optimizer.step()
    assert_update(before, model, expected, lr=1.0, divisor=8.0)


def test_a_copy_of_a_batch_yielded_long_ago_is_refused_and_move_to_keeps_it():
    engine, _model, wrapped, optimizer, loader = private(batch_size=4)
    batches = list(loader)
    assert len(batches) > RECENT_BATCHES + 1
    x, y = batches[0]
    loss_of(wrapped, x.clone(), y).backward()
    with pytest.raises(RuntimeError, match=r"privacy_engine\.move_to"):
        optimizer.step()
    optimizer.zero_grad()
    assert engine.accountant.steps == 0
    moved = move_to(batches[0], "cpu", copy=True)
    loss_of(wrapped, *moved).backward()
    optimizer.step()
    assert engine.accountant.steps == 1


def test_a_buffer_refilled_in_place_is_the_batch_it_now_holds():
    # A prefetcher that copies every batch into one preallocated buffer: a stale tag must not follow it.
    engine, model, wrapped, optimizer, loader = private()
    batches = iter(loader)
    buffer = torch.empty(0, dtype=torch.float64)
    for _ in range(2):
        x, y = next(batches)
        buffer = buffer.resize_(x.shape) if buffer.shape != x.shape else buffer
        buffer.copy_(x)
        before = snapshot(model)
        expected = clipped_sum(model, x, y, 0.5)
        optimizer.zero_grad()
        loss_of(wrapped, buffer, y).backward()
        optimizer.step()
        assert_update(before, model, expected, lr=1.0, divisor=8.0)
    assert engine.accountant.steps == 2


def test_a_loop_that_only_iterates_keeps_a_bounded_number_of_batches():
    _engine, _model, _wrapped, _optimizer, loader = private(batch_size=4)
    for _ in range(5):
        for _ in loader:
            pass
    assert len(loader.tickets.recent()) == RECENT_BATCHES


# ------------------------------------------------------------------- 6 the GAN pattern: generated rows joined
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("fake", ["first half twice", "another batch's rows", "the batch shuffled"])
def test_a_joined_batch_holding_drawn_rows_releases_nothing(mode, fake):
    engine, _model, wrapped, _optimizer, loader = private(mode, batch_size=8)
    batches = iter(loader)
    x, _y = next(batches)
    other, _ = next(batches)
    half = len(x) // 2
    assert len(x) > 1 and len(other) > 0, "the seed should draw two non-empty batches"
    joined = {
        "first half twice": lambda: torch.cat([x[:half], x[: len(x) - half]]),
        "another batch's rows": lambda: other[torch.arange(len(x)) % len(other)],
        "the batch shuffled": lambda: x.roll(1, 0),
    }[fake]()
    wrapped(x)
    with pytest.raises(RuntimeError, match="other than example i's own"):
        wrapped(joined)
    assert engine.accountant.steps == 0


def test_an_augmented_copy_that_leaves_some_rows_unchanged_is_joined_to_its_own_examples():
    # Consistency training: row i of the second input is example i's own data (some rows flipped, some not).
    engine, _model, wrapped, optimizer, loader = private("hooks", batch_size=8)
    x, y = next(iter(loader))
    augmented = torch.where(torch.arange(len(x))[:, None] % 2 == 0, -x, x)
    out_real, out_augmented = wrapped(x), wrapped(augmented)
    (nn.functional.cross_entropy(out_real, y) + nn.functional.cross_entropy(out_augmented, y)).backward()
    optimizer.step()
    assert engine.accountant.steps == 1 and engine.accountant.history[0].batches_per_step == 1


def test_generated_inputs_joined_to_a_drawn_batch_are_clipped_with_its_examples():
    _engine, model, wrapped, optimizer, loader = private("hooks", batch_size=8)
    x, y = next(iter(loader))
    fake = torch.randn_like(x)
    before = snapshot(model)
    # reference: example i's loss is real_i + fake_i, clipped once
    reference = make_model()
    reference.load_state_dict(model.state_dict())
    params = list(reference.parameters())
    expected = [torch.zeros_like(p) for p in params]
    for i in range(len(x)):
        loss = nn.functional.cross_entropy(reference(x[i : i + 1]), y[i : i + 1]) + nn.functional.cross_entropy(
            reference(fake[i : i + 1]), y[i : i + 1]
        )
        grads = torch.autograd.grad(loss, params)
        factor = min(1.0, 0.5 / float(torch.sqrt(sum(g.pow(2).sum() for g in grads))))
        expected = [e + factor * g for e, g in zip(expected, grads)]
    out_real, out_fake = wrapped(x), wrapped(fake)
    loss = nn.functional.cross_entropy(out_real, y, reduction="sum") + nn.functional.cross_entropy(
        out_fake, y, reduction="sum"
    )
    (loss / len(x)).backward()
    optimizer.step()
    assert_update(before, model, expected, lr=1.0, divisor=8.0)


# ----------------------------------------------------------------------------- 7 no_op: one row per drawn example
@pytest.mark.parametrize("rows", ["twice the batch", "one row less"])
def test_no_op_per_sample_gradients_with_another_row_count_are_refused(rows):
    engine, model, wrapped, optimizer, loader = private("no_op")
    x, _y = next(iter(loader))
    wrapped(x)
    count = 2 * len(x) if rows == "twice the batch" else len(x) - 1
    for p in model.parameters():
        p.grad_sample = torch.full((count, *p.shape), 0.01, dtype=p.dtype)
    with pytest.raises(RuntimeError, match="one row per example"):
        optimizer.step()
    assert engine.accountant.steps == 0


def test_no_op_per_sample_gradients_of_the_batch_are_released_clipped():
    _engine, model, wrapped, optimizer, loader = private("no_op")
    x, y = next(iter(loader))
    before = snapshot(model)
    expected = clipped_sum(model, x, y, 0.5)
    wrapped(x)
    params = list(model.parameters())
    for p in params:
        p.grad_sample = torch.zeros(len(x), *p.shape, dtype=p.dtype)
    for i in range(len(x)):
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), params)
        for p, g in zip(params, grads):
            p.grad_sample[i] = g
    optimizer.step()
    assert_update(before, model, expected, lr=1.0, divisor=8.0)


# ----------------------------------------------------------------------------- 8 one step per batch
@pytest.mark.parametrize("mode", ["hooks", "ghost", "no_op"])
@pytest.mark.parametrize("zero_grad_between", [False, True])
def test_a_second_step_without_a_new_batch_raises_and_counts_nothing(mode, zero_grad_between):
    engine, model, wrapped, optimizer, loader = private(mode, sigma=1.0)
    x, y = next(iter(loader))
    loss_of(wrapped, x, y).backward()
    if mode == "no_op":
        for p in model.parameters():
            p.grad_sample = torch.zeros(len(x), *p.shape, dtype=p.dtype)
    optimizer.step()
    if zero_grad_between:
        optimizer.zero_grad()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="without a new batch"):
        optimizer.step()
    assert engine.accountant.steps == 1 and unchanged(before, model)


def test_a_hand_built_optimizer_refuses_a_second_step_without_a_batch():
    model = make_model()
    wrapped = GradSampleModule(model)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0, max_grad_norm=0.5,
                            expected_batch_size=8)  # fmt: skip
    connect_private(wrapped, optimizer)
    x, y = make_data(8).tensors
    loss_of(wrapped, x, y).backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="without a new batch"):
        optimizer.step()
    assert optimizer.steps_taken == 1


def test_an_empty_batch_the_loop_skips_is_still_stepped_and_counted():
    # q = 1/40: most Poisson batches are empty; a loop that steps without a forward on them is valid.
    engine, _model, wrapped, optimizer, loader = private(batch_size=1, sigma=1.0)
    steps = 0
    for x, y in loader:
        optimizer.zero_grad()
        if len(x) > 0:
            loss_of(wrapped, x, y).backward()
        optimizer.step()
        steps += 1
    assert engine.accountant.steps == steps == len(loader)


# ----------------------------------------------------------------------------- the identification rules
def tagged_batch(rows: int = 6, *shape: int) -> tuple[torch.Tensor, BatchTicket]:
    batch = torch.randn(rows, *(shape or (4, 3)))
    ticket = BatchTicket(loader_step=0, size=rows)
    tag_batch(batch, ticket)
    return batch, ticket


@pytest.mark.parametrize(
    ("view", "batch_dim", "rows"),
    [
        (lambda x: x[2:5], 0, (2, 5)),
        (lambda x: x.split(4)[1], 0, (4, 6)),
        (lambda x: x.view(6, -1), 0, (0, 6)),
        (lambda x: x.unsqueeze(1), 0, (0, 6)),
        (lambda x: x[:, 1:, :2], 0, (0, 6)),  # part of every example, nothing of another
        (lambda x: x.transpose(0, 1), 1, (0, 6)),  # a batch-second model
        (lambda x: x[1:3].permute(2, 0, 1), 1, (1, 3)),
    ],
)
def test_a_view_that_keeps_each_example_in_its_own_row_is_that_batch(view, batch_dim, rows):
    batch, ticket = tagged_batch()
    found = find_ticket(view(batch), batch_dim=batch_dim)
    assert found is not None and found.draw is ticket.draw and found.rows == rows


@pytest.mark.parametrize(
    ("view", "batch_dim"),
    [
        (lambda x: x.transpose(0, 1), 0),  # the batch is not dimension 0 of this view
        (lambda x: x.reshape(-1, 3)[:6], 0),  # rows of 3 values: examples 0 and 1 span 8 of these rows
        (lambda x: x.view(3, 24), 0),  # two examples per row
        (lambda x: x[::2], 0),  # every other example: rows are not consecutive
        (lambda x: x.view(torch.int32), 0),  # another element size
    ],
)
def test_a_view_whose_rows_mix_or_skip_examples_is_not_the_batch(view, batch_dim):
    batch, _ = tagged_batch()
    assert find_ticket(view(batch), batch_dim=batch_dim) is None


def test_a_tag_is_dropped_when_the_tensor_is_modified_in_place():
    batch, ticket = tagged_batch()
    assert find_ticket(batch) is ticket
    batch.mul_(2)
    assert find_ticket(batch) is None


@pytest.mark.parametrize("seed", range(5))
def test_row_runs_finds_exactly_the_runs_a_plain_loop_finds(seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 3, (12, 2), generator=generator).double()  # few distinct rows: many repeats
    values[int(torch.randint(0, 12, (1,), generator=generator)), 0] = float("nan")
    for start, count in [(0, 12), (3, 4), (7, 1), (0, 1)]:
        candidate = values[start : start + count].clone()
        expected = [
            a for a in range(len(values) - count + 1)
            if all(
                all((u == v) or (u != u and v != v) for u, v in zip(candidate[i].tolist(), values[a + i].tolist()))
                for i in range(count)
            )
        ]  # fmt: skip
        assert row_runs(candidate, 0, values) == expected
        assert start in expected
    assert row_runs(values[:3].float(), 0, values) == []  # a dtype change is not a copy
    assert row_runs(values[:0], 0, values) == [] and row_runs(values[:0], 0, values[:0]) == [0]
