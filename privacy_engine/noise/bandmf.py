"""Banded matrix-factorisation noise (``BandMFNoise``): noise correlated across steps.

BandMF (Choquette-Choo et al. 2023, arXiv:2306.08153; McKenna 2024, arXiv:2405.15913). The
strategy ``C`` is lower-triangular banded Toeplitz with ``C[i, j] = c[i - j]`` for
``0 <= i - j < b``. The mechanism releases the noisy gradients ``G + C^{-1} Z`` where ``Z`` has
iid ``N(0, s^2)`` entries, ``s = noise_multiplier * max_grad_norm * ||c||_2``. This is
post-processing of ``C G + Z``: each example that participates at steps at least ``b`` apart
(cyclic Poisson sampling with ``b`` groups guarantees this) changes each touched block of rows of
``C G`` by at most ``max_grad_norm * ||c||_2`` (the max column norm of ``C``), which ``Z``
hides with noise multiplier ``noise_multiplier``. Row ``t`` of ``C^{-1} Z`` is computed by
streaming: ``x_t = (z_t - sum_{j=1}^{b-1} c_j x_{t-j}) / c_0``, keeping the last ``b - 1`` noise
vectors in a ring buffer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from accountants.events import EventSpec
from privacy_engine.noise.layout import _DeviceGroup
from privacy_engine.noise.mechanism import NoiseMechanism
from privacy_engine.noise.strategy import validated_coefficients

__all__ = ["BandMFNoise"]


@dataclass(eq=False)
class _BandMFBuffers:
    """BandMF's per-device buffers besides its history (``_DeviceGroup.mechanism_buffers``)."""

    #: Row p: the coefficients c_1..c_{b-1} rotated for ring position p (see ``_make_ring_weights``).
    ring_weights: torch.Tensor
    #: The history row the commit in progress overwrote (reused across steps).
    undo_row: torch.Tensor | None = None


