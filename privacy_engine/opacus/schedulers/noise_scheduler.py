"""``opacus.schedulers.noise_scheduler``: the noise-multiplier schedules (``privacy_engine.training.schedules``)."""

from privacy_engine.training.schedules import ExponentialNoise, LambdaNoise, NoiseScheduler, StepNoise

#: Opacus's name of the base class (subclass it and implement ``get_noise_multiplier``).
_NoiseScheduler = NoiseScheduler

__all__ = ["ExponentialNoise", "LambdaNoise", "StepNoise", "_NoiseScheduler"]
