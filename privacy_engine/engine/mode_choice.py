"""``grad_sample_mode="auto"`` (the default): which exact mode ``make_private`` uses, decided here, once.

Every mode clips each example's gradient to the same bound, so the choice is one of speed and of what
the user can read back (hooks: ``p.grad_sample``; ghost: only the clipped sum). The rule, in order:

========================================================  ========  =============================================
the model and settings                                    mode      why
========================================================  ========  =============================================
``grad_sample_mode`` named                                as named  the user's choice
user-level, non-flat clipping, truncation, audit, DDP     hooks     the paths these were built and tested on
a trainable layer with no registered sampler              hooks     ghost would materialise through the
                                                                    ``torch.func`` fallback anyway
no trainable convolution                                  hooks     the long-standing default (ghost is often
                                                                    faster here too: ``benchmarks/README.md``)
trainable convolutions, every layer with a sampler        ghost     per-sample gradients are ``B`` times the
                                                                    weights: a CNN's deep layers (few positions,
                                                                    many channels) make them far costlier than
                                                                    the plain step (resnet18, 64x64, batch 32,
                                                                    CPU: hooks ~4x plain, ghost ~1.6x)
========================================================  ========  =============================================

The choice and its reason are logged (INFO, ``privacy_engine.engine.mode_choice``) and the plan's
options hold the chosen mode (``engine.build`` builds its wrapper: ``GradSampleModule`` or
``GhostClippingModule``). The Opacus namespace keeps Opacus's default, ``"hooks"``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

import grad_samplers
from privacy_engine.engine.options import PrivacyOptions

logger = logging.getLogger(__name__)

AUTO = "auto"
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

__all__ = ["AUTO", "ModeChoice", "choose_grad_sample_mode"]


@dataclass(frozen=True, kw_only=True)
class ModeChoice:
    """The ``grad_sample_mode`` ``make_private`` uses, and why (one sentence, logged)."""

    mode: str
    reason: str


def _layers_owning_trainable_parameters(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if any(p.requires_grad for p in module.parameters(recurse=False))]


def choose_grad_sample_mode(model: nn.Module, options: PrivacyOptions, *, distributed: bool) -> ModeChoice:
    """The mode for ``options.grad_sample_mode`` on ``model`` (the table in this module's docstring):
    the named mode, or for ``"auto"`` ghost on models with trainable convolutions whose every layer has
    a registered sampler (when the settings are the plain ones), hooks otherwise. Logs the choice."""
    if options.grad_sample_mode != AUTO:
        return ModeChoice(mode=options.grad_sample_mode, reason="named by grad_sample_mode")
    choice = _auto_choice(model, options, distributed=distributed)
    logger.info("grad_sample_mode='auto' -> %r: %s", choice.mode, choice.reason)
    return choice


def _auto_choice(model: nn.Module, options: PrivacyOptions, *, distributed: bool) -> ModeChoice:
    special = [
        name
        for name, applies in (
            ("privacy_unit='user'", options.privacy_unit != "example"),
            (f"clipping={options.clipping!r}", options.clipping != "flat"),
            ("max_batch_size", options.max_batch_size is not None),
            ("audit", options.audit is not None),
            ("DDP", distributed),
        )
        if applies
    ]
    if special:
        return ModeChoice(mode="hooks", reason=f"hooks with {', '.join(special)}")
    layers = _layers_owning_trainable_parameters(model)
    without_sampler = sorted(
        {type(layer).__name__ for layer in layers if grad_samplers.norm_sampler_for(layer) is None}
    )
    if without_sampler:
        return ModeChoice(mode="hooks", reason=f"no registered sampler for {without_sampler} (ghost would materialise)")
    if not any(isinstance(layer, _CONVOLUTIONS) for layer in layers):
        return ModeChoice(
            mode="hooks", reason="no trainable convolution (grad_sample_mode='ghost' may still be faster)"
        )
    return ModeChoice(
        mode="ghost",
        reason="trainable convolutions and a sampler for every layer: ghost clipping never materialises the "
        "per-sample gradients (B x the weights), the main cost of hooks mode on CNNs; name "
        "grad_sample_mode='hooks' to read p.grad_sample",
    )
