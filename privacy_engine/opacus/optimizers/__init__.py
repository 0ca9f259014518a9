"""``opacus.optimizers``: the engine's ``DPOptimizer`` under Opacus's names.

Opacus has one optimizer class per clipping mode and setting; here one ``DPOptimizer`` covers them
(``clipping="flat"`` or ``"per_layer"``; ghost mode and distributed training use it too), so the
other names map onto it. Adaptive clipping: ``AdaClipDPOptimizer`` (``adaclipoptimizer.py``), on the
engine's ``privacy_engine.clipping.adaptive``.
"""

from __future__ import annotations

from privacy_engine.opacus.optimizers.adaclipoptimizer import AdaClipDPOptimizer
from privacy_engine.opacus.optimizers.ddp_perlayeroptimizer import (
    DistributedPerLayerOptimizer,
    SimpleDistributedPerLayerOptimizer,
)
from privacy_engine.opacus.optimizers.ddpoptimizer import DistributedDPOptimizer
from privacy_engine.opacus.optimizers.ddpoptimizer_fast_gradient_clipping import (
    DistributedDPOptimizerFastGradientClipping,
)
from privacy_engine.opacus.optimizers.optimizer import DPOptimizer, DPPerLayerOptimizer
from privacy_engine.opacus.optimizers.optimizer_fast_gradient_clipping import DPOptimizerFastGradientClipping
from privacy_engine.settings_checks import check_clipping

__all__ = [
    "AdaClipDPOptimizer",
    "DPOptimizer",
    "DPOptimizerFastGradientClipping",
    "DPPerLayerOptimizer",
    "DistributedDPOptimizer",
    "DistributedDPOptimizerFastGradientClipping",
    "DistributedPerLayerOptimizer",
    "SimpleDistributedPerLayerOptimizer",
    "get_optimizer_class",
]

def get_optimizer_class(clipping: str, distributed: bool, grad_sample_mode: str | None = None) -> type:
    """Opacus's lookup of the optimizer class; here ``DPOptimizer`` (or ``DPPerLayerOptimizer``,
    ``AdaClipDPOptimizer`` for ``clipping="adaptive"``)."""
    if clipping == "adaptive":
        return AdaClipDPOptimizer
    if distributed:
        return DistributedPerLayerOptimizer if check_clipping(clipping) == "per_layer" else DistributedDPOptimizer
    return DPPerLayerOptimizer if check_clipping(clipping) == "per_layer" else DPOptimizer
