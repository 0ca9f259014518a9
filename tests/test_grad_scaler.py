"""fp16 loss scaling (``torch.amp.GradScaler``) with the private optimizer, written as the user's loop:
``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``.

What must hold: the scale is divided out before clipping (the release equals the unscaled loop's),
an overflowing example never skips the step nor moves the release by more than C, and the scaler's
next scale depends on nothing but the released gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from privacy_engine import DPOptimizer, GhostClippingModule, GradSampleModule, connect_private

MODES = ("hooks", "ghost")
C = 1.0


def _model(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _private(mode: str, model: nn.Module, *, sigma: float = 0.0, scaler=None, seed: int = 7):
    wrapper = GhostClippingModule if mode == "ghost" else GradSampleModule
    wrapped = wrapper(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=sigma, max_grad_norm=C,
                            loss_reduction="sum", noise_seed=seed)  # fmt: skip
    if mode == "ghost":
        wrapped.attach_clipper(optimizer.clipper)
    connect_private(wrapped, optimizer)
    if scaler is not None:
        optimizer.attach_grad_scaler(scaler)
    return wrapped, optimizer


def _data(batch: int = 5, dtype=torch.float64):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 6, generator=generator, dtype=dtype) * 3
    y = torch.randint(0, 3, (batch,), generator=generator)
    return x, y


def _loss(wrapped, x, y):
    out = wrapped(x)
    out = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
    return nn.functional.cross_entropy(out, y, reduction="sum")


def backward_and_step(loss, optimizer, scaler=None) -> None:
    """The user's backward and step, through ``scaler`` (a ``torch.amp.GradScaler``) when one is given."""
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def _update(model, before):
    return torch.cat([(p.detach() - b).flatten().double() for p, b in zip(model.parameters(), before)])


