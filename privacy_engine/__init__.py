"""privacy-engine: differentially private training for PyTorch.

Data path, one folder each: ``capture/`` (GradSampleModule: hooks, the torch.func fallback) ->
``grad_samplers/`` (per-layer samplers) -> ``clipping/`` (the rule, the materialised clipper, fast
clipping in ``clipping/ghost/``) -> ``noise/`` (Gaussian, BandMF) -> ``training/`` (DPOptimizer, the
loop contract, private data loaders, distributed) -> ``accountants/`` -> ``engine/`` (PrivacyEngine:
options -> plan -> build -> ledger). ``models/`` makes a model trainable (fixer, DP recurrent layers).
"""

from privacy_engine.capture import GradSampleModule, ParameterUsageError, per_sample_gradients
from privacy_engine.clipping import ClippingConfig, ClippingStats, PerSampleGradientClipper, parameter_groups
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.engine import BandCandidate, NoisePlan, PrivacyEngine
from privacy_engine.engine.budget import PrivacyBudget, PrivacyBudgetExceeded
from privacy_engine.losses import per_example_token_cross_entropy
from privacy_engine.models.fixer import FixReport, ModuleValidator, fix_module
from privacy_engine.models.validation import InteractingExamplesError, UnsupportedModuleError
from privacy_engine.noise import BandMFNoise, GaussianNoise, NoiseMechanism
from privacy_engine.training.batch_tickets import BatchTicket, move_to
from privacy_engine.training.data_loader import DPDataLoader
from privacy_engine.training.distributed import DifferentiallyPrivateDistributedDataParallel
from privacy_engine.training.optimizer import DPOptimizer
from privacy_engine.training.step_contract import StepContract
from privacy_engine.training.virtual_steps import BatchMemoryManager, VirtualSteps

__all__ = [
    "BandCandidate",
    "BandMFNoise",
    "BatchMemoryManager",
    "BatchTicket",
    "ClippingConfig",
    "ClippingStats",
    "DPDataLoader",
    "DPOptimizer",
    "DifferentiallyPrivateDistributedDataParallel",
    "FixReport",
    "GaussianNoise",
    "GhostClippingModule",
    "GradSampleModule",
    "InteractingExamplesError",
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
    "per_example_token_cross_entropy",
    "per_sample_gradients",
]
