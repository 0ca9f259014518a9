"""DPOptimizer and virtual steps: the update is clip-sum + noise over the expected batch size,
every released step is recorded, and the wrapper behaves as the optimizer it wraps."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accountants import make_accountant
from privacy_engine import connect_private
from privacy_engine.capture import GradSampleModule
from privacy_engine.clipping import PerSampleGradientClipper
from privacy_engine.noise import BandMFNoise, GaussianNoise
from privacy_engine.opacus.utils.batch_memory_manager import BatchMemoryManager
from privacy_engine.training.data_loader import DPDataLoader
from privacy_engine.training.optimizer import DPOptimizer
from privacy_engine.training.virtual_steps import VirtualSteps, split_batch
from tests.conftest import per_example_reference


def make_model(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(dtype)


def make_batch(size, seed=1, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 5, generator=generator, dtype=dtype) * 2, torch.randint(0, 3, (size,), generator=generator)


def backward(model, inputs, targets, reduction="mean"):
    nn.functional.cross_entropy(model(inputs), targets, reduction=reduction).backward()


def reference_clipped_sum(model, inputs, targets, max_grad_norm):
    """float64 per-example loop (independent of GradSampleModule and the clipper)."""
    per_example = per_example_reference(
        model, [inputs], lambda out, i: nn.functional.cross_entropy(out, targets[i : i + 1])
    )
    names = [n for n, _ in model.named_parameters()]
    totals = {n: torch.zeros_like(per_example[n][0]) for n in names}
    for i in range(inputs.shape[0]):
        norm = math.sqrt(sum(float(per_example[n][i].pow(2).sum()) for n in names))
        factor = min(1.0, max_grad_norm / norm) if norm > 0 else 1.0
        for n in names:
            totals[n] += factor * per_example[n][i]
    return [totals[n] for n in names]


def noise_draws(seed, params, noise_multiplier, max_grad_norm, noise_stream="mt19937"):
    """The noise GaussianNoise(seed) adds at its first step to tensors shaped like params."""
    tensors = [torch.zeros_like(p) for p in params]
    GaussianNoise(seed=seed, noise_stream=noise_stream).add_noise_(tensors, noise_multiplier, max_grad_norm)
    return tensors


# ---------------------------------------------------------------------------- the update
@pytest.mark.parametrize("noise_stream", ["mt19937", "counter-v1"])
def test_update_is_clipped_sum_plus_noise_over_expected_batch_size(noise_stream):
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    inputs, targets = make_batch(6)
    clipped = reference_clipped_sum(model, inputs, targets, 0.5)
    noise = noise_draws(3, list(model.parameters()), 1.3, 0.5, noise_stream)
    wrapped = GradSampleModule(model)
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.3, max_grad_norm=0.5,
        expected_batch_size=10, noise=GaussianNoise(seed=3, noise_stream=noise_stream),
    )  # fmt: skip
    connect_private(wrapped, optimizer)
    backward(wrapped, inputs, targets)
    optimizer.step()
    for param, start, total, z in zip(model.parameters(), before, clipped, noise):
        # Realised batch 6, expected 10: the sum is divided by 10.
        torch.testing.assert_close(param.detach(), start - 0.1 * (total + z) / 10, rtol=1e-10, atol=1e-12)


def test_sum_reduction_is_not_divided():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    inputs, targets = make_batch(4)
    clipped = reference_clipped_sum(model, inputs, targets, 1.0)
    wrapped = GradSampleModule(model, loss_reduction="sum")
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=1.0, loss_reduction="sum"
    )
    connect_private(wrapped, optimizer)
    backward(wrapped, inputs, targets, reduction="sum")
    optimizer.step()
    for param, start, total in zip(model.parameters(), before, clipped):
        torch.testing.assert_close(param.detach(), start - 0.1 * total, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "clipper_kwargs, sensitivity",
    [
        ({"max_grad_norm": 0.7}, 0.7),
        ({"max_grad_norm": [0.3, 0.4], "clipping": "per_layer"}, 0.5),
        ({"max_grad_norm": 2.0, "rescale_to_unit_norm": True}, 1.0),
    ],
)
def test_noise_has_the_intended_standard_deviation(clipper_kwargs, sensitivity):
    # Zero gradients in: the update is the noise alone, std sigma * sensitivity / expected batch.
    weight, bias = nn.Parameter(torch.zeros(200, 100)), nn.Parameter(torch.zeros(100))
    clipper = PerSampleGradientClipper([weight, bias], groups=[[weight], [bias]], **clipper_kwargs)
    optimizer = DPOptimizer(
        torch.optim.SGD([weight, bias], lr=1.0), noise_multiplier=1.5, expected_batch_size=4, clipper=clipper,
        noise_seed=2024,
    )  # fmt: skip
    for param in (weight, bias):
        param.grad_sample = torch.zeros(3, *param.shape)
    optimizer.step()
    update = -torch.cat([weight.detach().flatten(), bias.detach().flatten()]).double()
    expected_std = 1.5 * sensitivity / 4
    # 20,100 draws: the sample std has relative standard error 1/sqrt(2n) = 0.5 %; allow 3 %.
    assert float(update.std()) == pytest.approx(expected_std, rel=0.03)
    assert abs(float(update.mean())) < 4 * expected_std / math.sqrt(update.numel())


def test_noise_is_seedable_and_secure_mode_refuses_a_seed():
    def first_update(seed):
        param = nn.Parameter(torch.zeros(50))
        DPOptimizer(torch.optim.SGD([param], lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
                    expected_batch_size=1, noise_seed=seed).step()  # fmt: skip
        return param.detach().clone()

    assert torch.equal(first_update(5), first_update(5))
    assert not torch.equal(first_update(5), first_update(6))
    with pytest.raises(ValueError, match="seed"):
        DPOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0), noise_multiplier=1.0,
                    max_grad_norm=1.0, expected_batch_size=1, noise_seed=1, secure_mode=True)  # fmt: skip
    secure = nn.Parameter(torch.zeros(50))
    DPOptimizer(torch.optim.SGD([secure], lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
                expected_batch_size=1, secure_mode=True).step()  # fmt: skip
    assert torch.count_nonzero(secure) == 50


# ---------------------------------------------------------------------------- accounting
def test_every_released_step_is_recorded_including_an_empty_batch():
    model = make_model()
    wrapped = GradSampleModule(model)
    accountant = make_accountant("rdp")
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
        expected_batch_size=4, noise_seed=0, accountant=accountant, sample_rate=0.25,
    )  # fmt: skip
    connect_private(wrapped, optimizer)
    for size in (4, 0, 3):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        inputs, targets = make_batch(size)
        backward(wrapped, inputs, targets)
        optimizer.step()
        assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before)), "noise was skipped"
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match="without a new batch"):
        optimizer.step()  # no forward, no backward since the last step: refused, nothing counted
    assert accountant.steps == 3 == optimizer.steps_taken
    assert accountant.history[0].noise_multiplier == 1.0 and accountant.history[0].sample_rate == 0.25


def test_skipped_steps_release_nothing_until_the_closing_step():
    model = make_model()
    wrapped = GradSampleModule(model)
    accountant = make_accountant("pld")
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
        expected_batch_size=4, noise_seed=0, accountant=accountant, sample_rate=0.5,
    )  # fmt: skip
    connect_private(wrapped, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.signal_skip_step(True)
    backward(wrapped, *make_batch(3))
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert accountant.steps == 0 and optimizer.clipper.has_accumulated
    optimizer.zero_grad()  # between micro-batches: the open sum survives
    assert optimizer.clipper.has_accumulated
    backward(wrapped, *make_batch(2, seed=2))
    optimizer.step()
    assert accountant.steps == 1 and optimizer.last_clipping_stats.num_examples == 5


# ---------------------------------------------------------------------------- optimizer behaviour
def test_zero_grad_clears_grads_grad_samples_and_the_accumulator():
    model = make_model()
    wrapped = GradSampleModule(model)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                            max_grad_norm=1.0, expected_batch_size=4)  # fmt: skip
    connect_private(wrapped, optimizer)
    backward(wrapped, *make_batch(3))
    optimizer.clip_and_accumulate()
    backward(wrapped, *make_batch(3))
    optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None and p.grad_sample is None for p in model.parameters())
    assert not optimizer.clipper.has_accumulated


@pytest.mark.parametrize(
    "make_inner",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=1e-2),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    ],
)
def test_state_dict_round_trip_resumes_identically(make_inner):
    def train(model, optimizer, steps, seed):
        wrapped = GradSampleModule(model)
        connect_private(wrapped, optimizer)
        for step in range(steps):
            optimizer.zero_grad()
            backward(wrapped, *make_batch(4, seed=seed + step))
            optimizer.step()
        wrapped.to_standard_module()

    def fresh(seed):
        model = make_model()
        return model, DPOptimizer(make_inner(model.parameters()), noise_multiplier=1.0, max_grad_norm=1.0,
                                  expected_batch_size=4, noise_seed=seed)  # fmt: skip

    model, optimizer = fresh(seed=11)
    train(model, optimizer, 2, seed=0)
    model_state, optimizer_state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    train(model, optimizer, 3, seed=100)

    resumed_model, resumed_optimizer = fresh(seed=99)  # another seed: the saved state must win
    resumed_model.load_state_dict(model_state)
    resumed_optimizer.load_state_dict(optimizer_state)
    train(resumed_model, resumed_optimizer, 3, seed=100)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    assert resumed_optimizer.steps_taken == optimizer.steps_taken == 5


def test_failed_load_state_dict_changes_nothing():
    model = make_model()
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                            max_grad_norm=1.0, expected_batch_size=4, noise_seed=0)  # fmt: skip
    state = optimizer.state_dict()
    state["privacy_engine.dp_state"]["clipper"]["bounds"] = [2.0]
    state["param_groups"][0]["lr"] = 5.0
    with pytest.raises(ValueError, match="bounds"):
        optimizer.load_state_dict(state)
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_behaves_as_the_wrapped_optimizer_for_schedulers():
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    optimizer = DPOptimizer(inner, noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4)
    assert optimizer.param_groups is inner.param_groups and optimizer.state is inner.state
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    wrapped = GradSampleModule(model)
    connect_private(wrapped, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "scheduler.step() before optimizer.step()" would fire here
        for _ in range(2):
            optimizer.zero_grad()
            backward(wrapped, *make_batch(2))
            optimizer.step()
            scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.25)


def test_closure_is_evaluated_once_and_its_loss_returned():
    model = make_model()
    wrapped = GradSampleModule(model)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0,
                            max_grad_norm=1.0, expected_batch_size=4)  # fmt: skip
    connect_private(wrapped, optimizer)
    calls = []

    def closure():
        calls.append(1)
        loss = nn.functional.cross_entropy(wrapped(make_batch(3)[0]), make_batch(3)[1])
        loss.backward()
        return loss

    assert optimizer.step(closure) is not None and len(calls) == 1
    assert optimizer.last_clipping_stats.num_examples == 3


def test_unused_parameter_is_noised_and_frozen_parameter_untouched():
    model = make_model()
    unused = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    model[2].bias.requires_grad_(False)
    frozen_before = model[2].bias.detach().clone()
    wrapped = GradSampleModule(model)
    optimizer = DPOptimizer(torch.optim.SGD([*model.parameters(), unused], lr=1.0), noise_multiplier=1.0,
                            max_grad_norm=1.0, expected_batch_size=4, noise_seed=0)  # fmt: skip
    connect_private(wrapped, optimizer)
    backward(wrapped, *make_batch(3))
    optimizer.step()
    assert torch.count_nonzero(unused) == 3
    assert torch.equal(model[2].bias, frozen_before)


def test_padding_mask_source_is_applied():
    model = make_model()
    inputs, targets = make_batch(5)
    padding = torch.tensor([False, True, False, False, True])
    expected = reference_clipped_sum(model, inputs[~padding], targets[~padding], 0.5)
    wrapped = GradSampleModule(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=0.5,
                            loss_reduction="sum", padding_mask_source=lambda: padding)  # fmt: skip
    connect_private(wrapped, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    backward(wrapped, inputs, targets, reduction="sum")
    optimizer.step()
    for param, start, total in zip(model.parameters(), before, expected):
        torch.testing.assert_close(start - param.detach(), total, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"noise_multiplier": -1.0}, ValueError, "noise_multiplier"),
        ({"noise_multiplier": math.nan}, ValueError, "noise_multiplier"),
        ({"max_grad_norm": math.inf}, ValueError, "max_grad_norm is inf"),
        ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
        ({"expected_batch_size": None}, ValueError, "expected_batch_size"),
        ({"expected_batch_size": 0}, ValueError, "expected_batch_size"),
        ({"loss_reduction": "none"}, ValueError, "loss_reduction"),
        ({"accountant": make_accountant("pld")}, ValueError, "sample_rate"),
        ({"accountant": make_accountant("pld"), "sample_rate": 1.5}, ValueError, "sample_rate"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, error, match):
    model = make_model()
    arguments = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "expected_batch_size": 4, **kwargs}
    with pytest.raises(error, match=match):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **arguments)


def test_lbfgs_and_double_wrapping_are_refused():
    model = make_model()
    with pytest.raises(TypeError, match="LBFGS"):
        DPOptimizer(torch.optim.LBFGS(model.parameters()), noise_multiplier=1.0, max_grad_norm=1.0,
                    expected_batch_size=1)  # fmt: skip
    once = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                       expected_batch_size=1)  # fmt: skip
    with pytest.raises(TypeError, match="already"):
        DPOptimizer(once, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=1)


@pytest.mark.cuda
def test_noise_is_added_on_the_parameters_device():
    model = make_model(dtype=torch.float32).cuda()
    wrapped = GradSampleModule(model)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
                            expected_batch_size=4, noise_seed=0)  # fmt: skip
    connect_private(wrapped, optimizer)
    inputs, targets = make_batch(4, dtype=torch.float32)
    backward(wrapped, inputs.cuda(), targets.cuda())
    optimizer.step()
    assert all(p.grad.is_cuda for p in model.parameters())


# ---------------------------------------------------------------------------- virtual steps
def test_virtual_steps_equal_one_big_batch():
    inputs, targets = make_batch(23, seed=5)
    dataset = TensorDataset(inputs, targets)

    def run(max_physical_batch_size):
        model = make_model()
        wrapped = GradSampleModule(model)
        accountant = make_accountant("rdp")
        loader = DPDataLoader.from_data_loader(DataLoader(dataset, batch_size=10),
                                               generator=torch.Generator().manual_seed(0))  # fmt: skip
        optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), noise_multiplier=0.8,
                                max_grad_norm=0.3, expected_batch_size=10, noise_seed=4, accountant=accountant,
                                sample_rate=loader.sample_rate)  # fmt: skip
        connect_private(wrapped, optimizer)
        physical_sizes = []
        with VirtualSteps(data_loader=loader, max_physical_batch_size=max_physical_batch_size,
                          optimizer=optimizer) as batches:  # fmt: skip
            for x, y in batches:
                physical_sizes.append(len(x))
                optimizer.zero_grad()
                backward(wrapped, x, y)
                optimizer.step()
        return [p.detach() for p in model.parameters()], accountant.steps, physical_sizes

    big, big_steps, big_sizes = run(1000)
    small, small_steps, small_sizes = run(3)
    assert big_steps == small_steps == 2  # round(1 / q) logical steps per epoch
    assert max(small_sizes) <= 3 and len(small_sizes) > len(big_sizes)
    assert sum(small_sizes) == sum(big_sizes)
    for a, b in zip(big, small):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_virtual_steps_hand_the_sliced_padding_mask_to_the_optimizer():
    inputs, targets = make_batch(8, seed=3)
    padding = torch.tensor([False, True, False, False, True, True, False, False])

    class PaddedLoader(list):
        padding_mask = padding

    model = make_model()
    expected = reference_clipped_sum(model, inputs[~padding], targets[~padding], 0.5)
    wrapped = GradSampleModule(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=0.5,
                            loss_reduction="sum")  # fmt: skip
    connect_private(wrapped, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in VirtualSteps(data_loader=PaddedLoader([(inputs, targets)]), max_physical_batch_size=3,
                             optimizer=optimizer):  # fmt: skip
        optimizer.zero_grad()
        backward(wrapped, x, y, reduction="sum")
        optimizer.step()
    assert optimizer.padding_mask_source is None  # restored
    for param, start, total in zip(model.parameters(), before, expected):
        torch.testing.assert_close(start - param.detach(), total, rtol=1e-10, atol=1e-12)


def test_leaving_mid_logical_batch_discards_its_partial_sum():
    model = make_model()
    wrapped = GradSampleModule(model)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
                            expected_batch_size=6)  # fmt: skip
    connect_private(wrapped, optimizer)
    batches = iter(VirtualSteps(data_loader=[make_batch(6)], max_physical_batch_size=2, optimizer=optimizer))
    x, y = next(batches)  # the first of three micro-batches
    backward(wrapped, x, y)
    optimizer.step()
    assert optimizer.clipper.has_accumulated
    with pytest.warns(UserWarning, match="discarded"):
        batches.close()  # what leaving a for loop does
    assert not optimizer.clipper.has_accumulated and not optimizer._skip_next_step


def test_split_batch_handles_nested_batches_and_empty_ones():
    batch = {"x": torch.arange(5), "pair": (torch.zeros(5, 2), ["a", "b", "c", "d", "e"])}
    pieces = split_batch(batch, 2)
    assert [(s, e) for s, e, _ in pieces] == [(0, 2), (2, 4), (4, 5)]
    assert pieces[1][2]["pair"][1] == ["c", "d"] and torch.equal(pieces[2][2]["x"], torch.tensor([4]))
    assert [(s, e) for s, e, _ in split_batch((torch.zeros(0, 3), torch.zeros(0)), 4)] == [(0, 0)]
    with pytest.raises(ValueError, match="max_physical_batch_size"):
        BatchMemoryManager(data_loader=[], max_physical_batch_size=0, optimizer=DPOptimizer(
            torch.optim.SGD(make_model().parameters(), lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
            expected_batch_size=1))  # fmt: skip


def test_a_failed_noise_draw_leaves_no_un_noised_gradient_behind():
    param = nn.Parameter(torch.zeros(4))
    noise = BandMFNoise([1.0, 0.5], seed=0, column_normalize_for_steps=1)  # refuses a second step
    optimizer = DPOptimizer(torch.optim.SGD([param], lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
                            expected_batch_size=1, noise=noise)  # fmt: skip
    optimizer.step()
    param.grad_sample = torch.ones(1, 4)
    with pytest.raises(RuntimeError, match="column_normalize_for_steps"):
        optimizer.step()
    assert param.grad is None
