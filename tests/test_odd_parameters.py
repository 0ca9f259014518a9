"""Parameters that are not a layer's weight matrix: 0-dim learned scales, gradients that cancel exactly,
custom autograd Functions."""

from __future__ import annotations

import pytest
import torch
from conftest import ATOL, RTOL, assert_matches_reference, per_example_reference
from torch import nn

from privacy_engine import (
    GhostClippingModule,
    GradSampleModule,
    ParameterUsageError,
    PerSampleGradientClipper,
    UnsupportedModuleError,
)


# ---------------------------------------------------------------------------------- 0-dim parameters
class Tempered(nn.Module):
    """A linear map divided by a learned temperature (a 0-dim parameter, as in CLIP)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.temperature = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) / self.temperature


class ScaledRoot(nn.Module):
    """The model itself owns a 0-dim scale and a 0-dim shift."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), Tempered())
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.shift = nn.Parameter(torch.tensor(-0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale + self.shift


def _zero_dim_models():
    return [nn.Sequential(nn.Linear(5, 4), nn.Tanh(), Tempered()), ScaledRoot()]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).sum(dim=1).mean()


@pytest.mark.parametrize("model_index", [0, 1], ids=["in-submodule", "at-root"])
def test_zero_dim_parameter_per_sample_gradients_exact(model_index: int) -> None:
    torch.manual_seed(0)
    model = _zero_dim_models()[model_index].double()
    x, target = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    reference = per_example_reference(model, [x], lambda out, i: _loss(out, target[i : i + 1]))
    wrapped = GradSampleModule(model)
    _loss(wrapped(x), target).backward()  # raised IndexError in the first-backward check
    assert_matches_reference(model, reference)
    temperature = dict(model.named_parameters())[next(n for n, p in model.named_parameters() if p.dim() == 0)]
    assert temperature.grad_sample.shape == (6,)


@pytest.mark.parametrize("model_index", [0, 1], ids=["in-submodule", "at-root"])
def test_zero_dim_parameter_clipped(model_index: int) -> None:
    torch.manual_seed(0)
    model = _zero_dim_models()[model_index].double()
    x, target = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    reference = per_example_reference(model, [x], lambda out, i: _loss(out, target[i : i + 1]))
    norms = torch.cat([g.reshape(6, -1) for g in reference.values()], dim=1).norm(dim=1)
    bound = float(norms.median())
    factors = (bound / norms).clamp(max=1.0)
    expected = {name: torch.einsum("b,b...->...", factors, g) for name, g in reference.items()}

    params = list(model.parameters())
    clipper = PerSampleGradientClipper(params, max_grad_norm=bound)
    wrapped = GradSampleModule(model)
    _loss(wrapped(x), target).backward()
    clipper.clip_and_accumulate()
    clipper.pre_step()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=RTOL, atol=ATOL)

    wrapped.to_standard_module()
    for param in params:
        param.grad = None
    clipper = PerSampleGradientClipper(params, max_grad_norm=bound)
    ghost = GhostClippingModule(model, clipper=clipper)
    _loss(ghost(x), target).backward()
    clipper.pre_step()
    torch.testing.assert_close(ghost.last_per_sample_norms.flatten(), norms, rtol=RTOL, atol=ATOL)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_zero_dim_parameter_trains_under_dp(mode: str) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from privacy_engine import PrivacyEngine

    torch.manual_seed(0)
    model = ScaledRoot()
    data = TensorDataset(torch.randn(64, 5), torch.randn(64, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    private_model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=16), noise_multiplier=1.0,
        max_grad_norm=1.0, grad_sample_mode=mode,
    )
    scale_before = float(model.scale.detach())
    for x, target in loader:
        optimizer.zero_grad()
        _loss(private_model(x), target).backward()
        optimizer.step()
    assert float(model.scale.detach()) != scale_before


# ---------------------------------------------------------------------------------- exact cancellation
def _conv_instance_norm() -> nn.Module:
    # The conv bias adds a constant per channel over time; InstanceNorm subtracts each channel's mean
    # over time, so the bias's exact gradient is 0 and what is computed is rounding.
    return nn.Sequential(
        nn.Conv1d(4, 8, 3), nn.InstanceNorm1d(8, affine=True), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14, 3)
    )


