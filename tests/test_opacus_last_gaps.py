"""The last gaps Opacus's own test suite showed in ``privacy_engine.opacus`` (issue 26): the fast-clipping
wrapper's hooks switch, Opacus's two-pass pattern and hand-built pieces; ``p.grad_sample`` as one tensor per
forward on a wrapper used alone; batches accumulated without a step (``grad_samples``,
``accumulated_iterations``) and how they are accounted; the noise a custom layer's step releases; and a
sequence-first embedding under attention and LSTM. Every per-sample gradient is checked against a float64
per-example loop, every epsilon against dp-accounting on the same event.
"""

from __future__ import annotations

import copy
import math

import dp_accounting
import pytest
import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine.opacus import GradSampleModule, GradSampleModuleFastGradientClipping, PrivacyEngine
from privacy_engine.opacus.accountants import PRV_VALUE_DISCRETIZATION_INTERVAL, PRVAccountant
from privacy_engine.opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from privacy_engine.opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from tests.conftest import per_example_reference


class Scale(nn.Module):
    """A layer with no registered sampler: its per-sample gradients come from the torch.func fallback."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), Scale(4), nn.Linear(4, 2)).double()


def example_losses(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(output, target, reduction="none")


def clipped_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, max_grad_norm: float):
    """Float64 reference: per-example gradients (loop), their total norms, the clip factors and the clipped sums."""
    rows = per_example_reference(model, [x], lambda out, i: example_losses(out, y[i : i + 1]).sum())
    norms = torch.sqrt(sum(r.flatten(1).pow(2).sum(1) for r in rows.values()))
    factors = torch.clamp(max_grad_norm / norms, max=1.0)
    sums = {name: torch.einsum("b,b...->...", factors, r) for name, r in rows.items()}
    return norms, factors, sums


def hand_built_fast_clipping(max_grad_norm: float, batch_size: int, loss_reduction: str = "sum"):
    model = small_model()
    unwrapped = copy.deepcopy(model)
    wrapper = GradSampleModuleFastGradientClipping(model, max_grad_norm=max_grad_norm, loss_reduction=loss_reduction)
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(wrapper.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=max_grad_norm,
        expected_batch_size=batch_size, loss_reduction=loss_reduction,
    )  # fmt: skip
    assert wrapper.bound_optimizer is optimizer  # the namespace connects the pair Opacus scripts build
    return unwrapped, wrapper, optimizer


def data(n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, dtype=torch.float64, generator=generator), torch.randint(0, 2, (n,), generator=generator)


def test_fast_clipping_with_hooks_disabled_is_the_plain_model_and_clips_again_when_enabled():
    torch.manual_seed(0)
    unwrapped, wrapper, optimizer = hand_built_fast_clipping(max_grad_norm=0.3, batch_size=6)
    x, y = data(6)
    wrapper.disable_hooks()
    assert not wrapper.hooks_enabled
    example_losses(wrapper(x), y).sum().backward()
    plain = copy.deepcopy(unwrapped)
    example_losses(plain(x), y).sum().backward()
    for param, reference in zip(wrapper._module.parameters(), plain.parameters()):
        torch.testing.assert_close(param.grad, reference.grad, rtol=1e-12, atol=1e-14)
        assert param.grad_sample is None
    assert wrapper.last_per_sample_norms is None and not optimizer.clipper.has_accumulated  # nothing captured
    with pytest.raises(RuntimeError, match="no per-sample"):
        optimizer.step()
    optimizer.zero_grad()
    wrapper.enable_hooks()
    assert wrapper.hooks_enabled
    example_losses(wrapper(x), y).sum().backward()
    norms, _, sums = clipped_sum(unwrapped, x, y, 0.3)
    torch.testing.assert_close(wrapper.get_norm_sample(), norms, rtol=1e-10, atol=1e-12)
    optimizer.step()
    for name, param in wrapper._module.named_parameters():  # loss_reduction="sum": the clipped sum, undivided
        torch.testing.assert_close(param.grad, sums[name], rtol=1e-9, atol=1e-12)


def test_fast_clipping_opacus_two_pass_pattern_releases_the_clipped_mean():
    torch.manual_seed(1)
    unwrapped, wrapper, optimizer = hand_built_fast_clipping(max_grad_norm=0.2, batch_size=5, loss_reduction="mean")
    x, y = data(5, seed=1)
    losses = example_losses(wrapper(x), y)
    losses.mean().backward(retain_graph=True)  # Opacus's first pass: here it already clips
    norms, factors, sums = clipped_sum(unwrapped, x, y, 0.2)
    coefficients = wrapper.get_clipping_coef()
    torch.testing.assert_close(wrapper.get_norm_sample(), norms, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(coefficients, factors, rtol=1e-9, atol=1e-12)
    wrapper.disable_hooks()
    (coefficients * losses).sum().backward()  # Opacus's second pass: captures and adds nothing
    wrapper.enable_hooks()
    optimizer.step()
    for name, param in wrapper._module.named_parameters():
        torch.testing.assert_close(param.grad, sums[name] / 5, rtol=1e-9, atol=1e-12)


def test_fast_clipping_pieces_built_by_hand_update_the_weights_as_the_per_example_loop():
    torch.manual_seed(2)
    unwrapped, wrapper, optimizer = hand_built_fast_clipping(max_grad_norm=0.4, batch_size=7, loss_reduction="mean")
    x, y = data(7, seed=2)
    before = [p.detach().clone() for p in wrapper._module.parameters()]
    criterion = DPLossFastGradientClipping(wrapper, optimizer, nn.CrossEntropyLoss())
    criterion(wrapper(x), y).backward()
    optimizer.step()
    _, _, sums = clipped_sum(unwrapped, x, y, 0.4)
    for start, (name, param) in zip(before, wrapper._module.named_parameters()):
        torch.testing.assert_close(param.detach(), start - sums[name] / 7, rtol=1e-9, atol=1e-12)
        assert param.grad_sample is None  # Opacus's attribute, never filled by fast clipping


def frozen_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[2].requires_grad_(False)
    return model


def test_grad_sample_of_a_wrapper_used_alone_is_one_tensor_per_forward():
    torch.manual_seed(3)
    model = frozen_model()
    reference = copy.deepcopy(model)
    wrapper = GradSampleModule(model, loss_reduction="sum")
    batches = [data(4, seed=s) for s in range(3)]
    x, y = batches[0]
    example_losses(wrapper(x), y).sum().backward()
    trainable = [(name, p) for name, p in wrapper._module.named_parameters() if p.requires_grad]
    assert all(isinstance(p.grad_sample, torch.Tensor) for _, p in trainable)  # one forward: a tensor
    for x, y in batches[1:]:
        example_losses(wrapper(x), y).sum().backward()
    expected = [per_example_reference(reference, [bx], lambda out, i, by=by: example_losses(out, by[i : i + 1]).sum())
                for bx, by in batches]  # fmt: skip
    for name, param in trainable:
        assert isinstance(param.grad_sample, list) and len(param.grad_sample) == 3
        for held, rows in zip(param.grad_sample, expected):
            torch.testing.assert_close(held, rows[name], rtol=1e-10, atol=1e-12)
    assert not any(hasattr(p, "grad_sample") for p in wrapper._module[2].parameters())
    wrapper.zero_grad()
    assert all(p.grad_sample is None for _, p in trainable)
    example_losses(wrapper(x), y).sum().backward()
    assert all(isinstance(p.grad_sample, torch.Tensor) and p.grad_sample.shape[0] == 4 for _, p in trainable)


def test_connected_wrapper_refuses_to_train_over_the_lists_of_earlier_passes():
    torch.manual_seed(4)
    wrapper = GradSampleModule(small_model(), loss_reduction="sum")
    for seed in range(2):
        x, y = data(4, seed=seed)
        example_losses(wrapper(x), y).sum().backward()
    optimizer = DPOptimizer(torch.optim.SGD(wrapper.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                            expected_batch_size=4, loss_reduction="sum")  # fmt: skip
    assert wrapper.bound_optimizer is optimizer
    x, y = data(4, seed=5)
    with pytest.raises(RuntimeError, match="zero_grad"):
        wrapper(x)
    optimizer.zero_grad()
    example_losses(wrapper(x), y).sum().backward()
    assert all(isinstance(p.grad_sample, torch.Tensor) for p in wrapper._module.parameters())


def make_private_fixed_batches(noise_multiplier: float, max_grad_norm: float, n: int = 40, batch_size: int = 5):
    torch.manual_seed(5)
    model = small_model()
    unwrapped = copy.deepcopy(model)
    x, y = data(n, seed=7)
    engine = PrivacyEngine(accountant="rdp")
    private = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size), noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm, poisson_sampling=False, loss_reduction="sum",
    )  # fmt: skip
    return engine, unwrapped, *private


@pytest.mark.filterwarnings("ignore:poisson_sampling=False")
def test_fixed_batches_accumulated_without_step_are_listed_counted_and_released_as_one_step():
    engine, unwrapped, model, optimizer, loader = make_private_fixed_batches(noise_multiplier=0.0, max_grad_norm=0.5)
    batches = []
    for count, (x, y) in enumerate(loader, start=1):
        example_losses(model(x), y).sum().backward()
        batches.append((x, y))
        assert optimizer.accumulated_iterations == count
        if count == 4:
            break
    x_all, y_all = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    rows = per_example_reference(unwrapped, [x_all], lambda out, i: example_losses(out, y_all[i : i + 1]).sum())
    for (name, _), held in zip(model._module.named_parameters(), optimizer.grad_samples):
        torch.testing.assert_close(held, rows[name], rtol=1e-10, atol=1e-12)
    optimizer.step()
    _, _, sums = clipped_sum(unwrapped, x_all, y_all, 0.5)
    for name, param in model._module.named_parameters():  # one release: the 4 batches' clipped sum
        torch.testing.assert_close(param.grad, sums[name], rtol=1e-9, atol=1e-12)
    assert optimizer.accumulated_iterations == 4 and engine.accountant.steps == 1
    optimizer.zero_grad()
    assert all(held is None for held in optimizer.grad_samples)


@pytest.mark.filterwarnings("ignore:poisson_sampling=False")
def test_fixed_batches_accumulated_are_accounted_as_one_draw_at_their_summed_rate():
    # The rule: the release holds 4 of the loader's 8 batches (each example at most once), accounted as one
    # sampled Gaussian step at rate 4/8, as Opacus's hook records sample_rate * accumulated_iterations.
    engine, _, model, optimizer, loader = make_private_fixed_batches(noise_multiplier=1.1, max_grad_norm=1.0)
    hook_accountant = PRVAccountant()
    optimizer.attach_step_hook(hook_accountant.get_optimizer_hook_fn(sample_rate=1 / len(loader)))
    for count, (x, y) in enumerate(loader, start=1):
        example_losses(model(x), y).sum().backward()
        if count == 4:
            break
    optimizer.step()
    (entry,) = engine.accountant.history
    assert (entry.num_steps, entry.sample_rate, entry.batches_per_step) == (1, 0.5, 1)
    reference = dp_accounting.rdp.RdpAccountant()
    reference.compose(dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.1)))
    assert math.isclose(engine.accountant.get_epsilon(1e-5), reference.get_epsilon(1e-5), rel_tol=1e-9)
    # Opacus's hook, given one batch's rate, records the same event (not one batch's rate, nor 4 Poisson draws).
    (hooked,) = hook_accountant.history
    assert (hooked.num_steps, hooked.sample_rate, hooked.batches_per_step) == (1, 0.5, 1)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=PRV_VALUE_DISCRETIZATION_INTERVAL)
    pld.compose(dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.1)))
    assert math.isclose(hook_accountant.get_epsilon(1e-5), pld.get_epsilon(1e-5), rel_tol=1e-9)


def test_custom_layer_step_releases_noise_of_std_sigma_c_over_the_expected_batch_size():
    # Zero gradients: each step's update is -lr * noise / B, noise ~ N(0, (sigma * C)^2) per coordinate. Many
    # coordinates over 8 steps: the sample variance is within 6 standard errors of (lr * sigma * C / B)^2.
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 64), Scale(64), nn.Linear(64, 16))  # 1,424 parameters
    x = torch.randn(400, 4)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, torch.zeros(400)), batch_size=50), noise_multiplier=0.9,
        max_grad_norm=1.5,
    )  # fmt: skip
    updates = []
    for batch, _ in loader:  # 8 steps: 11,392 noise draws
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        out = model(batch)
        out.backward(torch.zeros_like(out))
        optimizer.step()
        updates.append(torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]))
    samples = torch.cat(updates).double()
    expected = (0.5 * 0.9 * 1.5 / 50) ** 2
    standard_error = expected * math.sqrt(2 / samples.numel())
    assert abs(samples.pow(2).mean().item() - expected) < 6 * standard_error
    assert abs(samples.mean().item()) < 6 * math.sqrt(expected / samples.numel())


class SequenceFirstText(nn.Module):
    def __init__(self, body: str, padding_idx: int | None) -> None:
        super().__init__()
        self.embedding = nn.Embedding(13, 6, padding_idx=padding_idx)
        self.body = nn.MultiheadAttention(6, 2) if body == "attention" else nn.LSTM(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens (length, batch)
        hidden = self.embedding(tokens)
        hidden = self.body(hidden, hidden, hidden)[0] if isinstance(self.body, nn.MultiheadAttention) else self.body(hidden)[0]
        return self.head(hidden).mean(0)


@pytest.mark.parametrize(
    ("body", "padding_idx"),
    [("attention", 0), pytest.param("attention", None, marks=pytest.mark.slow),
     pytest.param("lstm", 0, marks=pytest.mark.slow), pytest.param("lstm", None, marks=pytest.mark.slow)],
)  # fmt: skip
def test_sequence_first_embedding_released_gradient_matches_the_per_example_loop(body, padding_idx):
    torch.manual_seed(7)
    model = SequenceFirstText(body, padding_idx).double()
    unwrapped = copy.deepcopy(model)
    tokens = torch.randint(0, 13, (5, 6))  # (length, batch): a small vocabulary hits padding_idx
    labels = torch.randint(0, 3, (6,))
    wrapper = GradSampleModule(model, batch_first=False, loss_reduction="sum")
    functional.cross_entropy(wrapper(tokens), labels, reduction="sum").backward()
    rows = per_example_reference(unwrapped, [tokens], lambda out, i: functional.cross_entropy(out, labels[i : i + 1], reduction="sum"), batch_dim=1)
    for name, param in wrapper._module.named_parameters():
        torch.testing.assert_close(param.grad_sample, rows[name], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(param.grad_sample.sum(0), param.grad, rtol=1e-10, atol=1e-12)
