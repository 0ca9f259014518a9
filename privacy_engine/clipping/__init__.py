"""Clipping: per-example gradients (or their norms) to one bounded-sensitivity sum (after capture,
before noise).

=====================  ================================================================
file                   what it holds
=====================  ================================================================
``rule.py``            ``clip_factors``: the rule every clipping path applies
``adaptive.py``        ``AdaptiveClipping``: clip norms that track a quantile of the
                       per-example norms (Andrew et al. 2021), their count and its noise
``config.py``          ``ClippingConfig`` (bounds, flat / per_layer), ``parameter_groups``
``clipper.py``         ``PerSampleGradientClipper``: clips materialised per-sample
                       gradients and holds the clipped sum until the step
``per_sample_ops.py``  norms, non-finite entries and per-user sums of per-sample gradients
``per_user.py``        ``user_group_ids``: which rows of a user-level pass are one user's
                       (refuses a micro-batch that cuts a user)
``stats.py``           ``ClippingStats`` (diagnostics, not private)
``ghost/``             fast clipping, ``GhostClippingModule``: norms and the clipped sum
                       inside one backward pass (``module.py`` the wrapper, ``gate.py`` the
                       gated layers, ``attention.py`` ``nn.MultiheadAttention``,
                       ``backward.py`` norms and sums, ``uses.py`` what a pass keeps)
=====================  ================================================================
"""

from privacy_engine.clipping.adaptive import AdaptiveClipping, AdaptiveClippingOptions, gradient_noise_multiplier
from privacy_engine.clipping.clipper import PerSampleGradientClipper
from privacy_engine.clipping.config import CLIPPING_MODES, ClippingConfig, MaxGradNorm, parameter_groups
from privacy_engine.clipping.rule import clip_factors, validate_max_grad_norm
from privacy_engine.clipping.stats import ClippingStats

__all__ = [
    "CLIPPING_MODES",
    "AdaptiveClipping",
    "AdaptiveClippingOptions",
    "ClippingConfig",
    "ClippingStats",
    "MaxGradNorm",
    "PerSampleGradientClipper",
    "clip_factors",
    "gradient_noise_multiplier",
    "parameter_groups",
    "validate_max_grad_norm",
]
