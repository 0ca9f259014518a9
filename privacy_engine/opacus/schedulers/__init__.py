"""``opacus.schedulers``: noise and clip-norm schedules with Opacus's names, on the engine's schedulers.

``ExponentialNoise``, ``LambdaNoise``, ``StepNoise`` set ``optimizer.noise_multiplier`` and
``ExponentialGradClip``, ``LambdaGradClip``, ``StepGradClip`` set ``optimizer.max_grad_norm`` at each
``step()``, as Opacus's do; ``_NoiseScheduler`` and ``_GradClipScheduler`` are the base classes to subclass
(implement ``get_noise_multiplier`` / ``get_max_grad_norm``). They are ``privacy_engine.training.schedules``'s
classes. Differences from Opacus: the epsilon is dp-accounting's composition of the steps that ran at their
sigma (Opacus's accountant hook records each step at the sigma in force too); a sigma schedule with BandMF, a
clip schedule with adaptive clipping or with clipped sums waiting for the release are refused with an error;
``state_dict()`` leaves out functions (``noise_lambda``, ``scheduler_function``), so it loads with
``torch.load(weights_only=True)``.
"""

from privacy_engine.opacus.schedulers.grad_clip_scheduler import (
    ExponentialGradClip,
    LambdaGradClip,
    StepGradClip,
    _GradClipScheduler,
)
from privacy_engine.opacus.schedulers.noise_scheduler import ExponentialNoise, LambdaNoise, StepNoise, _NoiseScheduler

__all__ = [
    "ExponentialGradClip",
    "ExponentialNoise",
    "LambdaGradClip",
    "LambdaNoise",
    "StepGradClip",
    "StepNoise",
    "_GradClipScheduler",
    "_NoiseScheduler",
]
