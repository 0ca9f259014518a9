"""Wrap-time checks: modules whose per-sample gradient is undefined or unsafe to compute.

Each problem is reported with the module's path and what to do instead. Checks run before anything is
attached, so a model that fails them is left exactly as it was.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class UnsupportedModuleError(ValueError):
    """The model contains a module whose per-sample gradients cannot be computed safely."""


def module_label(path: str) -> str:
    return repr(path) if path else "the top-level module"


def batchnorm_problem(path: str, module: nn.Module) -> str:
    return (
        f"{module_label(path)} is {type(module).__name__} in training mode: its output mixes the examples "
        f"of a batch, so a per-example gradient is undefined. Replace it with "
        f"nn.GroupNorm(num_groups, {getattr(module, 'num_features', 'num_channels')}) "
        f"(or put it in eval mode and freeze it)."
    )


def find_problems(model: nn.Module) -> list[str]:
    """Every reason this model cannot be wrapped, one line per offending module."""
    problems: list[str] = []
    for path, module in model.named_modules():
        if isinstance(module, _BatchNorm) and module.training:
            problems.append(batchnorm_problem(path, module))
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            if module.max_norm is not None:
                problems.append(
                    f"{module_label(path)} is {type(module).__name__}(max_norm={module.max_norm}): it renormalises "
                    f"its weight in place during forward, which per-sample gradients cannot follow. "
                    f"Construct it with max_norm=None."
                )
            if module.scale_grad_by_freq:
                problems.append(
                    f"{module_label(path)} is {type(module).__name__}(scale_grad_by_freq=True): the scaling uses "
                    f"word counts over the whole batch, so one example's gradient depends on the others. "
                    f"Construct it with scale_grad_by_freq=False."
                )
            if isinstance(module, nn.EmbeddingBag) and module.mode == "max":
                problems.append(
                    f"{module_label(path)} is EmbeddingBag(mode='max'): no per-sample gradient sampler "
                    f"supports it. Use mode='sum' or mode='mean'."
                )
            if module.sparse:
                problems.append(
                    f"{module_label(path)} is {type(module).__name__}(sparse=True): sparse gradients are not "
                    f"supported. Construct it with sparse=False."
                )
    return problems
