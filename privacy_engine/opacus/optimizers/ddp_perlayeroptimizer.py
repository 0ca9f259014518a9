"""``opacus.optimizers.ddp_perlayeroptimizer``: Opacus's two distributed per-layer optimizers, both
``DistributedDPOptimizer`` with ``clipping="per_layer"`` (the engine clips per layer the same way
whatever the number of processes; see ``privacy_engine.opacus.optimizers.ddpoptimizer``)."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from privacy_engine.opacus.optimizers.ddpoptimizer import DistributedDPOptimizer

__all__ = ["DistributedPerLayerOptimizer", "SimpleDistributedPerLayerOptimizer"]


class DistributedPerLayerOptimizer(DistributedDPOptimizer):
    """``DistributedDPOptimizer`` clipping each parameter with its own bound (``max_grad_norm``: one
    bound per parameter, or one number split over the layers)."""

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float, max_grad_norm: Any, **kwargs: Any) -> None:
        kwargs.setdefault("clipping", "per_layer")
        super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, **kwargs)


#: Opacus's other distributed per-layer optimizer: here the same class (its difference in Opacus is
#: where the clipping runs, which the engine decides itself).
SimpleDistributedPerLayerOptimizer = DistributedPerLayerOptimizer
