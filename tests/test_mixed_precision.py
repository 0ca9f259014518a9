"""Mixed precision: torch.autocast (bf16, fp16) and models held in bf16.

What is promised: the first-backward check accepts every step whose per-sample gradients are right at
the precision the step computes in (its tolerance follows the compute dtype), and still rejects a
parameter used outside its module; the per-sample gradients are as accurate as the plain
mixed-precision gradient of each example (errors measured against a float64 per-example loop); norms
and clipped sums are accumulated in float32 at least.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import per_example_reference
from torch import nn

from privacy_engine import GhostClippingModule, GradSampleModule, ParameterUsageError, PerSampleGradientClipper

HALF = [torch.bfloat16, torch.float16]


def _groupnorm_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip


def _batch(batch_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, 3, 8, 8, generator=generator), torch.randint(0, 10, (batch_size,), generator=generator)


def _loss(model, x, y, dtype):
    with torch.autocast("cpu", dtype=dtype):
        return nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch_size", [1, 2, 3, 5, 8, 16, 32])
def test_autocast_check_accepts_groupnorm_cnn(dtype: torch.dtype, batch_size: int) -> None:
    torch.manual_seed(batch_size)
    model = GradSampleModule(_groupnorm_cnn())
    x, y = _batch(batch_size, batch_size)
    _loss(model, x, y, dtype).backward()  # raised ParameterUsageError at every batch size with bf16
    assert model._check_state == "done"


@pytest.mark.parametrize("batch_size", [1, 2, 3, 5, 8])
def test_autocast_check_accepts_llama(batch_size: int) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(batch_size)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    model = GradSampleModule(transformers.LlamaForCausalLM(config))
    ids = torch.randint(1, 64, (batch_size, 16), generator=torch.Generator().manual_seed(batch_size))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert model._check_state == "done"


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_autocast_still_rejects_a_parameter_used_outside_its_module(dtype: torch.dtype) -> None:
    cnn = _groupnorm_cnn()
    model = GradSampleModule(cnn)
    x, y = _batch(8, 0)
    loss = _loss(model, x, y, dtype) + cnn[8].weight.pow(2).sum()  # an L2 penalty read from the weight
    with pytest.raises(ParameterUsageError, match="'8.weight'"):
        loss.backward()


def _errors(model: nn.Module, x, y, dtype) -> tuple[dict, dict]:
    """Per parameter: the per-sample gradients' error and the plain per-example mixed-precision
    gradients' error, each the Frobenius norm over all examples, against float64."""
    exact = per_example_reference(
        copy.deepcopy(model).double(), [x.double()], lambda out, i: nn.functional.cross_entropy(out, y[i : i + 1])
    )
    plain: dict[str, list[torch.Tensor]] = {name: [] for name, _ in model.named_parameters()}
    for i in range(len(x)):
        model.zero_grad()
        _loss(model, x[i : i + 1], y[i : i + 1], dtype).backward()
        for name, param in model.named_parameters():
            plain[name].append(param.grad.double())
    model.zero_grad()
    wrapped = GradSampleModule(model)
    _loss(wrapped, x, y, dtype).backward()
    per_sample_error = {n: float((p.grad_sample.double() - exact[n]).norm()) for n, p in model.named_parameters()}
    plain_error = {n: float((torch.stack(plain[n]) - exact[n]).norm()) for n in plain}
    scale = {n: float(exact[n].norm()) for n in exact}
    return per_sample_error, plain_error, scale


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_autocast_per_sample_gradients_within_plain_mixed_precision_error(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = _groupnorm_cnn()
    x, y = _batch(8, 1)
    per_sample_error, plain_error, scale = _errors(model, x, y, dtype)
    for name in per_sample_error:
        assert per_sample_error[name] <= 2 * plain_error[name] + 1e-3 * scale[name], name
        assert per_sample_error[name] <= 0.5 * scale[name], name  # and the comparison is not vacuous


def test_model_held_in_bf16() -> None:
    torch.manual_seed(0)
    model = _groupnorm_cnn().to(torch.bfloat16)
    x, y = _batch(8, 2)
    exact = per_example_reference(
        copy.deepcopy(model).double(), [x.double()], lambda out, i: nn.functional.cross_entropy(out, y[i : i + 1])
    )
    plain = {name: [] for name, _ in model.named_parameters()}
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1].bfloat16()).float(), y[i : i + 1]).backward()
        for name, param in model.named_parameters():
            plain[name].append(param.grad.double())
    model.zero_grad()
    wrapped = GradSampleModule(model)
    nn.functional.cross_entropy(wrapped(x.bfloat16()).float(), y).backward()  # no false ParameterUsageError
    for name, param in model.named_parameters():
        assert param.grad_sample.dtype == torch.bfloat16
        error = float((param.grad_sample.double() - exact[name]).norm())
        plain_error = float((torch.stack(plain[name]) - exact[name]).norm())
        assert error <= 2 * plain_error + 1e-3 * float(exact[name].norm()), name


