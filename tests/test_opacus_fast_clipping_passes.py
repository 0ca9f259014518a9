"""Opacus-style loops on the fast-clipping wrapper (``grad_sample_mode="ghost"`` in ``privacy_engine.opacus``):
a backward run with the hooks disabled through a forward run with them enabled, and the count of accumulated
passes (``accumulated_iterations``) that Opacus's accountant hook reads.

The loop contract: such a backward was never clipped, so the next ``step()`` refuses before anything is released
or recorded (parameters and accountant unchanged) instead of releasing the step without that batch; Opacus's
two-pass pattern (its second backward with the hooks disabled) and a later backward with the hooks enabled
through the same forward still release the clipped sum, checked against a float64 per-example loop.
"""

from __future__ import annotations

import copy
import math

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine.opacus import GradSampleModuleFastGradientClipping, PrivacyEngine
from privacy_engine.opacus.accountants import PRV_VALUE_DISCRETIZATION_INTERVAL, PRVAccountant
from privacy_engine.opacus.optimizers import DPOptimizerFastGradientClipping
from tests.conftest import per_example_reference
from tests.test_opacus_last_gaps import example_losses, small_model  # the same model and losses


def data(n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(n, 3, dtype=torch.float64, generator=generator)  # large enough that most examples clip
    return x, torch.randint(0, 2, (n,), generator=generator)


def clipped_sums(model: nn.Module, x: torch.Tensor, y: torch.Tensor, max_grad_norm: float) -> dict[str, torch.Tensor]:
    """Float64 reference: sum over the examples of their gradients clipped to ``max_grad_norm`` in total norm."""
    rows = per_example_reference(model, [x], lambda out, i: example_losses(out, y[i : i + 1]).sum())
    norms = torch.sqrt(sum(r.flatten(1).pow(2).sum(1) for r in rows.values()))
    factors = torch.clamp(max_grad_norm / norms, max=1.0)
    assert (factors < 1).any()  # the bound is active: a release without clipping would differ
    return {name: torch.einsum("b,b...->...", factors, r) for name, r in rows.items()}


def make_private_ghost(*, noise_multiplier: float = 0.0, poisson_sampling: bool = False, n: int = 40,
                       batch_size: int = 5, max_grad_norm: float = 0.5, accountant: str = "rdp"):  # fmt: skip
    torch.manual_seed(11)
    model = small_model()
    unwrapped = copy.deepcopy(model)
    x, y = data(n, seed=7)
    engine = PrivacyEngine(accountant=accountant)
    private_model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size), noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm, poisson_sampling=poisson_sampling, loss_reduction="sum",
        grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss(reduction="sum"),
    )  # fmt: skip
    return engine, unwrapped, private_model, optimizer, criterion, loader


def parameters_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_updated_by(model: nn.Module, before: list[torch.Tensor], sums: dict[str, torch.Tensor]) -> None:
    # lr = 1, loss_reduction="sum", no noise: the update is minus the clipped sum.
    for start, (name, param) in zip(before, model._module.named_parameters()):
        torch.testing.assert_close(param.detach(), start - sums[name], rtol=1e-9, atol=1e-12)


@pytest.mark.filterwarnings("ignore:poisson_sampling=False")
def test_backward_with_hooks_disabled_through_a_hooked_forward_is_refused_at_step_and_the_batch_can_be_rerun():
    engine, unwrapped, model, optimizer, criterion, loader = make_private_ghost()
    x, y = next(iter(loader))
    before = parameters_of(model)
    output = model(x)  # hooks enabled: this forward is to be clipped in its backward
    model.disable_hooks()
    criterion(output, y).backward()  # ... but its only backward runs with the hooks disabled
    model.enable_hooks()
    with pytest.raises(RuntimeError, match=r"hooks disabled.*'0' \(Linear\).*Nothing was released or counted"):
        optimizer.step()
    with pytest.raises(RuntimeError, match="hooks disabled"):  # still refused: nothing changed in between
        optimizer.step()
    assert engine.accountant.steps == 0 and optimizer.steps_taken == 0
    for start, param in zip(before, model.parameters()):
        assert torch.equal(param.detach(), start)
    # The documented way out: drop the open step, run the batch again with the hooks enabled.
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    assert optimizer.accumulated_iterations == 1
    optimizer.step()
    assert engine.accountant.steps == 1
    assert_updated_by(model, before, clipped_sums(unwrapped, x, y, 0.5))