@pytest.mark.parametrize("seed", range(6))
def test_conv_bias_before_instance_norm_is_not_a_false_positive(seed: int) -> None:
    torch.manual_seed(seed)
    model = _conv_instance_norm()
    wrapped = GradSampleModule(model)
    wrapped(torch.randn(16, 4, 16)).mean().backward()  # raised ParameterUsageError for every seed
    assert wrapped._check_state == "done"
    assert float(model[0].bias.grad_sample.abs().max()) < 1e-5


def test_conv_bias_before_instance_norm_exact() -> None:
    torch.manual_seed(0)
    model = _conv_instance_norm().double()
    x = torch.randn(5, 4, 16, dtype=torch.float64)
    reference = per_example_reference(model, [x], lambda out, i: out.mean())
    wrapped = GradSampleModule(model)
    wrapped(x).mean().backward()
    assert_matches_reference(model, reference)


def test_conv_bias_used_outside_its_module_is_still_caught() -> None:
    torch.manual_seed(0)
    model = _conv_instance_norm()
    wrapped = GradSampleModule(model)
    loss = wrapped(torch.randn(16, 4, 16)).mean() + 1e-3 * model[0].bias.sum()
    with pytest.raises(ParameterUsageError, match="'0.bias'"):
        loss.backward()


# ---------------------------------------------------------------------------------- custom autograd.Function
class _OldStyleMultiply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad * weight, (grad * x).sum(0)


class _NoVmapMultiply(torch.autograd.Function):
    @staticmethod
    def forward(x, weight):
        return x * weight

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad * weight, (grad * x).sum_to_size(weight.shape)


class _VmapMultiply(_NoVmapMultiply):
    generate_vmap_rule = True


class FunctionScale(nn.Module):
    def __init__(self, function) -> None:
        super().__init__()
        self.function = function
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return self.function.apply(x, self.weight)


@pytest.mark.parametrize("function", [_OldStyleMultiply, _NoVmapMultiply], ids=["no-setup-context", "no-vmap"])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_custom_function_without_vmap_support_is_named(function, mode: str) -> None:
    model = nn.Sequential(nn.Linear(3, 3), FunctionScale(function))
    clipper = PerSampleGradientClipper(list(model.parameters()), max_grad_norm=1.0)
    wrapped = GhostClippingModule(model, clipper=clipper) if mode == "ghost" else GradSampleModule(model)
    with pytest.raises(UnsupportedModuleError, match=r"'1' \(FunctionScale\).*autograd\.Function.*setup_context"):
        wrapped(torch.randn(4, 3))


def test_custom_function_with_vmap_support_is_exact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), FunctionScale(_VmapMultiply)).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    reference = per_example_reference(model, [x], lambda out, i: out.pow(2).sum())
    wrapped = GradSampleModule(model, loss_reduction="sum")
    wrapped(x).pow(2).sum().backward()
    assert_matches_reference(model, reference)


NORMS_AFTER_A_LAYER = {
    "layernorm": lambda: nn.Sequential(nn.Linear(3, 8), nn.LayerNorm(8)),
    "rmsnorm": lambda: nn.Sequential(nn.Linear(3, 8), nn.RMSNorm(8)),
    "groupnorm": lambda: nn.Sequential(nn.Conv1d(2, 4, 3), nn.GroupNorm(2, 4)),
    "instancenorm": lambda: nn.Sequential(nn.Conv1d(2, 4, 3), nn.InstanceNorm1d(4, affine=True)),
}


@pytest.mark.parametrize("kind", sorted(NORMS_AFTER_A_LAYER))
@pytest.mark.parametrize("seed", range(4))
def test_a_normalisation_weight_whose_gradient_cancels_is_not_a_usage_error(kind, seed):
    # A sum loss right after a normalisation: sum(G * x_hat) over the normalised axis is exactly 0, so the
    # computed gradient is pure float32 rounding; the check must size its tolerance by sum |G * x_hat|.
    torch.manual_seed(seed)
    model = NORMS_AFTER_A_LAYER[kind]()
    x = torch.randn(5, 3) if kind in ("layernorm", "rmsnorm") else torch.randn(5, 2, 6)
    GradSampleModule(model)(x).sum().backward()
    # ... while a second use of the same weight is still caught
    model = NORMS_AFTER_A_LAYER[kind]()
    with pytest.raises(ParameterUsageError, match="'1.weight'"):
        (GradSampleModule(model)(x).square().sum() + model[1].weight.sum()).backward()