def test_clipped_sum_of_half_precision_per_sample_gradients_accumulates_in_float32() -> None:
    """bf16 per-sample gradients (autocast) are summed in float32: the clipped sum is exact to float32
    rounding of the bf16 values, not to bf16 rounding of the batch's sum."""
    torch.manual_seed(0)
    model = _groupnorm_cnn()
    wrapped = GradSampleModule(model)
    x, y = _batch(64, 3)
    _loss(wrapped, x, y, torch.bfloat16).backward()
    params = list(model.parameters())
    grad_samples = [p.grad_sample.double() for p in params]
    assert model[3].weight.grad_sample.dtype == torch.bfloat16
    clipper = PerSampleGradientClipper(params, max_grad_norm=1e-3)
    clipper.clip_and_accumulate()
    clipper.pre_step()
    norms = torch.cat([g.flatten(1) for g in grad_samples], dim=1).norm(dim=1)
    factors = (1e-3 / norms).clamp(max=1.0)
    for param, grads in zip(params, grad_samples):
        expected = torch.einsum("b,b...->...", factors, grads)
        assert param.grad.dtype == torch.float32
        torch.testing.assert_close(param.grad.double(), expected, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_ghost_clipping_under_autocast(dtype: torch.dtype) -> None:
    """Norms and clipped sums within the mixed-precision error of the plain per-example gradients."""
    torch.manual_seed(0)
    model = _groupnorm_cnn()
    x, y = _batch(8, 4)
    exact = per_example_reference(
        copy.deepcopy(model).double(), [x.double()], lambda out, i: nn.functional.cross_entropy(out, y[i : i + 1])
    )
    plain = []
    for i in range(len(x)):
        model.zero_grad()
        _loss(model, x[i : i + 1], y[i : i + 1], dtype).backward()
        plain.append(torch.cat([p.grad.double().flatten() for p in model.parameters()]))
    model.zero_grad()
    exact_flat = torch.cat([g.flatten(1) for g in exact.values()], dim=1)
    plain_errors = (torch.stack(plain) - exact_flat).norm(dim=1)  # each example's own mixed-precision error
    exact_norms = exact_flat.norm(dim=1)
    bound = float(exact_norms.median())
    params = list(model.parameters())
    clipper = PerSampleGradientClipper(params, max_grad_norm=bound)
    wrapped = GhostClippingModule(model, clipper=clipper)
    _loss(wrapped, x, y, dtype).backward()
    norms = wrapped.last_per_sample_norms.flatten()
    assert norms.dtype == torch.float32
    assert bool(((norms.double() - exact_norms).abs() <= 2 * plain_errors + 1e-6).all())
    clipper.pre_step()
    clipped = torch.cat([p.grad.double().flatten() for p in params])
    assert all(p.grad.dtype == torch.float32 for p in params)
    factors = (bound / exact_norms).clamp(max=1.0)
    expected = factors @ exact_flat
    # Each example's clipped contribution is off by at most its factor times twice its own error
    # (and by the change of factor a norm error causes, bounded by the same amount).
    allowed = float(2 * (2 * factors * plain_errors).sum()) + 1e-6
    assert float((clipped - expected).norm()) <= allowed
    assert allowed < 0.5 * float(expected.norm())  # not vacuous


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_ghost_clipped_contribution_within_bound_under_autocast(dtype: torch.dtype) -> None:
    """One example per batch, clipped hard: its whole contribution must have norm <= the bound, which
    needs its norm and its weighted sum in float32 (bf16 rounding alone moves either by 2^-9)."""
    torch.manual_seed(0)
    model = _groupnorm_cnn()
    params = list(model.parameters())
    clipper = PerSampleGradientClipper(params, max_grad_norm=1e-3)
    wrapped = GhostClippingModule(model, clipper=clipper)
    x, y = _batch(16, 5)
    for i in range(len(x)):
        _loss(wrapped, x[i : i + 1], y[i : i + 1], dtype).backward()
        clipper.pre_step()
        contribution = torch.cat([p.grad.double().flatten() for p in params]).norm()
        assert float(contribution) <= 1e-3 * (1 + 1e-5), i