@pytest.mark.filterwarnings("ignore:poisson_sampling=False")
def test_accumulated_batch_backpropagated_with_hooks_disabled_refuses_the_whole_release():
    # Batch 1 clipped as usual, batch 2's backward with the hooks disabled: releasing batch 1 alone would drop
    # batch 2 silently (before: a release of batch 1, counted as one step). Refused; nothing changes.
    engine, _, model, optimizer, criterion, loader = make_private_ghost()
    batches = iter(loader)
    before = parameters_of(model)
    x1, y1 = next(batches)
    criterion(model(x1), y1).backward()
    x2, y2 = next(batches)
    output = model(x2)
    model.disable_hooks()
    criterion(output, y2).backward()
    model.enable_hooks()
    assert optimizer.accumulated_iterations == 1  # the pass with the hooks disabled is not counted
    with pytest.raises(RuntimeError, match="hooks disabled"):
        optimizer.step()
    assert engine.accountant.steps == 0 and optimizer.steps_taken == 0
    for start, param in zip(before, model.parameters()):
        assert torch.equal(param.detach(), start)
        assert param.grad is None  # the clipped sum of batch 1 is not left in .grad either


def hand_built_pipeline(model):
    """Opacus's hand-built pipeline: the fast-clipping wrapper (C = 0.5, sum reduction) and its optimizer (noise
    off, lr 1, expected batch 6)."""
    wrapper = GradSampleModuleFastGradientClipping(model, max_grad_norm=0.5, loss_reduction="sum")
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(wrapper.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=0.5,
        expected_batch_size=6, loss_reduction="sum",
    )  # fmt: skip
    return wrapper, optimizer


def test_backward_with_hooks_enabled_after_one_with_them_disabled_clips_the_forward_and_steps():
    # Hand-built pieces (Opacus's hand-built pipeline): the same forward backpropagated first with the hooks
    # disabled, then with them enabled; the second clips it, so the step releases its clipped sum once.
    torch.manual_seed(12)
    model = small_model()
    unwrapped = copy.deepcopy(model)
    wrapper, optimizer = hand_built_pipeline(model)
    assert wrapper.bound_optimizer is optimizer
    x, y = data(6, seed=3)
    before = parameters_of(wrapper)
    loss = example_losses(wrapper(x), y).sum()
    wrapper.disable_hooks()
    loss.backward(retain_graph=True)
    # The note of the unclipped calls (weak references) belongs to the training run: never pickled.
    assert wrapper.__dict__["_unclipped_calls"] and "_unclipped_calls" not in wrapper.__getstate__()
    wrapper.enable_hooks()
    loss.backward()
    assert optimizer.accumulated_iterations == 1
    optimizer.step()
    assert_updated_by(wrapper, before, clipped_sums(unwrapped, x, y, 0.5))


def test_opacus_two_pass_pattern_counts_one_pass_and_releases_the_clipped_sum_once():
    torch.manual_seed(13)
    model = small_model()
    unwrapped = copy.deepcopy(model)
    wrapper, optimizer = hand_built_pipeline(model)
    x, y = data(6, seed=4)
    before = parameters_of(wrapper)
    losses = example_losses(wrapper(x), y)
    losses.sum().backward(retain_graph=True)
    coefficients = wrapper.get_clipping_coef()
    wrapper.disable_hooks()
    (coefficients * losses).sum().backward()
    wrapper.enable_hooks()
    assert optimizer.accumulated_iterations == 1
    optimizer.step()
    assert_updated_by(wrapper, before, clipped_sums(unwrapped, x, y, 0.5))


