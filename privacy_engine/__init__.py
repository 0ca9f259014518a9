"""privacy-engine: differentially private training for PyTorch.

Data path, one folder each: ``batches/`` (the ticket of each drawn batch) -> ``capture/`` (GradSampleModule: hooks, the torch.func fallback) ->
``grad_samplers/`` (per-layer samplers) -> ``clipping/`` (the rule, the materialised clipper, fast
clipping in ``clipping/ghost/``) -> ``noise/`` (Gaussian, BandMF) -> ``training/`` (DPOptimizer, the
loop contract, private data loaders, distributed) -> ``accountants/`` -> ``engine/`` (PrivacyEngine:
options -> plan -> build -> ledger). ``models/`` makes a model trainable (validation, fixer).

``accountants`` and ``grad_samplers`` live at the repository's top level and install as top-level
packages; ``privacy_engine.accountants`` and ``privacy_engine.grad_samplers`` are the same module
objects under the package's name (``privacy_engine._namespaced``).
"""

# The one place the version is written: setup.py reads it from this line, CHANGELOG.md names it.
__version__ = "0.1.0"

# First, so that any later import of privacy_engine.accountants / .grad_samplers finds the alias.
from privacy_engine import _namespaced

_namespaced.install()

from accountants import CalibrationError
from privacy_engine import accountants as accountants
from privacy_engine import grad_samplers as grad_samplers
from privacy_engine.auditing import CanaryScoreAuditor, GradientCanaries
from privacy_engine.batches.tickets import BatchTicket, move_to
from privacy_engine.capture import GradSampleModule, ParameterUsageError, per_sample_gradients
from privacy_engine.clipping import ClippingConfig, ClippingStats, PerSampleGradientClipper, parameter_groups
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.engine import BandCandidate, NoisePlan, PrivacyEngine, PrivacyOptions
from privacy_engine.engine.budget import PrivacyBudget, PrivacyBudgetExceeded
from privacy_engine.engine.connect import connect_private
from privacy_engine.losses import per_example_token_cross_entropy
from privacy_engine.models.fixer import FixReport, ModuleValidator, fix_module
from privacy_engine.models.validation import InteractingExamplesError, UnsupportedModuleError
from privacy_engine.noise import BandMFNoise, GaussianNoise, NoiseMechanism
from privacy_engine.training.data_loader import DPDataLoader
from privacy_engine.training.distributed import PrivateDataParallel
from privacy_engine.training.optimizer import DPOptimizer
from privacy_engine.training.step_contract import StepContract
from privacy_engine.training.virtual_steps import VirtualSteps

__all__ = [
    "BandCandidate",
    "BandMFNoise",
    "BatchTicket",
    "CalibrationError",
    "CanaryScoreAuditor",
    "ClippingConfig",
    "ClippingStats",
    "DPDataLoader",
    "DPOptimizer",
    "FixReport",
    "GaussianNoise",
    "GhostClippingModule",
    "GradSampleModule",
    "GradientCanaries",
    "InteractingExamplesError",
    "ModuleValidator",
    "NoiseMechanism",
    "NoisePlan",
    "ParameterUsageError",
    "PerSampleGradientClipper",
    "PrivacyBudget",
    "PrivacyBudgetExceeded",
    "PrivacyEngine",
    "PrivacyOptions",
    "PrivateDataParallel",
    "StepContract",
    "UnsupportedModuleError",
    "VirtualSteps",
    "connect_private",
    "fix_module",
    "move_to",
    "parameter_groups",
    "per_example_token_cross_entropy",
    "per_sample_gradients",
]
