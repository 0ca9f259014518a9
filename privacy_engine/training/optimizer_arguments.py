"""The checks on ``DPOptimizer``'s constructor arguments, and the clipper and noise it builds from them.

Each check raises before the optimizer exists, so a refused configuration never trains: an optimizer
that re-evaluates the loss (LBFGS), a noise multiplier or expected batch size out of range, unclipped
gradients with noise (no finite noise makes them private), an accountant without a sample rate. The
settings themselves (``noise_multiplier``, ``max_grad_norm``, ``loss_reduction``,
``expected_batch_size``) are checked by their one function in ``privacy_engine.settings_checks``, the
one ``make_private``'s options call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer

from accountants.events import EventSpec
from privacy_engine.clipping import AdaptiveClipping, AdaptiveClippingOptions, MaxGradNorm, PerSampleGradientClipper
from privacy_engine.noise import GaussianNoise, NoiseMechanism
from privacy_engine.noise.secure_random import full_entropy_generator
from privacy_engine.settings_checks import (
    check_expected_batch_size,
    check_no_seed_for_given_noise,
    check_noise_multiplier,
    check_noise_std,
    check_unseeded_in_secure_mode,
)
from privacy_engine.settings_checks import check_loss_reduction as check_loss_reduction_setting

__all__ = [
    "build_adaptive_clipping",
    "build_clipper",
    "build_noise",
    "check_accounting",
    "check_loss_reduction",
    "check_noise_multiplier",
    "check_sensitivity",
    "check_wrapped_optimizer",
    "trainable_parameters",
]


def trainable_parameters(optimizer: Optimizer) -> list[nn.Parameter]:
    """The parameters of ``optimizer`` that ``DPOptimizer`` clips and noises, in order."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def check_wrapped_optimizer(optimizer: Any) -> None:
    """``TypeError`` unless ``optimizer`` is a first-order ``torch.optim.Optimizer``: LBFGS
    re-evaluates the loss several times per step, each evaluation needing its own noise."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "optimizer is LBFGS, which re-evaluates the loss several times per step: each evaluation "
            "would need its own noise and privacy budget. Use a first-order optimizer (SGD, Adam, ...)."
        )


def check_loss_reduction(loss_reduction: str, expected_batch_size: Any) -> None:
    """``loss_reduction`` (``"mean"`` or ``"sum"``) and, with ``"mean"``, the expected batch size
    that divides the noisy sum (a finite number > 0): each by its one check."""
    check_expected_batch_size(expected_batch_size, loss_reduction=check_loss_reduction_setting(loss_reduction))


def build_clipper(
    params: list[nn.Parameter],
    clipper: PerSampleGradientClipper | None,
    max_grad_norm: MaxGradNorm | None,
    clipping: str,
) -> PerSampleGradientClipper:
    """The given clipper (it must clip exactly ``params``, in order), or a new one over ``params``."""
    if not params:
        raise ValueError("optimizer has no parameter with requires_grad=True: nothing to train privately")
    if clipper is None:
        if max_grad_norm is None:
            raise ValueError("give max_grad_norm (or a ready clipper)")
        return PerSampleGradientClipper(params, max_grad_norm, clipping=clipping)
    if [id(p) for p in clipper.params] != [id(p) for p in params]:
        raise ValueError("clipper.params must be the optimizer's trainable parameters, in param_groups order")
    return clipper


def build_noise(noise: NoiseMechanism | None, noise_seed: int | None, secure_mode: bool) -> NoiseMechanism:
    """The given noise mechanism, or the default ``GaussianNoise(seed=noise_seed, secure_mode=...)``."""
    if noise is None:
        noise = GaussianNoise(seed=noise_seed, secure_mode=secure_mode)
    else:
        check_no_seed_for_given_noise(noise_seed)
    if not isinstance(noise, NoiseMechanism):
        raise TypeError(f"noise must be a NoiseMechanism; got {type(noise).__name__}")
    return noise


def check_sensitivity(
    noise_multiplier: float, clipper: PerSampleGradientClipper, expected_batch_size: float | None = None
) -> None:
    """``ValueError`` for noise on unclipped gradients (infinite sensitivity: no finite noise makes
    them private) or a noise std that overflows; ``check_noise_std``, as the noise mechanism applies it.
    Adaptive clipping: the count's noise must leave room for the gradient's (``unclipped_num_std``, see
    ``check_unclipped_num_std_for``), the largest clip norm's noise std must not overflow, and the
    fraction of unclipped examples needs ``expected_batch_size``."""
    adaptive = clipper.adaptive
    if adaptive is None:
        check_noise_std(noise_multiplier, clipper.sensitivity)
        return
    sigma_delta = adaptive.gradient_noise_multiplier(noise_multiplier)  # raises naming unclipped_num_std
    check_noise_std(sigma_delta, adaptive.options.max_clipbound * math.sqrt(adaptive.num_groups))
    if expected_batch_size is None:
        raise ValueError("adaptive clipping needs expected_batch_size (the count of unclipped examples is divided by it)")


def count_noise_generator(noise_seed: int | None, *, secure_mode: bool) -> torch.Generator:
    """The CPU generator of adaptive clipping's count noise: in secure mode its whole state from the OS
    (``full_entropy_generator``, as the gradient noise's); with ``noise_seed``, a stream derived from it that
    no gradient-noise stream shares (``SeedSequence`` spawn key ``_COUNT_STREAM``; the noise mechanism's keys
    are small (device, generator) pairs); without, one draw from torch's global generator (so
    ``torch.manual_seed`` makes a run reproducible)."""
    check_unseeded_in_secure_mode("noise_seed", noise_seed, secure_mode=secure_mode)
    if secure_mode:
        return full_entropy_generator("cpu")
    if noise_seed is None:
        noise_seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
    generator = torch.Generator()
    generator.manual_seed(_count_stream_seed(noise_seed))
    return generator


def _count_seed_from_global_generator() -> int:
    """The count's generator seed derived from one draw of torch's global generator (a module-level function,
    so an optimizer holding it still pickles)."""
    return _count_stream_seed(int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item()))


def _count_stream_seed(noise_seed: int) -> int:
    """The count's generator seed derived from ``noise_seed`` (``SeedSequence`` spawn key ``_COUNT_STREAM``)."""
    sequence = np.random.SeedSequence(entropy=int(noise_seed), spawn_key=_COUNT_STREAM)
    return int(sequence.generate_state(1, dtype=np.uint64)[0])


