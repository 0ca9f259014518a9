"""``opacus.grad_sample.grad_sample_module``: ``GradSampleModule`` (see ``privacy_engine.opacus.grad_sample``)."""

from privacy_engine.opacus.grad_sample import GradSampleModule

__all__ = ["GradSampleModule"]