def test_wrapper_used_alone_notes_nothing_for_a_backward_with_hooks_disabled():
    wrapper = GradSampleModuleFastGradientClipping(small_model(), max_grad_norm=0.5, loss_reduction="sum")
    x, y = data(4, seed=5)
    output = wrapper(x)
    wrapper.disable_hooks()
    example_losses(output, y).sum().backward()
    assert not wrapper.__dict__.get("_unclipped_calls")  # no optimizer: nothing is ever released from it


@pytest.mark.filterwarnings("ignore:poisson_sampling=False")
def test_fast_clipping_passes_are_counted_released_once_and_accounted_as_the_engine_records_them():
    # 4 of the loader's 8 fixed-size batches accumulated in one step: accumulated_iterations 1, ..., 4; one
    # release; the engine records one draw at rate 4/8, and so does Opacus's accountant hook given one batch's
    # rate (before: it read accumulated_iterations = 1 and recorded rate 1/8, under-reporting epsilon).
    engine, _, model, optimizer, criterion, loader = make_private_ghost(noise_multiplier=1.1)
    hook_accountant = PRVAccountant()
    optimizer.attach_step_hook(hook_accountant.get_optimizer_hook_fn(sample_rate=1 / len(loader)))
    batches = []
    for count, (x, y) in enumerate(loader, start=1):
        criterion(model(x), y).backward()
        batches.append((x, y))
        assert optimizer.accumulated_iterations == count
        if count == 4:
            break
    optimizer.step()
    assert optimizer.accumulated_iterations == 4  # read after the step: the batches of the last release
    (entry,) = engine.accountant.history
    assert (entry.num_steps, entry.sample_rate, entry.batches_per_step) == (1, 0.5, 1)
    (hooked,) = hook_accountant.history
    assert (hooked.num_steps, hooked.sample_rate, hooked.batches_per_step) == (1, 0.5, 1)
    event = dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.1))
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=PRV_VALUE_DISCRETIZATION_INTERVAL)
    pld.compose(event)
    assert math.isclose(hook_accountant.get_epsilon(1e-5), pld.get_epsilon(1e-5), rel_tol=1e-9)
    optimizer.zero_grad()
    assert optimizer.accumulated_iterations == 4  # nothing waits: the last release's count
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    assert optimizer.accumulated_iterations == 1  # the count restarts with the next step's passes


@pytest.mark.filterwarnings("ignore:poisson_sampling=False")
def test_fast_clipping_accumulated_release_is_the_clipped_sum_of_the_batches():
    engine, unwrapped, model, optimizer, criterion, loader = make_private_ghost()
    before = parameters_of(model)
    batches = []
    for count, (x, y) in enumerate(loader, start=1):
        criterion(model(x), y).backward()
        batches.append((x, y))
        if count == 2:
            break
    optimizer.step()
    x_all, y_all = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert_updated_by(model, before, clipped_sums(unwrapped, x_all, y_all, 0.5))
    assert engine.accountant.steps == 1


def test_poisson_draws_accumulated_with_fast_clipping_are_counted_as_the_engine_records_them():
    engine, _, model, optimizer, criterion, loader = make_private_ghost(noise_multiplier=1.0, poisson_sampling=True,
                                                                        n=64, batch_size=16, accountant="prv")  # fmt: skip
    hook_accountant = PRVAccountant()
    optimizer.attach_step_hook(hook_accountant.get_optimizer_hook_fn(sample_rate=loader.sample_rate))
    draws = iter(loader)
    for count in (1, 2):
        x, y = next(draws)
        criterion(model(x), y).backward()
        assert optimizer.accumulated_iterations == count
    optimizer.step()
    (entry,) = engine.accountant.history
    (hooked,) = hook_accountant.history
    assert (entry.num_steps, entry.sample_rate, entry.batches_per_step) == (1, 0.25, 2)
    assert (hooked.num_steps, hooked.sample_rate, hooked.batches_per_step) == (1, 0.25, 2)
