"""privacy-engine: differentially private training for PyTorch.

Data path: module -> hooks (GradSampleModule) -> samplers (grad_samplers) -> clipper -> noise ->
optimizer -> accountant (accountants) -> engine (PrivacyEngine).
"""

from privacy_engine.budget import PrivacyBudget, PrivacyBudgetExceeded
from privacy_engine.clipper import ClippingConfig, ClippingStats, PerSampleGradientClipper, parameter_groups
from privacy_engine.distributed import DifferentiallyPrivateDistributedDataParallel
from privacy_engine.engine import BandCandidate, NoisePlan, PrivacyEngine
from privacy_engine.fixer import FixReport, ModuleValidator, fix_module
from privacy_engine.ghost_clipping import GhostClippingModule
from privacy_engine.grad_sample_module import GradSampleModule, ParameterUsageError, per_sample_gradients
from privacy_engine.noise import BandMFNoise, GaussianNoise, NoiseMechanism
from privacy_engine.optimizer import DPOptimizer
from privacy_engine.sampling import DPDataLoader
from privacy_engine.step_contract import BatchTicket, StepContract, move_to
from privacy_engine.validation import UnsupportedModuleError
from privacy_engine.virtual_steps import BatchMemoryManager, VirtualSteps

__all__ = [
    "BandCandidate",
    "BandMFNoise",
    "BatchTicket",
    "BatchMemoryManager",
    "ClippingConfig",
    "ClippingStats",
    "DPDataLoader",
    "DPOptimizer",
    "DifferentiallyPrivateDistributedDataParallel",
    "FixReport",
    "GaussianNoise",
    "GhostClippingModule",
    "GradSampleModule",
    "ModuleValidator",
    "NoiseMechanism",
    "NoisePlan",
    "ParameterUsageError",
    "PerSampleGradientClipper",
    "PrivacyBudget",
    "PrivacyBudgetExceeded",
    "PrivacyEngine",
    "StepContract",
    "UnsupportedModuleError",
    "VirtualSteps",
    "fix_module",
    "move_to",
    "parameter_groups",
    "per_sample_gradients",
]
