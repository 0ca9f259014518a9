"""User-level DP in ghost mode (``make_private(privacy_unit="user", grad_sample_mode="ghost")``, issue 23 part 3).

A user's clipped quantity is the norm of the SUM of its examples' gradients, cross terms included. Every
release is compared with a float64 loop: each example alone through a copy of the model
(``conftest.per_example_reference``), a user's per-example gradients summed, the sum clipped once (per group
for per-layer clipping). Each model runs with ``per_sample_memory_ratio`` 0 (norm forms wherever a layer has
one: a user's rows stacked for linear maps, embeddings, LayerNorm and attention's projections; conv and
GroupNorm through their per-example gradients summed per user) and ``inf`` (every layer's per-example
gradients formed and summed per user).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import per_example_reference
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from grad_samplers.linear import linear_norm_sample
from grad_samplers.normalization import normalization_norm_sample
from privacy_engine import PrivacyEngine
from privacy_engine.batches.tickets import BatchTicket, find_ticket
from privacy_engine.clipping.per_user import UserRows, UserSplitError, stacks_users, user_rows
from privacy_engine.training.virtual_steps import VirtualSteps

NUM_USERS = 6


def user_ids_for(num_examples: int, seed: int) -> list[int]:
    """Every user owns at least three examples; counts uneven (with k = 4 some users repeat examples)."""
    generator = torch.Generator().manual_seed(seed)
    extra = num_examples - 3 * NUM_USERS
    ids = torch.cat([torch.arange(NUM_USERS).repeat(3), torch.randint(0, NUM_USERS, (extra,), generator=generator)])
    return ids[torch.randperm(num_examples, generator=generator)].tolist()


def sequence_loss(output, targets, reduction):
    """Each example's loss is the sum over its positions; "mean" averages over examples (rows)."""
    losses = nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1), reduction="none")
    per_example = losses.reshape(targets.shape)
    if per_example.dim() > 1:
        per_example = per_example.flatten(1).sum(dim=1)
    return per_example.mean() if reduction == "mean" else per_example.sum()


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        context, _ = self.attention(x, x, x, need_weights=False)
        return self.head(context)


class EmbeddingBagOfWords(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(7, 4, padding_idx=0)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.embedding(ids)))


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=11, n_embd=8, n_layer=1, n_head=2, n_positions=8, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip

    class LogitsOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = transformers.GPT2LMHeadModel(config)

        def forward(self, ids):
            return self.gpt2(input_ids=ids).logits

    return LogitsOnly()


def _case(name: str, generator: torch.Generator, num_examples: int):
    """(model, inputs, targets): float64, every model's output (batch, ..., classes)."""
    randn = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)
    classes = lambda *shape: torch.randint(0, 3, shape, generator=generator)
    if name == "linear_2d":
        return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), randn(num_examples, 5) * 2, classes(num_examples)
    if name == "linear_3d":
        return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), randn(num_examples, 3, 5), classes(num_examples, 3)
    if name == "embedding":
        ids = torch.randint(0, 7, (num_examples, 4), generator=generator)  # repeats and padding_idx 0 included
        return EmbeddingBagOfWords(), ids, classes(num_examples, 4)
    if name == "layer_norm":
        model = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))
        return model, randn(num_examples, 3, 5), classes(num_examples, 3)
    if name == "conv":
        model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 16, 3))
        return model, randn(num_examples, 2, 4, 4), classes(num_examples)
    if name == "attention":
        return Attention(), randn(num_examples, 3, 4), classes(num_examples, 3)
    if name == "gpt2":
        ids = torch.randint(1, 11, (num_examples, 5), generator=generator)
        return _gpt2(), ids, torch.randint(0, 11, (num_examples, 5), generator=generator)
    raise AssertionError(name)


