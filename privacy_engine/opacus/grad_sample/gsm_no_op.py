"""``opacus.grad_sample.gsm_no_op``: ``GradSampleModuleNoOp`` (see ``privacy_engine.opacus.grad_sample``)."""

from privacy_engine.opacus.grad_sample import GradSampleModuleNoOp

__all__ = ["GradSampleModuleNoOp"]
