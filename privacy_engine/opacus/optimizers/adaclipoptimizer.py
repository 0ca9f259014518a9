"""``opacus.optimizers.adaclipoptimizer``: ``AdaClipDPOptimizer`` with Opacus's constructor, on the engine's
adaptive clipping (``privacy_engine.clipping.adaptive``).

What differs from Opacus's class, on purpose (each makes the stated guarantee hold):

- the count is centred (``1[norm <= C] - 1/2``, sensitivity 1/2 per example, what the paper's Theorem 1
  and its ``(2 sigma_b)^-2`` assume; Opacus counts ``1[norm <= C]``, of sensitivity 1) and divided by the
  expected batch size (Opacus divides by the realised one, which is not released);
- ``noise_multiplier`` stays sigma, the multiplier the accountant records for the pair (gradient, count);
  the gradient is noised at ``gradient_noise_multiplier`` (sigma_delta). Opacus overwrites
  ``noise_multiplier`` with sigma_delta, which its accountant hook then records: an epsilon smaller than
  the pair's;
- ``max_grad_norm`` reads the clip norm in force, as in Opacus (it is updated after every release).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from privacy_engine.clipping import AdaptiveClippingOptions, PerSampleGradientClipper
from privacy_engine.opacus.optimizers.optimizer import DPOptimizer, _check_generator
from privacy_engine.training.optimizer_arguments import build_adaptive_clipping, trainable_parameters

__all__ = ["AdaClipDPOptimizer", "AdaClipFromClipper"]


class AdaClipDPOptimizer(DPOptimizer):
    """Opacus's adaptive clipping optimizer (Andrew et al. 2021): flat clipping whose clip norm tracks
    ``target_unclipped_quantile`` of the per-example norms, with Opacus's constructor.

    Guarantee: each released step is ``sum_i clip_C(g_i) + N(0, (sigma_delta C)^2 I)`` together with the
    count ``sum_i (1[||g_i|| <= C] - 1/2) + N(0, unclipped_num_std^2)``, C the clip norm in force, and is
    recorded as one DP-SGD step at ``noise_multiplier`` (see ``privacy_engine.clipping.adaptive``).

    ==========================================================  ==========================================
    case                                                        result
    ==========================================================  ==========================================
    ``noise_multiplier >= 2 * unclipped_num_std`` (> 0)         ValueError naming unclipped_num_std
    ``max_clipbound <= min_clipbound``                          ValueError naming max_clipbound
    ``max_grad_norm`` outside [min_clipbound, max_clipbound]    ValueError naming max_grad_norm
    other options out of range                                  ValueError / TypeError naming the option
    ==========================================================  ==========================================
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        noise_multiplier: float,
        target_unclipped_quantile: float,
        clipbound_learning_rate: float,
        max_clipbound: float,
        min_clipbound: float,
        unclipped_num_std: float,
        max_grad_norm: float,
        expected_batch_size: int | None,
        loss_reduction: str = "mean",
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
        **kwargs: Any,
    ) -> None:
        options = AdaptiveClippingOptions(
            target_unclipped_quantile=target_unclipped_quantile, clipbound_learning_rate=clipbound_learning_rate,
            max_clipbound=max_clipbound, min_clipbound=min_clipbound, unclipped_num_std=unclipped_num_std,
        )  # fmt: skip
        clipper = kwargs.pop("clipper", None)
        if clipper is None:
            clipper = PerSampleGradientClipper(trainable_parameters(optimizer), max_grad_norm, clipping="flat")
        # The count's seed: one draw from generator (after none: torch's global generator; secure: the OS).
        _check_generator(generator)
        count_seed = None
        if not secure_mode and generator is not None:
            count_seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64, generator=generator).item())
        kwargs["clipper"] = build_adaptive_clipping(clipper, options, noise_seed=count_seed, secure_mode=secure_mode)
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=generator,
            secure_mode=secure_mode,
            **kwargs,
        )

    @property
    def max_grad_norm(self) -> float:  # type: ignore[override]
        """The clip norm in force (updated after every release), as Opacus's attribute."""
        return self.clipper.bounds[0]

    @property
    def target_unclipped_quantile(self) -> float:
        """gamma, the fraction of examples the clip norm aims to leave unclipped."""
        return self.clipper.adaptive.options.target_unclipped_quantile

    @property
    def clipbound_learning_rate(self) -> float:
        """eta of the geometric update."""
        return self.clipper.adaptive.options.clipbound_learning_rate

    @property
    def max_clipbound(self) -> float:
        """The largest clip norm."""
        return self.clipper.adaptive.options.max_clipbound

    @property
    def min_clipbound(self) -> float:
        """The smallest clip norm."""
        return self.clipper.adaptive.options.min_clipbound

    @property
    def unclipped_num_std(self) -> float:
        """sigma_b, the std of the count's noise."""
        return self.clipper.adaptive.options.unclipped_num_std


class AdaClipFromClipper(AdaClipDPOptimizer):
    """``AdaClipDPOptimizer`` built by ``make_private(clipping="adaptive")`` from the engine's plan: the options
    and the initial clip norm are read from the ready adaptive ``clipper`` the engine built (so the optimizer
    ``make_private`` returns is an ``AdaClipDPOptimizer``, as in Opacus)."""

    def __init__(self, optimizer: Optimizer, *, clipper: PerSampleGradientClipper, **kwargs: Any) -> None:
        if clipper.adaptive is None:
            raise ValueError("clipper has no adaptive clipping")
        options = clipper.adaptive.options
        super().__init__(
            optimizer,
            target_unclipped_quantile=options.target_unclipped_quantile,
            clipbound_learning_rate=options.clipbound_learning_rate,
            max_clipbound=options.max_clipbound,
            min_clipbound=options.min_clipbound,
            unclipped_num_std=options.unclipped_num_std,
            max_grad_norm=clipper.config.max_grad_norm,
            clipper=clipper,
            **kwargs,
        )
