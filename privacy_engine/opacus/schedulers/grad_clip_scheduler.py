"""``opacus.schedulers.grad_clip_scheduler``: the clip-norm schedules (``privacy_engine.training.schedules``)."""

from privacy_engine.training.schedules import ExponentialGradClip, GradClipScheduler, LambdaGradClip, StepGradClip

#: Opacus's name of the base class (subclass it and implement ``get_max_grad_norm``).
_GradClipScheduler = GradClipScheduler

__all__ = ["ExponentialGradClip", "LambdaGradClip", "StepGradClip", "_GradClipScheduler"]
