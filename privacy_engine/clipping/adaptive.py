"""Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially Private Learning with
Adaptive Clipping"): the clip norm tracks a target quantile of the per-example gradient norms.

``AdaptiveClipping`` owns everything the method adds to DP-SGD, and nothing else writes it: the clip
norm(s) in force ``C_g`` (one per clipping group: one for flat clipping, one per layer for per-layer
clipping), its options (``AdaptiveClippingOptions``, named as Opacus's ``AdaClipDPOptimizer``), the
count of unclipped examples of the open logical step, and the generator of the count's noise.

Who reads and writes it:

- the clipper (``PerSampleGradientClipper``, both its materialised and its fast path) reads
  ``clip_norms`` as its bounds and calls ``count_unclipped_`` with the per-example norms it clipped;
- the optimizer (``DPOptimizer``) at each release takes the count (``take_count``), noises it
  (``noised_count``; in DDP on rank 0 only, after which it sums it over the ranks) and sets the next
  clip norms (``set_clip_norms(next_clip_norms(...))``), inside the release's commit.

The update, per group g, with m the expected batch size (the optimizer's divisor)::

    b_g   = sum over the batch's real examples of (1[||g_i||_g <= C_g] - 1/2) + N(0, sigma_b^2)
    frac  = b_g / m + 1/2                     (the estimated fraction of unclipped examples)
    C_g  <- clamp(C_g * exp(-eta (frac - gamma)), min_clipbound, max_clipbound)

The indicator is centred (``- 1/2``), as in the paper: adding or removing one example moves each
count by exactly 1/2, which is what Theorem 1's ``(2 sigma_b)^-2`` assumes. (Opacus counts
``1[...]`` uncentred, of sensitivity 1, and divides by the realised batch size; neither is done here.)

Accounting (``gradient_noise_multiplier``): the gradient sum is noised at ``sigma_delta =
(sigma^-2 - G (2 sigma_b)^-2)^(-1/2)`` instead of sigma. The release is ``(S + sigma_delta C Z1,
B + sigma_b Z2)`` with S the clipped sum (one example moves it by at most C, the total bound in force at
that step), B the G centred counts (one example moves each by exactly 1/2), Z1, Z2 independent standard
normals. Dividing the first part by ``sigma_delta C`` and the second by ``sigma_b`` (post-processing,
invertible) gives unit-variance Gaussian noise on a vector that one example moves by at most
``sqrt(sigma_delta^-2 + G (2 sigma_b)^-2) = 1/sigma`` in L2: exactly one Gaussian mechanism at noise
multiplier sigma, which sampling amplifies as one DP-SGD step (both parts are computed from the same
sampled batch). So the accountant records the unchanged DP-SGD event at sigma. Needs ``2 sigma_b >
sqrt(G) sigma``.

The released scale (``rescale_to_unit_norm``, recommended with adaptive clipping): without it the released
sum, and so the model's step at a fixed learning rate, is proportional to the clip norm in force: a clip norm
far below the gradients' norms (a small start) takes tiny steps until it has grown, and one far above them
(a large start, or a noisy model whose gradients grow) takes large noisy steps that keep the gradients, and
so the tracked quantile, large. With ``rescale_to_unit_norm=True`` every clipped gradient is divided by the
total bound in force at its step, the noise is drawn at ``sigma_delta`` (sensitivity 1), and the step's
scale is set by the learning rate alone (the normalisation of De et al. 2022). The privacy argument above
is unchanged: dividing the release by the public ``C_t`` is post-processing. On the digits tutorial
(``tutorials/adaptive_clipping_digits.py``) this is what makes the result independent of the initial clip
norm; the measured table is in that tutorial's docstring.

With BandMF noise (``BandMFNoise.clip_norm_may_change``, set by the optimizer): step t releases ``(S_t +
sigma_delta C_t ||c|| (C^-1 Z1)_t, B_t + sigma_b Z2_t)``, the history of BandMF kept in one scale and only
row t multiplied by the clip norm ``C_t`` in force, which is public (a function of the initial norm and
earlier released counts). Dividing the first part by ``C_t`` (post-processing) gives BandMF run on the
normalised stream ``S_t / C_t``, to which one example contributes at most 1 per participation whatever
``C_t`` is; a lower-triangular strategy stays private for such adaptively chosen inputs (Denisov et al.
2022), as it already must for gradients that depend on earlier releases. The strategy's noise is scaled by
its largest column norm ``||c||`` (column normalisation keeps it), so one participation at step t moves
rows t..t+b-1 of ``C (S / C_.)`` by at most ``||c||`` against noise ``sigma_delta ||c||``, and its count
(row t only: with cyclic Poisson sampling over b groups the example is in no other step of those b) by
``sqrt(G)/2`` against ``sigma_b``: ``1/sigma`` in all, in rows no other participation touches. So the pair is
one BandMF step at sigma with the same participation pattern, and the accountant records BandMF's event at
sigma. The count's noise stays independent of BandMF's (its own generator).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from privacy_engine.settings_checks import (
    check_clipbound_learning_rate,
    check_clipbounds,
    check_target_unclipped_quantile,
    check_unclipped_num_std,
    check_unclipped_num_std_for,
)

__all__ = ["AdaptiveClipping", "AdaptiveClippingOptions", "gradient_noise_multiplier"]


@dataclass(frozen=True, kw_only=True)
class AdaptiveClippingOptions:
    """The options of adaptive clipping, named as Opacus's ``AdaClipDPOptimizer``.

    Keyword Args:
        target_unclipped_quantile: gamma in [0, 1], the fraction of examples to leave unclipped
            (0.5: the clip norm tracks the median per-example norm).
        clipbound_learning_rate: eta >= 0 of the geometric update (the paper uses 0.2).
        max_clipbound, min_clipbound: the clip norm stays in ``[min_clipbound, max_clipbound]``;
            ``0 <= min < max < inf``.
        unclipped_num_std: sigma_b >= 0, the std of the noise on the count of unclipped examples
            (the paper suggests expected batch size / 20). With noise, ``2 sigma_b > sqrt(G) sigma``.
    """

    target_unclipped_quantile: float
    clipbound_learning_rate: float
    max_clipbound: float
    min_clipbound: float
    unclipped_num_std: float

    def __post_init__(self) -> None:
        # Each setting's one check (privacy_engine.settings_checks).
        object.__setattr__(
            self, "target_unclipped_quantile", check_target_unclipped_quantile(self.target_unclipped_quantile)
        )
        object.__setattr__(self, "clipbound_learning_rate", check_clipbound_learning_rate(self.clipbound_learning_rate))
        low, high = check_clipbounds(self.min_clipbound, self.max_clipbound)
        object.__setattr__(self, "min_clipbound", low)
        object.__setattr__(self, "max_clipbound", high)
        object.__setattr__(self, "unclipped_num_std", check_unclipped_num_std(self.unclipped_num_std))


def gradient_noise_multiplier(noise_multiplier: float, unclipped_num_std: float, *, num_groups: int = 1) -> float:
    """sigma_delta, the noise multiplier of the gradient sum when ``num_groups`` counts of sensitivity 1/2
    are released with noise std ``unclipped_num_std`` next to it, so the pair costs one Gaussian step at
    ``noise_multiplier``: ``(sigma^-2 - G (2 sigma_b)^-2)^(-1/2)`` (Andrew et al. 2021, Theorem 1).

    Guarantee: ``1/sigma_delta^2 + G/(2 sigma_b)^2 = 1/sigma^2`` (up to float rounding), so the joint
    release's privacy loss equals that of one Gaussian mechanism of sensitivity 1 and noise sigma.

    ======================================  ===============================
    case                                    result
    ======================================  ===============================
    sigma = 0                               0 (no noise anywhere: no privacy)
    2 sigma_b <= sqrt(G) sigma, sigma > 0   ValueError naming unclipped_num_std
    sigma_b = inf                           sigma (the count is pure noise)
    ======================================  ===============================
    """
    check_unclipped_num_std_for(noise_multiplier, unclipped_num_std, num_groups=num_groups)
    if noise_multiplier == 0:
        return 0.0
    return (noise_multiplier**-2 - num_groups * (2.0 * unclipped_num_std) ** -2) ** -0.5


class AdaptiveClipping:
    """The clip norm(s) of adaptive clipping, their options, the open step's count and its noise.

    Guarantee: ``clip_norms`` changes only through ``set_clip_norms`` (the optimizer calls it once per
    release with ``next_clip_norms`` of the released, noised count) and always lies in
    ``[min_clipbound, max_clipbound]``; the count holds, per group, ``sum (1[norm <= C_g] - 1/2)`` over
    the real (non-padding) examples clipped since the last ``take_count`` / ``discard_count``, each
    judged against the clip norm it was clipped with (the norms do not change inside a logical step).

    ==================================  =================================================
    case                                counted as
    ==================================  =================================================
    norm <= C_g (norm 0 included)       unclipped: +1/2
    norm > C_g                          clipped: -1/2
    NaN / +-Inf norm                    clipped (the example is dropped): -1/2
    padding example                     not counted (0)
    ==================================  =================================================

    Args:
        options: ``AdaptiveClippingOptions``.
        initial_clip_norms: one starting clip norm per clipping group (``max_grad_norm``), each in
            ``[min_clipbound, max_clipbound]``.
        generator: the CPU generator the count's noise is drawn from (seeded reproducibly from the
            run's noise seed, or, in secure mode, with its whole state from the OS).
        secure_mode: the generator's state is never written to ``state_dict`` (a resumed secure run
            draws a fresh one, as the gradient noise does).
    """

    def __init__(
        self,
        options: AdaptiveClippingOptions,
        *,
        initial_clip_norms: Sequence[float],
        generator: torch.Generator,
        secure_mode: bool = False,
    ) -> None:
        if not isinstance(options, AdaptiveClippingOptions):
            raise TypeError(f"options must be an AdaptiveClippingOptions; got {type(options).__name__}")
        if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
            raise TypeError("generator must be a CPU torch.Generator (the count's noise is drawn on the CPU)")
        norms = tuple(float(c) for c in initial_clip_norms)
        if not norms:
            raise ValueError("initial_clip_norms is empty: give one clip norm per clipping group")
        for index, norm in enumerate(norms):
            if not options.min_clipbound <= norm <= options.max_clipbound:
                name = "max_grad_norm" if len(norms) == 1 else f"max_grad_norm (group {index})"
                raise ValueError(
                    f"{name} = {norm!r} is the initial adaptive clip norm and must lie in [min_clipbound, "
                    f"max_clipbound] = [{options.min_clipbound!r}, {options.max_clipbound!r}]"
                )
        self.options = options
        self.generator = generator
        #: Gives the generator's seed at the first release (``seed_if_pending``); None: ``generator`` is seeded.
        self.seed_at_first_draw: Callable[[], int] | None = None
        self.secure_mode = bool(secure_mode)
        self._clip_norms: tuple[float, ...] = norms
        self._count: torch.Tensor | None = None  # float64 (num_groups,), on the norms' device

    # ------------------------------------------------------------------ what the clipper reads
    @property
    def clip_norms(self) -> tuple[float, ...]:
        """The clip norm in force for each clipping group (the clipper's bounds)."""
        return self._clip_norms

    @property
    def num_groups(self) -> int:
        """The number of clipping groups, one clip norm (and one count) each."""
        return len(self._clip_norms)

    def gradient_noise_multiplier(self, noise_multiplier: float) -> float:
        """sigma_delta for this many groups and ``unclipped_num_std`` (see the module function)."""
        return gradient_noise_multiplier(noise_multiplier, self.options.unclipped_num_std, num_groups=self.num_groups)

    def count_unclipped_(self, per_sample_norms: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
        """Add the centred count of this call's unclipped examples to the open step's count (no host sync).

        ``per_sample_norms``: the unclipped group norms the clipper formed its factors from, ``(batch,
        num_groups)`` (already divided by any loss scale); ``padding_mask``: True for padding examples."""
        norms = per_sample_norms.detach()
        if norms.dim() != 2 or norms.shape[1] != self.num_groups:
            raise ValueError(f"per_sample_norms has shape {tuple(norms.shape)}; expected (batch, {self.num_groups})")
        bounds = torch.tensor(self._clip_norms, dtype=torch.float64, device=norms.device)
        # A NaN norm compares False: counted as clipped, as the clipper drops such an example.
        unclipped = (norms.to(torch.float64) <= bounds).to(torch.float64) - 0.5
        if padding_mask is not None:
            unclipped = unclipped.masked_fill(padding_mask.to(device=norms.device, dtype=torch.bool)[:, None], 0.0)
        total = unclipped.sum(0)
        self._count = total if self._count is None else self._count + total.to(self._count.device)

    # ------------------------------------------------------------------ what the optimizer calls
    def take_count(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The open step's centred count, float64 ``(num_groups,)`` (zeros if nothing was clipped: an empty
        batch), on ``device`` if given; the open count is then empty."""
        count = self._count
        self._count = None
        if count is None:
            count = torch.zeros(self.num_groups, dtype=torch.float64)
        return count if device is None else count.to(device)

    def discard_count(self) -> None:
        """Drop the open step's count (the clipped sums it goes with were dropped)."""
        self._count = None

    @property
    def has_count(self) -> bool:
        """Whether examples were counted since the last ``take_count`` / ``discard_count``."""
        return self._count is not None

    def seed_if_pending(self) -> None:
        """Seed the count's generator with ``seed_at_first_draw()`` if that is set (then forget it): a run whose
        count noise is seeded from torch's global generator draws that seed at its first release, so
        ``torch.manual_seed`` called after ``make_private`` makes the run repeat. ``DPOptimizer`` calls it
        before it keeps the generator's state for a rollback."""
        if self.seed_at_first_draw is not None:
            self.generator.manual_seed(self.seed_at_first_draw())
            self.seed_at_first_draw = None

    def noised_count(self, count: torch.Tensor) -> torch.Tensor:
        """``count + N(0, sigma_b^2)`` per group, the noise drawn from ``generator`` (float64, on the CPU,
        then moved to ``count``'s device). Advances the generator by one draw of ``num_groups`` normals
        whatever sigma_b is (0 adds exact zeros)."""
        noise = torch.randn(self.num_groups, dtype=torch.float64, generator=self.generator)
        return count + (noise * self.options.unclipped_num_std).to(count.device)

    def next_clip_norms(self, noised_count: torch.Tensor, expected_batch_size: float) -> tuple[float, ...]:
        """The clip norms after a release whose noised centred count is ``noised_count`` and whose sum is
        divided by ``expected_batch_size`` (not the realised batch size, which is not released):
        ``clamp(C exp(-eta (count / m + 1/2 - gamma)), min, max)``. Changes nothing."""
        if not (math.isfinite(expected_batch_size) and expected_batch_size > 0):
            raise ValueError(f"expected_batch_size must be finite and > 0; got {expected_batch_size!r}")
        options = self.options
        fractions = noised_count.detach().to("cpu", torch.float64) / expected_batch_size + 0.5
        return tuple(
            min(max(norm * math.exp(-options.clipbound_learning_rate * (float(fraction) - options.target_unclipped_quantile)),
                    options.min_clipbound), options.max_clipbound)
            for norm, fraction in zip(self._clip_norms, fractions.tolist())
        )  # fmt: skip

    def set_clip_norms(self, clip_norms: Sequence[float]) -> None:
        """Put ``clip_norms`` (from ``next_clip_norms``) in force; ``ValueError`` if one is outside the range."""
        norms = tuple(float(c) for c in clip_norms)
        if len(norms) != self.num_groups or not all(
            self.options.min_clipbound <= c <= self.options.max_clipbound for c in norms
        ):
            raise ValueError(f"clip_norms {norms} must be {self.num_groups} values in [min_clipbound, max_clipbound]")
        self._clip_norms = norms

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Plain data: the options, the clip norms in force, the open count, and (outside secure mode) the
        generator's state, so a resumed run draws the same count noise and follows the same clip norms."""
        return {
            "options": asdict(self.options),
            "clip_norms": list(self._clip_norms),
            "count": None if self._count is None else self._count.detach().to("cpu").clone(),
            "generator": None if self.secure_mode else self.generator.get_state(),
            **({"seed_pending": True} if self.seed_at_first_draw is not None else {}),
        }

    def check_state_dict(self, state: Any) -> None:
        """``ValueError`` naming the first mismatch unless ``load_state_dict(state)`` fits; changes nothing."""
        if not isinstance(state, Mapping) or not {"options", "clip_norms", "count", "generator"} <= set(state):
            raise ValueError("the adaptive clipping state is not a dict from AdaptiveClipping.state_dict()")
        if state["options"] != asdict(self.options):
            raise ValueError(
                f"the adaptive clipping state was saved with options {state['options']}; this run has "
                f"{asdict(self.options)}: make_private with the adaptive clipping options of the saved run"
            )
        norms = state["clip_norms"]
        if not isinstance(norms, list) or len(norms) != self.num_groups:
            raise ValueError(
                f"the adaptive clipping state has clip norms {norms!r}; this run has {self.num_groups} groups"
            )
        count = state["count"]
        if count is not None and (not isinstance(count, torch.Tensor) or tuple(count.shape) != (self.num_groups,)):
            raise ValueError("the adaptive clipping state's count does not have one entry per clipping group")
        if not self.secure_mode and not isinstance(state["generator"], torch.Tensor):
            raise ValueError("the adaptive clipping state has no generator state (saved in secure mode?)")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` (after ``check_state_dict``, which raises first). In secure mode the
        generator is left as it is (fresh OS state)."""
        self.check_state_dict(state)
        self.set_clip_norms(state["clip_norms"])
        self._count = None if state["count"] is None else state["count"].to(torch.float64).clone()
        if not self.secure_mode:
            self.generator.set_state(state["generator"])
            if state.get("seed_pending") is not True:
                self.seed_at_first_draw = None  # saved after the first draw: the saved state is the stream

    def __repr__(self) -> str:
        return f"AdaptiveClipping(clip_norms={list(self._clip_norms)}, options={self.options})"
