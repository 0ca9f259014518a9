"""fp16 loss scaling (``torch.amp.GradScaler``) with a ``DPOptimizer``.

The clipper divides the scaler's scale out of every example's gradient before clipping; the private
step is never skipped on an overflow (whether a batch overflowed depends on its examples), and the
scaler's next scale is driven by the released (noised) gradient only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from privacy_engine.clipping import PerSampleGradientClipper

__all__ = ["LossScaling"]


class LossScaling:
    """``DPOptimizer``'s GradScaler handling (a mixin over its clipper)."""

    clipper: PerSampleGradientClipper
    discard_logical_step: Callable[[], None]

    # torch.amp.GradScaler hands scale-aware optimizers its scale instead of unscaling and skipping steps
    # itself (DPOptimizer.step): a skip decided by whether the raw gradients overflowed depends on the data.
    _step_supports_amp_scaling = True

    def attach_grad_scaler(self, scaler: Any) -> None:
        """Train with fp16 loss scaling: ``scaler.scale(loss).backward(); scaler.step(optimizer);
        scaler.update()`` as in a non-private loop.

        Guarantee: each example's gradient is clipped at ``max_grad_norm`` after the loss scale is
        divided out (the clipper reads the scaler's current scale when it clips a pass), so the release
        is the one the accountant records whatever the scale. ``scaler.step(optimizer)`` always steps:
        an example whose scaled gradient overflowed contributes its finite entries only (``nan_safe``;
        its contribution is still clipped), and the step is never skipped, since whether a batch
        overflowed depends on its examples. For the same reason the scaler's next scale is driven by the
        released (noised) gradient only: ``scaler.update()`` sees an overflow if and only if the released
        gradient is not finite, and the scale otherwise stays where it is (no growth decided by private
        data). The scale is therefore static in practice: pick ``GradScaler(init_scale=...)`` so that
        per-example gradients neither underflow nor overflow (2**10 to 2**16 for mean-reduced losses).

        ==================================  ==============================================
        case                                result
        ==================================  ==============================================
        scaler disabled (enabled=False)     scale 1: the ordinary private step
        ``scaler.unscale_(optimizer)`` first the scale is still divided out once (of the
                                            per-sample gradients, which unscale_ never sees)
        ``optimizer.step()`` without scaler the scale is divided out just the same
        scaler not a GradScaler             TypeError, nothing changed
        GradScaler.step with none attached  RuntimeError before anything is released
        ==================================  ==============================================
        """
        needed = ("get_scale", "is_enabled", "update", "_per_optimizer_states")
        if not all(hasattr(scaler, name) for name in needed):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler; got {type(scaler).__name__}")
        self.clipper.grad_scaler = scaler

    def _check_scaled_step(self) -> None:
        """For ``GradScaler.step(optimizer)``: ``RuntimeError``, with the open logical step discarded
        (nothing released), unless the scaler was attached (its scale is divided out before clipping)."""
        if self.clipper.grad_scaler is None:
            self.discard_logical_step()
            raise RuntimeError(
                "GradScaler.step(optimizer) was called, but the private optimizer does not know the scaler: the "
                "per-sample gradients would be clipped at their scaled size. Pass grad_scaler=scaler to "
                "make_private (or call optimizer.attach_grad_scaler(scaler)) before training. Nothing was released."
            )

    def _report_overflow_to_scaler(self, released: list[torch.Tensor]) -> None:
        """Make ``scaler.update()`` see an overflow exactly when the released gradient is not finite,
        and keep the scale from growing (see ``attach_grad_scaler``): the scaler's own overflow flags
        were computed from gradients before privacy."""
        scaler = self.clipper.grad_scaler
        scale = scaler._scale
        # One flag on the scale's device, computed there (no host sync): 1 if any released entry is not finite.
        finite = [torch.isfinite(g).all().to(scale.device) for g in released]
        overflow = (~torch.stack(finite).all()).float() if finite else torch.zeros((), device=scale.device)
        flags = scaler._per_optimizer_states[id(self)]["found_inf_per_device"]
        for found_inf in flags.values():
            found_inf.copy_(overflow)
        if not flags:  # no .grad was there to check (fast clipping writes .grad only at the step)
            flags[scale.device] = overflow.to(torch.float32)
        tracker = getattr(scaler, "_growth_tracker", None)
        if tracker is not None:
            # update() grows the scale once the count of clean steps reaches growth_interval: a count this
            # far below any interval keeps the scale where it is (a growing scale, with overflows that
            # cannot be reported, would end by zeroing every example).
            tracker.fill_(-(2**30))
