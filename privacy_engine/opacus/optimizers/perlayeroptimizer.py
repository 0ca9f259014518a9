"""``opacus.optimizers.perlayeroptimizer``: ``DPPerLayerOptimizer`` (``DPOptimizer`` with
``clipping="per_layer"``; see ``privacy_engine.opacus.optimizers.optimizer``)."""

from privacy_engine.opacus.optimizers.optimizer import DPPerLayerOptimizer

__all__ = ["DPPerLayerOptimizer"]
