"""The checks on ``DPOptimizer``'s constructor arguments, and the clipper and noise it builds from them.

Each check raises before the optimizer exists, so a refused configuration never trains: an optimizer
that re-evaluates the loss (LBFGS), a noise multiplier or expected batch size out of range, unclipped
gradients with noise (no finite noise makes them private), an accountant without a sample rate. The
settings themselves (``noise_multiplier``, ``max_grad_norm``, ``loss_reduction``,
``expected_batch_size``) are checked by their one function in ``privacy_engine.settings_checks``, the
one ``make_private``'s options call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from accountants.events import EventSpec
from privacy_engine.clipping import MaxGradNorm, PerSampleGradientClipper
from privacy_engine.noise import GaussianNoise, NoiseMechanism
from privacy_engine.settings_checks import (
    check_expected_batch_size,
    check_no_seed_for_given_noise,
    check_noise_multiplier,
    check_noise_std,
)
from privacy_engine.settings_checks import check_loss_reduction as check_loss_reduction_setting

__all__ = [
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


def check_sensitivity(noise_multiplier: float, clipper: PerSampleGradientClipper) -> None:
    """``ValueError`` for noise on unclipped gradients (infinite sensitivity: no finite noise makes
    them private) or a noise std that overflows; ``check_noise_std``, as the noise mechanism applies it."""
    check_noise_std(noise_multiplier, clipper.sensitivity)


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
