"""``opacus.grad_sample.grad_sample_module_fast_gradient_clipping``: ``GradSampleModuleFastGradientClipping``
(see ``privacy_engine.opacus.grad_sample``)."""

from privacy_engine.opacus.grad_sample import GradSampleModuleFastGradientClipping

__all__ = ["GradSampleModuleFastGradientClipping"]
