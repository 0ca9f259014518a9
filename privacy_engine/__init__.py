"""privacy-engine: differentially private training for PyTorch.

Data path: module -> hooks (GradSampleModule) -> samplers (grad_samplers) -> clipper -> noise ->
optimizer -> accountant (accountants) -> engine (PrivacyEngine).
"""

from privacy_engine.grad_sample_module import GradSampleModule, ParameterUsageError, per_sample_gradients
from privacy_engine.validation import UnsupportedModuleError

__all__ = [
    "GradSampleModule",
    "ParameterUsageError",
    "UnsupportedModuleError",
    "per_sample_gradients",
]
