"""``opacus.grad_sample.gsm_exp_weights``: ``GradSampleModuleExpandedWeights``, here the hooks wrapper
(the same exact per-sample gradients; see ``privacy_engine.opacus.grad_sample``)."""

from privacy_engine.opacus.grad_sample import GradSampleModuleExpandedWeights

__all__ = ["GradSampleModuleExpandedWeights"]
