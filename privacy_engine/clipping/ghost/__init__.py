"""Fast ("ghost") clipping: per-example clipped gradient sums in one backward pass, without
materialising per-example gradients where a layer allows it. See ``module.py``."""

from privacy_engine.clipping.ghost.module import GhostClippingModule

__all__ = ["GhostClippingModule"]
