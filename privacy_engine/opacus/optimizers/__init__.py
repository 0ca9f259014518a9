"""``opacus.optimizers``: the engine's ``DPOptimizer`` under Opacus's names.

Opacus has one optimizer class per clipping mode and setting; here one ``DPOptimizer`` covers them
(``clipping="flat"`` or ``"per_layer"``; ghost mode and distributed training use it too), so the
other names map onto it. Adaptive clipping (``AdaClipDPOptimizer``) is not provided.
"""

from __future__ import annotations

from privacy_engine.opacus._lazy import lazy_attribute, unavailable
from privacy_engine.opacus.optimizers.optimizer import DPOptimizer, DPPerLayerOptimizer

__all__ = [
    "AdaClipDPOptimizer",
    "DPOptimizer",
    "DPOptimizerFastGradientClipping",
    "DPPerLayerOptimizer",
    "DistributedDPOptimizer",
    "get_optimizer_class",
]

#: Fast clipping uses the same optimizer (the clipping happens in the backward pass).
DPOptimizerFastGradientClipping = DPOptimizer

AdaClipDPOptimizer = unavailable(
    "AdaClipDPOptimizer",
    "adaptive clipping (Opacus's AdaClipDPOptimizer, clipping='adaptive') is not supported by privacy_engine: "
    "use clipping='flat' or 'per_layer' with a fixed max_grad_norm",
)


def __getattr__(name: str):
    if name == "DistributedDPOptimizer":
        return lazy_attribute(name, "privacy_engine.training.distributed", ("DistributedDPOptimizer",),
                              "distributed DP-SGD")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_optimizer_class(clipping: str, distributed: bool, grad_sample_mode: str | None = None) -> type:
    """Opacus's lookup of the optimizer class; here ``DPOptimizer`` (or ``DPPerLayerOptimizer``)."""
    if clipping == "adaptive":
        return AdaClipDPOptimizer
    if distributed:
        return __getattr__("DistributedDPOptimizer")
    if clipping == "per_layer":
        return DPPerLayerOptimizer
    if clipping == "flat":
        return DPOptimizer
    raise ValueError(f"clipping must be 'flat' or 'per_layer'; got {clipping!r}")