def reference_release(model, x, y, row_users, *, reduction, clipper, names, expected_users):
    """Float64 loop: each example alone, summed per user, each user's sum clipped once per clipping group;
    returns the release and how many (user, group) sums were clipped (> 0: the test can tell per-user clipping
    from per-example clipping)."""
    if len(x) == 0:  # no user sampled: nothing is clipped, the release is the noise alone
        return {name: torch.zeros_like(param) for name, param in model.named_parameters()}, 0
    per_example = per_example_reference(model, (x,), lambda out, i: sequence_loss(out, y[i : i + 1], "sum"))
    group_of = {name: clipper.group_index(param) for name, param in names.items()}
    total = {name: torch.zeros_like(value[0]) for name, value in per_example.items()}
    clipped = 0
    for user in row_users.unique().tolist():
        user_grad = {name: value[row_users == user].sum(dim=0) for name, value in per_example.items()}
        for group, bound in enumerate(clipper.bounds):
            members = [name for name in user_grad if group_of[name] == group]
            norm = math.sqrt(sum(float(user_grad[name].pow(2).sum()) for name in members))
            factor = min(1.0, bound / norm) if norm > 0 else 0.0
            clipped += factor < 1.0
            for name in members:
                total[name] += factor * user_grad[name]
    divisor = expected_users if reduction == "mean" else 1.0
    return {name: value / divisor for name, value in total.items()}, clipped


def ghost_run(model, dataset, user_ids, *, k, batch_size=3, reduction="mean", clipping="flat", max_grad_norm=0.5,
              ratio=0.0, sigma=0.0):  # fmt: skip
    engine = PrivacyEngine()
    wrapped, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=DataLoader(dataset, batch_size=batch_size),
        noise_multiplier=sigma, max_grad_norm=max_grad_norm, grad_sample_mode="ghost", loss_reduction=reduction,
        clipping=clipping, privacy_unit="user", user_ids=user_ids, examples_per_user=k, noise_seed=0,
    )  # fmt: skip
    wrapped.per_sample_memory_ratio = ratio
    return wrapped, optimizer, loader


def check_against_the_loop(name, *, ratio, clipping="flat", reduction="mean", k=3, seed=0, steps=2):
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    num_examples = 22
    model, x, y = _case(name, generator, num_examples)
    model = model.double()
    plain = copy.deepcopy(model)
    names = dict(model.named_parameters())
    bounds = 0.4 if clipping == "flat" else 0.3
    wrapped, optimizer, loader = ghost_run(model, TensorDataset(x, y), user_ids_for(num_examples, seed + 1), k=k,
                                           clipping=clipping, reduction=reduction, ratio=ratio,
                                           max_grad_norm=bounds)  # fmt: skip
    if clipping == "per_layer":
        assert optimizer.clipper.num_groups > 1
    checked = clipped = 0
    for batch_x, batch_y in loader:
        row_users = find_ticket(batch_x).user_rows()
        expected, clipped_here = reference_release(plain, batch_x, batch_y, row_users, reduction=reduction,
                                                   clipper=optimizer.clipper, names=names,
                                                   expected_users=loader.expected_batch_size)  # fmt: skip
        optimizer.zero_grad()
        sequence_loss(wrapped(batch_x), batch_y, reduction).backward()
        optimizer.step()
        for param_name, param in names.items():
            torch.testing.assert_close(param.grad, expected[param_name], rtol=1e-9, atol=1e-12, msg=param_name)
        if len(batch_x):
            assert optimizer.last_clipping_stats.num_examples == len(batch_x) // k  # users are counted
            checked += 1
            clipped += clipped_here
        if checked >= steps:
            break
    assert checked >= 1 and clipped >= 1


@pytest.mark.parametrize("ratio", [0.0, math.inf])
@pytest.mark.parametrize("name", ["linear_2d", "linear_3d", "embedding", "layer_norm", "conv", "attention"])
def test_each_users_summed_gradient_is_clipped_once_as_a_float64_loop_over_users(name, ratio):
    check_against_the_loop(name, ratio=ratio)