class BandMFNoise(NoiseMechanism):
    """Banded matrix-factorisation noise: step ``t`` adds row ``t`` of ``C^{-1} Z``.

    ``C`` is the ``b``-banded lower-triangular Toeplitz strategy with ``C[i, j] = c[i - j]``;
    ``Z`` has iid ``N(0, s^2)`` entries with ``s = noise_multiplier * max_grad_norm * ||c||_2``.

    Guarantee: the sequence of noisy gradients equals ``C^{-1} (C G + Z)``, post-processing of
    the Gaussian mechanism on ``C G``. If every example participates in steps at least ``b``
    apart (cyclic Poisson sampling with ``b`` groups), one participation changes ``C G`` by at
    most ``max_grad_norm * ||c||_2`` (the largest column norm of ``C``) in L2, so the mechanism
    is as private as DP-SGD with the same ``noise_multiplier`` on that participation pattern.
    The coefficients may have any positive scale: the noise does not depend on it.

    Column normalisation (``column_normalize_for_steps=n``, as in JAX Privacy and McKenna 2024):
    for a run of exactly ``n`` steps, the last ``b - 1`` columns of the ``n x n`` matrix ``C``
    are truncated and have smaller norms. Rescaling every column to norm ``||c||_2`` keeps the
    sensitivity and multiplies row ``t`` of ``C^{-1}`` by ``||c[:min(b, n - t)]||_2 / ||c||_2``
    (<= 1, = 1 for ``t <= n - b``): less noise in the final ``b - 1`` steps for the same
    guarantee. Steps beyond ``n`` are then undefined and raise ``RuntimeError``.

    ``noise_multiplier * max_grad_norm`` must be the same at every step (the guarantee above is for
    rows of ``Z`` with one scale), unless ``clip_norm_may_change`` is set (``DPOptimizer`` sets it for
    adaptive clipping). Then step ``t`` may pass another ``max_grad_norm = C_t`` (the same
    ``noise_multiplier``) and adds ``(C_t / C_0)`` times the noise a run fixed at ``C_0`` (step 0's) adds at
    step ``t``: the draws and the history stay in step 0's scale, and only the added row is rescaled.
    Guarantee then: the noise of step ``t`` is ``noise_multiplier * C_t * ||c||_2 * (C^{-1} Z)_t`` with
    ``Z`` unit Gaussian, i.e. the mechanism above run on the normalised stream ``G_t / C_t`` (one
    participation moves ``C (G / C_.)`` by at most ``||c||_2``, whatever the ``C_t``) and its row ``t``
    multiplied by ``C_t``. That is post-processing, hence as private as a fixed ``C``, provided ``C_t`` is
    public (a function of earlier releases only); a lower-triangular strategy stays private for such
    adaptively chosen inputs (Denisov et al. 2022). Whoever sets the flag vouches for that, and for a fixed
    ``noise_multiplier`` (the accounting is at one sigma). A run fixed at one ``C`` adds the same bits with
    or without the flag.

    =====================================  ============================================
    case                                   result
    =====================================  ============================================
    coefficients = (c_0,)                  GaussianNoise noise (identical for c_0 = 1)
    coefficients not 1-D / non-finite      ValueError naming coefficients
    c_0 <= 0                               ValueError naming coefficients
    noise_multiplier = 0 at every step     no noise, step advances
    noise scale changes between steps      ValueError, nothing changed
    ... with clip_norm_may_change          row rescaled by C_t / C_0 (step 0 scale > 0)
    step-0 scale 0, later > 0 (flag set)   ValueError, nothing changed
    step >= column_normalize_for_steps     RuntimeError, nothing changed
    secure_mode with a seed                ValueError
    =====================================  ============================================
    """

    #: Whether ``max_grad_norm`` may change between steps (see above); set by the caller that vouches the changes
    #: are public (``DPOptimizer`` with adaptive clipping). Not saved in ``state_dict``.
    clip_norm_may_change: bool = False

    def __init__(
        self,
        coefficients: Sequence[float] | np.ndarray | torch.Tensor,
        *,
        seed: int | None = None,
        secure_mode: bool = False,
        column_normalize_for_steps: int | None = None,
        prefetch: bool | None = None,
        noise_stream: str = "mt19937",
    ) -> None:
        if isinstance(coefficients, torch.Tensor):
            coefficients = coefficients.detach().cpu().double().numpy()
        self.coefficients = validated_coefficients(coefficients)
        if column_normalize_for_steps is not None and (
            isinstance(column_normalize_for_steps, bool)
            or not isinstance(column_normalize_for_steps, (int, np.integer))
            or column_normalize_for_steps < 1
        ):
            raise ValueError(
                "column_normalize_for_steps must be None or a positive int (the number of steps "
                f"of the run), got {column_normalize_for_steps!r}"
            )
        super().__init__(seed=seed, secure_mode=secure_mode, prefetch=prefetch, noise_stream=noise_stream)
        self.column_normalize_for_steps = (
            None if column_normalize_for_steps is None else int(column_normalize_for_steps)
        )
        self.num_bands = int(self.coefficients.size)
        self.sensitivity = float(np.linalg.norm(self.coefficients))
        self._ring_position = 0
        self._fixed_scale: float | None = None  # noise_multiplier * max_grad_norm of step 0 (the history's unit)
        self.clip_norm_may_change = False
        self._row_scale_tail = self._column_scales()

    def _column_scales(self) -> list[float]:
        """Row scales of the normalised ``C^{-1}`` for the last ``min(b - 1, n)`` steps."""
        n = self.column_normalize_for_steps
        if n is None:
            return []
        prefix_norms = np.sqrt(np.cumsum(self.coefficients**2)) / self.sensitivity
        # Step t of n keeps coefficients c_0..c_{min(b-1, n-1-t)} in its column.
        tail = [float(prefix_norms[min(self.num_bands - 1, n - 1 - t)]) for t in range(n)]
        return tail[max(0, n - (self.num_bands - 1)) :]

    def _row_scale(self, step: int) -> float:
        n = self.column_normalize_for_steps
        if n is None:
            return 1.0
        first_tail_step = n - len(self._row_scale_tail)
        return 1.0 if step < first_tail_step else self._row_scale_tail[step - first_tail_step]

    def noise_std(self, noise_multiplier: float, max_grad_norm: float) -> float:
        """``s = noise_multiplier * max_grad_norm * ||c||_2``, the std of the fresh draws ``z_t``.

        The noise actually added at step ``t`` has covariance ``s^2 (C^{-1} C^{-T})[t, t]`` per
        entry (``s^2 / c_0^2`` at step 0). Edge cases as ``GaussianNoise.noise_std``.
        """
        return self._validated_noise_scale(noise_multiplier, max_grad_norm) * self.sensitivity

    def _before_step(self, noise_scale: float) -> None:
        fixed = self._fixed_scale
        if (
            fixed is not None
            and not math.isclose(noise_scale, fixed, rel_tol=1e-9)
            and not (self.clip_norm_may_change and fixed > 0)
        ):
            raise ValueError(
                "BandMFNoise needs the same noise_multiplier * max_grad_norm at every step "
                f"(first step: {fixed}, now: {noise_scale}): the guarantee covers rows of Z "
                "with one scale"
            )
        self._this_step_scale = noise_scale
        n = self.column_normalize_for_steps
        if n is not None and self._step >= n:
            raise RuntimeError(
                f"the strategy was column-normalised for column_normalize_for_steps={n} steps "
                f"and step {self._step + 1} was requested; build the mechanism with the real "
                "number of steps"
            )

    def _rescaled(self) -> bool:
        """Whether this step's scale differs from step 0's and the row is rescaled (``clip_norm_may_change``)."""
        fixed = self._fixed_scale
        return self.clip_norm_may_change and fixed is not None and self._this_step_scale != fixed

    def _draw_std(self, std: float) -> float:
        # A changed clip norm: draw in step 0's scale (the history's), as noise_std did at step 0 (same bits);
        # _form_noise rescales the row by C_t / C_0.
        return self._fixed_scale * self.sensitivity if self._rescaled() else std

    def privacy_event(self) -> EventSpec:
        """The Gaussian mechanism on every participation, with cyclic Poisson sampling over
        ``num_bands`` groups (``accountants.events.gaussian_event``): the noise is scaled by the
        strategy's sensitivity ``||c||_2``, so each participation changes ``C G`` by at most
        ``max_grad_norm * ||c||_2`` and is hidden by noise multiplier ``noise_multiplier``; an
        example takes part in at most ceil(steps / b) steps. Column normalisation keeps the
        sensitivity, so it states the same event."""
        return EventSpec(num_bands=self.num_bands)

    def restart_layout(self) -> None:
        """As ``NoiseMechanism.restart_layout``; the noise correlation restarts too (history and ring
        position). The strategy becomes block-diagonal, still b-banded with column norms at most
        ``||c||_2``, so the same accounting holds (each participation still touches at most b rows
        with that norm); only the noise cancellation across the restart is lost."""
        super().restart_layout()
        self._ring_position = 0

    def _advance(self) -> Callable[[], None]:
        fixed_scale = self._this_step_scale if self._fixed_scale is None else self._fixed_scale
        position = (self._ring_position + 1) % (self.num_bands - 1) if self.num_bands > 1 else self._ring_position

        def advance() -> None:
            self._fixed_scale, self._ring_position = fixed_scale, position

        return advance

    def _history_rows(self) -> int:
        return self.num_bands - 1

    def _buffers(self, group: _DeviceGroup) -> _BandMFBuffers:
        if group.mechanism_buffers is None:
            group.mechanism_buffers = _BandMFBuffers(ring_weights=self._make_ring_weights(group.dtype, group.device))
        return group.mechanism_buffers

    def _ring_weights(self, group: _DeviceGroup) -> torch.Tensor | None:
        return self._buffers(group).ring_weights if self.num_bands > 1 else None

    def _make_ring_weights(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # Ring slot (p - j) mod (b - 1) holds x_{t-j} when the next write goes to slot p, so the
        # weights for position p are the coefficients c_1..c_{b-1} rotated accordingly; one
        # precomputed row per position keeps host-to-device copies out of the step.
        slots = self.num_bands - 1
        weights = np.zeros((slots, slots))
        for position in range(slots):
            for lag in range(1, self.num_bands):
                weights[position, (position - lag) % slots] = self.coefficients[lag]
        return torch.as_tensor(weights, dtype=dtype, device=device)

    def _form_noise(self, group: _DeviceGroup) -> float:
        if group.formed_ahead:
            group.formed_ahead = False  # formed in the background from this very state (_form_ahead)
        else:
            self._form_into(group.noise, group.history, self._ring_weights(group), self._ring_position)
        row_scale = self._row_scale(self._step)
        if self._rescaled():
            row_scale *= self._this_step_scale / self._fixed_scale  # C_t / C_0; the history keeps step 0's scale
        return row_scale

    def _form_into(
        self, noise: torch.Tensor, history: torch.Tensor | None, ring_weights: torch.Tensor | None, position: int
    ) -> None:
        c_0 = float(self.coefficients[0])
        if self.num_bands == 1:
            if c_0 != 1.0:
                noise.div_(c_0)
        else:
            # x_t = (z_t - sum_j c_j x_{t-j}) / c_0 in one pass over the history (one gemv).
            noise.addmv_(history.t(), ring_weights[position], beta=1.0 / c_0, alpha=-1.0 / c_0)

    def _form_ahead(self, group: _DeviceGroup) -> tuple[Callable[[torch.Tensor], None] | None, object]:
        # The history and ring position are those of the next step once this step is committed; the same
        # gemv on the same data gives the same bits on any thread.
        form = functools.partial(
            self._form_into, history=group.history, ring_weights=self._ring_weights(group), position=self._ring_position
        )
        return form, self._form_ahead_key(group)

    def _form_ahead_key(self, group: _DeviceGroup) -> object:
        history = group.history
        return (self._ring_position, None if history is None else (id(history), history._version))

    def _commit_noise(self, group: _DeviceGroup) -> Callable[[], None]:
        # x_t replaces x_{t-b+1} (no longer needed once the step is taken) in the ring. The row it overwrites
        # is kept aside (one row, in a buffer reused across steps) so that a commit failing later, before the
        # accountant has recorded the step, puts the history back bit for bit.
        if self.num_bands == 1:
            return super()._commit_noise(group)
        row = group.history[self._ring_position]
        buffers = self._buffers(group)
        if buffers.undo_row is None:
            buffers.undo_row = torch.empty_like(row)
        overwritten = buffers.undo_row
        overwritten.copy_(row)
        try:
            row.copy_(group.noise)
        except BaseException:
            row.copy_(overwritten)  # a copy that failed part-way: the row as it was
            raise
        return functools.partial(row.copy_, overwritten)

    def _extra_state(self) -> dict[str, Any]:
        return {
            "coefficients": self.coefficients.tolist(),
            "column_normalize_for_steps": self.column_normalize_for_steps,
            "ring_position": self._ring_position,
            "noise_scale": self._fixed_scale,
        }

    def _check_extra_state(self, state: dict[str, Any]) -> None:
        saved = np.asarray(state["coefficients"], dtype=np.float64)
        if saved.shape != self.coefficients.shape or not np.array_equal(saved, self.coefficients):
            raise ValueError(
                "state was saved with different coefficients; build BandMFNoise with the "
                "coefficients of the saved run"
            )
        if state["column_normalize_for_steps"] != self.column_normalize_for_steps:
            raise ValueError(
                f"state was saved with column_normalize_for_steps="
                f"{state['column_normalize_for_steps']}, this mechanism has "
                f"{self.column_normalize_for_steps}"
            )

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._ring_position = int(state["ring_position"])
        self._fixed_scale = state["noise_scale"]

    def __repr__(self) -> str:
        return (
            f"BandMFNoise(num_bands={self.num_bands}, column_normalize_for_steps="
            f"{self.column_normalize_for_steps}, secure_mode={self.secure_mode}, step={self.step})"
        )