def _run(mode, x, y, *, scaler=None, sigma=0.0, steps=1, dtype=torch.float64):
    model = _model(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    wrapped, optimizer = _private(mode, model, sigma=sigma, scaler=scaler)
    for _ in range(steps):
        if scaler is None:
            _loss(wrapped, x, y).backward()
            optimizer.step()
        else:
            scaler.scale(_loss(wrapped, x, y)).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
    return _update(model, before), optimizer


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("init_scale", [2.0**10, 3.0 * 2**14])
def test_scaled_loop_releases_what_the_unscaled_loop_releases(mode, init_scale):
    x, y = _data()
    plain, _ = _run(mode, x, y, sigma=1.0, steps=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    scaled, optimizer = _run(mode, x, y, scaler=scaler, sigma=1.0, steps=3)
    torch.testing.assert_close(scaled, plain, rtol=1e-10, atol=1e-12)
    assert optimizer.steps_taken == 3


@pytest.mark.parametrize("mode", MODES)
def test_each_example_is_clipped_at_its_unscaled_size(mode):
    # One example, gradient far above C: the release (noise off) has norm C exactly, whatever the scale.
    x, y = _data(batch=1)
    for init_scale in (1.0, 2.0**16):
        update, _ = _run(mode, x * 50, y, scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))
        assert float(update.norm()) == pytest.approx(C, rel=1e-9)


@pytest.mark.parametrize("mode", MODES)
def test_an_overflowing_example_moves_the_release_by_at_most_c_and_never_skips_the_step(mode):
    # float32 model; the scale makes example 0's scaled gradient overflow (inf/NaN), the others stay finite.
    x, y = _data(batch=4, dtype=torch.float32)
    x[0] = 1e30
    scale = 2.0**100
    with_it, optimizer = _run(mode, x, y, scaler=torch.amp.GradScaler("cpu", init_scale=scale), dtype=torch.float32)
    assert optimizer.steps_taken == 1  # released and counted, not skipped
    assert torch.isfinite(with_it).all()
    without, _ = _run(mode, x[1:], y[1:], scaler=torch.amp.GradScaler("cpu", init_scale=scale), dtype=torch.float32)
    assert float((with_it - without).norm()) <= C * (1 + 1e-5)


def test_the_next_scale_does_not_depend_on_an_overflow_in_the_private_gradients():
    x, y = _data(batch=4, dtype=torch.float32)
    x[0] = 1e30  # overflows at this scale: a non-private GradScaler would back off (and skip the step)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100, growth_interval=1)
    _run("hooks", x, y, scaler=scaler, steps=3, dtype=torch.float32)
    assert scaler.get_scale() == 2.0**100  # neither backed off (private overflow) nor grown
    clean = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    _run("ghost", *_data(batch=4, dtype=torch.float32), scaler=clean, steps=3, dtype=torch.float32)
    assert clean.get_scale() == 2.0**8


@pytest.mark.parametrize("mode", MODES)
def test_unscale_before_step_and_plain_step_divide_the_scale_out_once(mode):
    x, y = _data()
    plain, _ = _run(mode, x, y)
    for explicit_unscale in (True, False):
        model = _model()
        before = [p.detach().clone() for p in model.parameters()]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        wrapped, optimizer = _private(mode, model, scaler=scaler)
        scaler.scale(_loss(wrapped, x, y)).backward()
        if explicit_unscale:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()  # the scaler bypassed: the scale is still known and divided out
        torch.testing.assert_close(_update(model, before), plain, rtol=1e-10, atol=1e-12)


def test_micro_batches_with_a_scaler_release_once_and_keep_the_scale():
    # What VirtualSteps does: skip (clip and accumulate only) at every micro-batch but the last.
    x, y = _data(batch=6)
    plain, _ = _run("hooks", x, y)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    wrapped, optimizer = _private("hooks", model, scaler=scaler)
    for index, (micro_x, micro_y) in enumerate(zip(x.split(2), y.split(2))):
        scaler.scale(_loss(wrapped, micro_x, micro_y)).backward()
        optimizer.signal_skip_step(do_skip=index < 2)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert optimizer.steps_taken == 1
    assert scaler.get_scale() == 2.0**10
    torch.testing.assert_close(_update(model, before), plain, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_fp16_autocast_with_a_scaler_is_within_fp16_error_of_the_float32_release(mode):
    x, y = _data(batch=8, dtype=torch.float32)
    reference, _ = _run(mode, x, y, dtype=torch.float32)
    model = _model(torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    wrapped, optimizer = _private(mode, model, scaler=scaler)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _loss(wrapped, x, y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    update = _update(model, before)
    assert float((update - reference).norm()) <= 2e-2 * float(reference.norm())


def test_a_non_scaler_is_refused_by_name():
    model = _model()
    _, optimizer = _private("hooks", model)
    with pytest.raises(TypeError, match="grad_scaler must be a torch.amp.GradScaler"):
        optimizer.attach_grad_scaler(object())


@pytest.mark.parametrize("mode", MODES)
def test_make_private_with_a_grad_scaler_trains_as_the_unscaled_loop(mode):
    from torch.utils.data import DataLoader, TensorDataset

    from privacy_engine import PrivacyEngine

    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(64, 6, dtype=torch.float64, generator=generator), torch.randint(0, 3, (64,), generator=generator))

    def train(scaler):
        torch.manual_seed(11)
        model = _model()
        engine = PrivacyEngine(accountant="rdp")
        made = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                   data_loader=DataLoader(data, batch_size=16), noise_multiplier=1.0, max_grad_norm=C,
                                   grad_sample_mode=mode, grad_scaler=scaler)  # fmt: skip
        wrapped, optimizer, loader = made
        for x, y in loader:
            loss = nn.functional.cross_entropy(wrapped(x), y)
            backward_and_step(loss, optimizer, scaler)
            optimizer.zero_grad()
        return torch.cat([p.detach().flatten() for p in model.parameters()]), engine.accountant.steps

    plain, plain_steps = train(None)
    scaled, scaled_steps = train(torch.amp.GradScaler("cpu", init_scale=2.0**14))
    assert scaled_steps == plain_steps == 4
    torch.testing.assert_close(scaled, plain, rtol=1e-10, atol=1e-12)