@pytest.mark.parametrize("name", ["linear_3d", "conv", "attention"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_layer_clipping_clips_each_users_slice_of_each_group_once(name, reduction):
    check_against_the_loop(name, ratio=0.0, clipping="per_layer", reduction=reduction, seed=3)


@pytest.mark.parametrize("k", [1, 4])
def test_one_row_and_more_rows_than_a_user_owns_match_the_loop(k):
    check_against_the_loop("linear_3d", ratio=0.0, k=k, seed=5)


@pytest.mark.slow
@pytest.mark.parametrize("ratio", [0.0, math.inf])
def test_a_tiny_gpt2_clips_each_user_once_in_ghost_mode(ratio):
    """HF Conv1D projections and LayerNorms (stacked users), the tied wte / lm_head (a shared parameter:
    its uses' forms plus cross terms, per user), the position embedding (shared by the examples, broadcast)."""
    check_against_the_loop("gpt2", ratio=ratio, k=2, steps=1)


def test_virtual_steps_in_ghost_mode_release_what_whole_batches_release():
    generator = torch.Generator().manual_seed(2)
    model, x, y = _case("linear_3d", generator, 22)
    user_ids = user_ids_for(22, 4)
    releases, sizes = [], set()
    for micro in (False, True):
        torch.manual_seed(11)
        wrapped, optimizer, loader = ghost_run(copy.deepcopy(model).double(), TensorDataset(x, y), user_ids, k=2,
                                               batch_size=5)  # fmt: skip
        released = []
        optimizer.attach_step_hook(lambda opt, out=released: out.append(torch.cat([p.grad.flatten() for p in opt.params])))
        batches = VirtualSteps(data_loader=loader, max_physical_batch_size=5, optimizer=optimizer) if micro else loader
        for batch_x, batch_y in batches:
            sizes.add((micro, len(batch_x)))
            optimizer.zero_grad()
            sequence_loss(wrapped(batch_x), batch_y, "mean").backward()
            optimizer.step()
        releases.append(torch.stack(released))
    assert max(n for micro, n in sizes if not micro) > 4 and {n for micro, n in sizes if micro} <= {0, 2, 4}
    torch.testing.assert_close(releases[0], releases[1], rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("seed", [0, 1])
def test_removing_one_user_moves_the_ghost_release_by_at_most_the_clip_norm(seed):
    """Noise off, every user sampled, "sum": removing every example of one user (three outliers, in one
    sequence model whose positions interact through attention) moves the release by at most C, and by about C."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model, x, y = _case("attention", generator, 15)
    model = model.double()
    x[12:] = 30.0 * x[12:].abs()
    user_ids = [i % 4 for i in range(12)] + [9, 9, 9]

    def release(rows):
        wrapped, optimizer, loader = ghost_run(copy.deepcopy(model), TensorDataset(x[rows], y[rows]),
                                               [user_ids[i] for i in rows], k=3, reduction="sum", max_grad_norm=1.0,
                                               batch_size=len({user_ids[i] for i in rows}))  # fmt: skip
        batch_x, batch_y = next(iter(loader))
        sequence_loss(wrapped(batch_x), batch_y, "sum").backward()
        optimizer.step()
        return torch.cat([p.grad.flatten() for p in optimizer.params])

    move = float((release(list(range(15))) - release(list(range(12)))).norm())
    assert 0.9 < move <= 1.0 + 1e-9


def test_a_slice_that_cuts_a_user_is_refused_before_anything_is_clipped():
    generator = torch.Generator().manual_seed(0)
    model, x, y = _case("linear_2d", generator, 22)
    wrapped, optimizer, loader = ghost_run(model.double(), TensorDataset(x, y), user_ids_for(22, 1), k=2, batch_size=6)
    batch_x, batch_y = next(iter(loader))
    assert len(batch_x) > 3
    with pytest.raises(UserSplitError, match="multiple of examples_per_user"):
        sequence_loss(wrapped(batch_x[:3]), batch_y[:3], "mean").backward()  # rows 0-2 cut user 1's rows
    assert not optimizer.clipper.has_accumulated and optimizer.steps_taken == 0


def test_a_batch_no_user_level_loader_drew_is_refused_in_ghost_mode():
    generator = torch.Generator().manual_seed(0)
    model, x, y = _case("linear_2d", generator, 22)
    wrapped, optimizer, _ = ghost_run(model.double(), TensorDataset(x, y), user_ids_for(22, 1), k=2)
    with pytest.raises(ValueError, match="no user-level batch"):
        sequence_loss(wrapped(x[:4].clone()), y[:4], "mean").backward()
    assert not optimizer.clipper.has_accumulated


# ---------------------------------------------------------------------------------------- the layout
def test_user_rows_reads_k_consecutive_rows_per_user_and_refuses_other_layouts():
    users = torch.tensor([0, 0, 1, 1, 2, 2])
    assert user_rows(BatchTicket(loader_step=0, size=6, users=users)) == UserRows(3, 2)
    assert user_rows(BatchTicket(loader_step=0, size=6, users=users).slice(2, 6)) == UserRows(2, 2)
    assert user_rows(BatchTicket(loader_step=0, size=6)) is None and user_rows(None) is None
    assert user_rows(BatchTicket(loader_step=0, size=0, users=torch.zeros(0, dtype=torch.long))) == UserRows(0, 1)
    with pytest.raises(ValueError, match="k consecutive rows"):
        user_rows(BatchTicket(loader_step=0, size=5, users=torch.tensor([0, 0, 1, 2, 2])))
    with pytest.raises(ValueError, match="k consecutive rows"):
        user_rows(BatchTicket(loader_step=0, size=6, users=torch.tensor([0, 0, 1, 1, 0, 0])))
    with pytest.raises(UserSplitError):
        user_rows(BatchTicket(loader_step=0, size=6, users=users).slice(1, 6))


def test_user_rows_moves_between_rows_and_users():
    layout = UserRows(2, 3)
    rows = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(layout.stack(rows), rows.reshape(2, 3, 2))
    assert torch.equal(layout.sum_rows(rows), torch.tensor([[6.0, 9.0], [24.0, 27.0]]))
    assert torch.equal(layout.expand(torch.tensor([1.0, 2.0])), torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0, 2.0]))
    assert layout.stack("not a tensor") == "not a tensor"
    assert layout.user_padding(None) is None
    assert layout.user_padding(torch.tensor([True] * 3 + [False] * 3)).tolist() == [True, False]
    with pytest.raises(ValueError, match="some but not all rows of a user"):
        layout.user_padding(torch.tensor([True, False, False, False, False, False]))


def test_only_position_summed_norm_forms_take_stacked_users():
    assert stacks_users(nn.Linear(2, 2), linear_norm_sample)
    assert stacks_users(nn.LayerNorm(2), normalization_norm_sample)
    assert not stacks_users(nn.GroupNorm(1, 2), normalization_norm_sample)  # channels on axis 1: not stackable
    assert not stacks_users(nn.Linear(2, 2), lambda layer, a, g: {})  # a plugin's form: materialised instead


def test_an_empty_user_level_batch_releases_zeros_in_ghost_mode():
    """q = 1/6: some steps sample no user; noise off, their release is exactly zero, the others match the loop."""
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    model, x, y = _case("linear_3d", generator, 22)
    model = model.double()
    plain = copy.deepcopy(model)
    wrapped, optimizer, loader = ghost_run(model, TensorDataset(x, y), user_ids_for(22, 2), k=2, batch_size=1)
    sizes = []
    for _ in range(3):
        for batch_x, batch_y in loader:
            sizes.append(len(batch_x))
            expected, _ = reference_release(plain, batch_x, batch_y, find_ticket(batch_x).user_rows(), reduction="mean",
                                            clipper=optimizer.clipper, names=dict(model.named_parameters()),
                                            expected_users=loader.expected_batch_size)  # fmt: skip
            optimizer.zero_grad()
            sequence_loss(wrapped(batch_x), batch_y, "mean").backward()
            optimizer.step()
            for name, param in model.named_parameters():
                torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-12)
    assert 0 in sizes and max(sizes) > 0


def test_bandmf_in_ghost_mode_clips_each_user_once():
    """Cyclic Poisson sampling over users with BandMF noise (sigma 0): each release is the loop's clipped sum."""
    generator = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    model, x, y = _case("attention", generator, 22)
    model = model.double()
    plain = copy.deepcopy(model)
    engine = PrivacyEngine()
    wrapped, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=DataLoader(TensorDataset(x, y), batch_size=2),
        noise_multiplier=0.0, max_grad_norm=0.4, grad_sample_mode="ghost", noise_mechanism="bandmf", num_bands=2,
        total_steps=4, privacy_unit="user", user_ids=user_ids_for(22, 5), examples_per_user=2, noise_seed=0,
    )  # fmt: skip
    checked = 0
    for batch_x, batch_y in loader:
        expected, _ = reference_release(plain, batch_x, batch_y, find_ticket(batch_x).user_rows(), reduction="mean",
                                        clipper=optimizer.clipper, names=dict(model.named_parameters()),
                                        expected_users=loader.expected_batch_size)  # fmt: skip
        optimizer.zero_grad()
        sequence_loss(wrapped(batch_x), batch_y, "mean").backward()
        optimizer.step()
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-12)
        checked += len(batch_x) > 0
    assert checked >= 1
