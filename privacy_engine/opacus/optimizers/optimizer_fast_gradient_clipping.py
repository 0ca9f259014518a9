"""``opacus.optimizers.optimizer_fast_gradient_clipping``: ``DPOptimizerFastGradientClipping``, the
same ``DPOptimizer`` (fast clipping happens in the backward pass, not in the optimizer)."""

from privacy_engine.opacus.optimizers.optimizer import DPOptimizer

__all__ = ["DPOptimizerFastGradientClipping"]

#: Fast clipping uses the same optimizer (the clipping happens in the backward pass).
DPOptimizerFastGradientClipping = DPOptimizer
