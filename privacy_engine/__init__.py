"""privacy-engine: differentially private training for PyTorch.

Data path: module -> hooks (GradSampleModule) -> samplers (grad_samplers) -> clipper -> noise ->
optimizer -> accountant (accountants) -> engine (PrivacyEngine).
"""

from privacy_engine.clipper import ClippingConfig, ClippingStats, PerSampleGradientClipper, parameter_groups
from privacy_engine.engine import BandCandidate, NoisePlan, PrivacyEngine
from privacy_engine.ghost_clipping import GhostClippingModule
from privacy_engine.grad_sample_module import GradSampleModule, ParameterUsageError, per_sample_gradients
from privacy_engine.noise import BandMFNoise, GaussianNoise, NoiseMechanism
from privacy_engine.optimizer import DPOptimizer
from privacy_engine.sampling import DPDataLoader
from privacy_engine.validation import UnsupportedModuleError
from privacy_engine.virtual_steps import BatchMemoryManager, VirtualSteps

__all__ = [
    "BandCandidate",
    "BandMFNoise",
    "BatchMemoryManager",
    "ClippingConfig",
    "ClippingStats",
    "DPDataLoader",
    "DPOptimizer",
    "GaussianNoise",
    "GhostClippingModule",
    "GradSampleModule",
    "NoiseMechanism",
    "NoisePlan",
    "ParameterUsageError",
    "PerSampleGradientClipper",
    "PrivacyEngine",
    "UnsupportedModuleError",
    "VirtualSteps",
    "parameter_groups",
    "per_sample_gradients",
]