#: The SeedSequence spawn key of the count's noise stream (no gradient-noise stream uses it).
_COUNT_STREAM = (0x41444150, 0x434C4950)


def build_adaptive_clipping(
    clipper: PerSampleGradientClipper, options: AdaptiveClippingOptions, *, noise_seed: int | None, secure_mode: bool
) -> PerSampleGradientClipper:
    """A clipper over ``clipper``'s parameters and groups whose bounds are adaptive clipping's, starting from
    ``clipper``'s bounds; ``clipper`` itself if it already has an ``AdaptiveClipping`` with these options."""
    if not isinstance(options, AdaptiveClippingOptions):
        raise TypeError(f"adaptive_clipping must be an AdaptiveClippingOptions; got {type(options).__name__}")
    if clipper.adaptive is not None:
        if clipper.adaptive.options != options:
            raise ValueError("clipper already has adaptive clipping with other options than adaptive_clipping")
        return clipper
    if clipper.has_accumulated:
        raise ValueError("clipper already holds clipped sums; give adaptive clipping to a fresh clipper")
    adaptive = AdaptiveClipping(options, initial_clip_norms=clipper.bounds,
                                generator=count_noise_generator(0 if noise_seed is None and not secure_mode
                                                                else noise_seed, secure_mode=secure_mode),
                                secure_mode=secure_mode)  # fmt: skip
    if noise_seed is None and not secure_mode:
        # Seeded from torch's global generator at the first release, not now (as the gradient noise).
        adaptive.seed_at_first_draw = _count_seed_from_global_generator
    config = clipper.config
    return PerSampleGradientClipper(clipper.params, config.max_grad_norm, clipping=config.clipping, groups=clipper.groups,
                                    nan_safe=config.nan_safe, rescale_to_unit_norm=config.rescale_to_unit_norm,
                                    adaptive=adaptive)  # fmt: skip


def check_accounting(
    *,
    accountant: Any | None,
    sample_rate: float | None,
    noise_multiplier: float,
    privacy_event: EventSpec,
    padding_mask_source: Callable[[], torch.Tensor | None] | None,
    budget: Any | None,
) -> None:
    """The accountant must accept what every step will record: the noise mechanism's stated event
    (``privacy_event``) at ``noise_multiplier`` and ``sample_rate``, checked by a step of 0 steps,
    which records nothing; a budget needs an accountant to check."""
    if accountant is not None:
        if sample_rate is None:
            raise ValueError("sample_rate is needed with an accountant (it is recorded with every step)")
        # Validates the arguments the accountant will receive, recording nothing.
        accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, num_steps=0,
                        **privacy_event.step_kwargs())  # fmt: skip
    if padding_mask_source is not None and not callable(padding_mask_source):
        raise TypeError("padding_mask_source must be a callable returning a bool tensor or None")
    if budget is not None and (accountant is None or not callable(getattr(budget, "check_release", None))):
        raise ValueError("budget must be a privacy_engine.engine.budget.PrivacyBudget, and needs an accountant to check")
