"""``ClippingStats``: what one logical step's per-example norms looked like before clipping
(diagnostics, not private), computed lazily from the norms the clipper kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["ClippingStats", "combined_totals"]


class ClippingStats:
    """Diagnostics of one logical step: how large the per-example gradients were before clipping.

    Not private: these numbers are computed from the raw data. Log them for tuning on public or
    proxy data; do not release them as part of a DP result.

    An *example* is a user with per-user clipping. Padding examples are not counted. The norm is
    the L2 norm over all clipped parameters (for ``per_layer`` too); an example counts as clipped
    if any of its groups exceeded its bound (or had a non-finite norm and was dropped). With no
    example, every number is 0.

    ``totals``: float64 ``(count, sum of norms, max norm, number clipped)``, or a function returning
    them: the clipper passes one, so that the totals are computed from the kept per-example norms only
    when a field is first read (a step whose statistics nobody reads pays for none of the small
    operations); they stay on the device until then, so that logging nothing costs no sync.
    """

    __slots__ = ("_compute", "_totals")

    def __init__(self, totals: torch.Tensor | Callable[[], torch.Tensor]) -> None:
        if isinstance(totals, torch.Tensor):
            self._totals, self._compute = totals, None
        else:
            self._totals, self._compute = None, totals

    @property
    def totals(self) -> torch.Tensor:
        """float64 ``(count, sum of norms, max norm, number clipped)``, computed on first read and kept (on
        the device it was computed on)."""
        if self._totals is None:
            self._totals, self._compute = self._compute(), None
        return self._totals

    @property
    def num_examples(self) -> int:
        """Examples (users with per-user clipping) in the step, padding not counted."""
        return int(self.totals[0].item())

    @property
    def mean_per_sample_norm(self) -> float:
        """Mean pre-clipping L2 norm over the step's examples (0.0 with no example)."""
        count = float(self.totals[0].item())
        return float(self.totals[1].item()) / count if count else 0.0

    @property
    def max_per_sample_norm(self) -> float:
        """Largest pre-clipping L2 norm of an example (0.0 with no example)."""
        return float(self.totals[2].item()) if self.totals[0].item() else 0.0

    @property
    def clipped_fraction(self) -> float:
        """Fraction of examples clipped (any group over its bound, or dropped as non-finite); 0.0 with no
        example."""
        count = float(self.totals[0].item())
        return float(self.totals[3].item()) / count if count else 0.0

    def as_dict(self) -> dict[str, float]:
        """The four statistics by name (reads them, so syncs with the device). Not private: do not release."""
        return {
            "num_examples": self.num_examples,
            "mean_per_sample_norm": self.mean_per_sample_norm,
            "max_per_sample_norm": self.max_per_sample_norm,
            "clipped_fraction": self.clipped_fraction,
        }

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v:.4g}" for k, v in self.as_dict().items())
        return f"ClippingStats({fields})"


def _batch_totals(norms: torch.Tensor, padding_mask: torch.Tensor | None, bounds: Sequence[float]) -> torch.Tensor:
    """``ClippingStats.totals`` of one call: its group norms ``(batch, groups)`` and padding mask."""
    norms = norms.to(torch.float64)
    bound_values = torch.tensor(bounds, dtype=torch.float64, device=norms.device)
    total_norms = norms.square().sum(1).sqrt()
    clipped = ((norms > bound_values) | ~torch.isfinite(norms)).any(1)
    real = torch.ones_like(total_norms, dtype=torch.bool)
    if padding_mask is not None:
        real = ~padding_mask.to(norms.device)
    zero = torch.zeros((), dtype=torch.float64, device=norms.device)
    return torch.stack(
        [
            real.sum().to(torch.float64),
            torch.where(real, total_norms, zero).sum(),
            torch.where(real, total_norms, zero).amax() if total_norms.numel() else zero,
            (clipped & real).sum().to(torch.float64),
        ]
    )


def combined_totals(
    totals: torch.Tensor | None, batches: Sequence[tuple[torch.Tensor, torch.Tensor | None]], bounds: Sequence[float]
) -> torch.Tensor:
    """``totals`` (None: nothing yet) combined with each call's totals, in order."""
    for norms, padding_mask in batches:
        batch_totals = _batch_totals(norms, padding_mask, bounds)
        if totals is None:
            totals = batch_totals
            continue
        previous = totals.to(norms.device)
        totals = torch.stack(
            [
                previous[0] + batch_totals[0],
                previous[1] + batch_totals[1],
                torch.maximum(previous[2], batch_totals[2]),
                previous[3] + batch_totals[3],
            ]
        )
    return totals.detach().clone()
