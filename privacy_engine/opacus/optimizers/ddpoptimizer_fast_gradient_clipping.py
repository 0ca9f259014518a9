"""``opacus.optimizers.ddpoptimizer_fast_gradient_clipping``: ``DistributedDPOptimizerFastGradientClipping``,
the same ``DistributedDPOptimizer`` (fast clipping happens in the backward pass, not in the optimizer)."""

from privacy_engine.opacus.optimizers.ddpoptimizer import DistributedDPOptimizer

__all__ = ["DistributedDPOptimizerFastGradientClipping"]

#: Fast clipping uses the same distributed optimizer.
DistributedDPOptimizerFastGradientClipping = DistributedDPOptimizer
