"""``opacus.grad_sample.linear``: Opacus's names for the engine's ``nn.Linear`` samplers
(``grad_samplers.linear``), for scripts that register them for their own layers."""

from grad_samplers.linear import linear_grad_sample as compute_linear_grad_sample
from grad_samplers.linear import linear_norm_sample as compute_linear_norm_sample

__all__ = ["compute_linear_grad_sample", "compute_linear_norm_sample"]
