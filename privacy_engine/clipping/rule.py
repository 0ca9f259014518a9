"""The per-example clipping rule shared by every clipping path (materialised and fast).

Both paths compute per-example gradient norms their own way and then call ``clip_factors``; the clipped
sum is ``sum_i factor_i * g_i``. Keeping the rule in one place keeps the two paths' guarantees equal.
"""

from __future__ import annotations

import math

import torch

from privacy_engine.settings_checks import check_max_grad_norm, check_rescale_to_unit_norm

__all__ = ["clip_factors", "validate_max_grad_norm"]

#: The one check of a bound (``privacy_engine.settings_checks``), under the name this module exported.
validate_max_grad_norm = check_max_grad_norm


def clip_factors(
    per_sample_norms: torch.Tensor,
    max_grad_norm: float,
    *,
    rescale_to_unit_norm: bool = False,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-example factors ``f`` such that ``f[i] * g_i`` has L2 norm at most ``max_grad_norm``.

    ``f[i] = min(1, C / ||g_i||)`` with ``C = max_grad_norm``. With ``rescale_to_unit_norm`` the factors
    are further divided by ``C`` so every clipped gradient has norm at most 1 (the noise is then drawn
    with standard deviation ``noise_multiplier`` instead of ``noise_multiplier * C``).

    Guarantee: for every example, ``f[i] * ||g_i|| <= C`` (``<= 1`` rescaled), up to float rounding,
    whatever the norms are: non-finite norms get factor 0, so such an example contributes nothing.

    =========================  ==============================================
    case                       factor
    =========================  ==============================================
    ``C = 0``                  0 for every example (rescaling: ValueError)
    ``C = inf``                1 (no clipping; rescaling: ValueError)
    ``||g_i|| = 0``            1 (the example contributes its zero gradient)
    ``||g_i||`` NaN or Inf     0 (the example is dropped; the bound holds)
    padding_mask[i] True       0 (padding examples contribute exactly zero)
    ``C < 0`` or NaN           ValueError
    =========================  ==============================================
    """
    if type(max_grad_norm) is float and 0.0 < max_grad_norm < math.inf and rescale_to_unit_norm is False:
        bound = max_grad_norm  # what both checks return for it (nothing to refuse): once per clipping call
    else:
        bound = check_max_grad_norm(max_grad_norm)
        check_rescale_to_unit_norm(rescale_to_unit_norm, bound)
    # Detached only where it changes something (the factors below are fresh tensors either way).
    norms = per_sample_norms.detach() if per_sample_norms.requires_grad else per_sample_norms
    if bound == 0:
        factors = torch.zeros_like(norms)
    elif math.isinf(bound):
        factors = torch.ones_like(norms)
    else:
        # C / max(norm, C) (as ``bound / tensor``: the reciprocal times C): exactly 1 for small norms, C/norm
        # above the bound, never a division by zero. A NaN or -Inf norm is first made +Inf, so every
        # non-finite norm gives 1/Inf * C = +0 (one op instead of a separate isfinite mask and where; the
        # factors of finite norms are the same floats).
        if not norms.is_floating_point():
            norms = norms.to(torch.get_default_dtype())  # what ``bound / clamp(norms, min=bound)`` computes in
        factors = torch.nan_to_num(norms, nan=math.inf, posinf=math.inf, neginf=math.inf)
        factors = factors.clamp_(min=bound).reciprocal_().mul_(bound)
        if rescale_to_unit_norm:
            factors = factors / bound
        return _masked(factors, padding_mask, norms)
    factors = torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))
    return _masked(factors, padding_mask, norms)


def _masked(factors: torch.Tensor, padding_mask: torch.Tensor | None, norms: torch.Tensor) -> torch.Tensor:
    """``factors`` with those of padding examples set to 0 (``ValueError`` for a mask of another shape)."""
    if padding_mask is not None:
        if padding_mask.shape != norms.shape:
            raise ValueError(
                f"padding_mask has shape {tuple(padding_mask.shape)}; expected {tuple(norms.shape)} (one flag per example)"
            )
        factors = factors.masked_fill(padding_mask.to(device=factors.device, dtype=torch.bool), 0.0)
    return factors
