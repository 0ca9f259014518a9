"""Wrap-time checks: modules whose per-sample gradient is undefined or unsafe to compute.

Each problem is reported with the module's path and what to do instead. Checks run before anything is
attached, so a model that fails them is left exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm


class UnsupportedModuleError(ValueError):
    """The model contains a module whose per-sample gradients cannot be computed safely."""


class InteractingExamplesError(UnsupportedModuleError):
    """Examples of a batch interact in the forward or in the loss: one example's gradient depends on the
    others, so clipping it does not bound that example's influence on the step (DP-SGD's assumption)."""


def module_label(path: str, module: nn.Module | None = None) -> str:
    """How messages name a submodule: its path in ``named_modules()`` and, when given, its class.

    ``module_label("0", nn.Linear(2, 3))`` is ``"'0' (Linear)"``; ``module_label("")`` is ``"the
    top-level module"``; without ``module``, the path alone (``"'0'"``).
    """
    label = repr(path) if path else "the top-level module"
    return label if module is None else f"{label} ({type(module).__name__})"


def submodule_label(root: nn.Module, path: str | None) -> str:
    """``module_label`` of the submodule of ``root`` at ``path``, with its class when it exists (a path
    that names none, or None, gives the path alone: ``'?'`` for None)."""
    if path is None:
        return module_label("?")
    try:
        module = root.get_submodule(path)
    except AttributeError:
        module = None
    return module_label(path, module)


def batchnorm_problem(path: str, module: nn.Module) -> str:
    """The message for a batch-norm layer in training mode at ``path``, naming the replacement."""
    return (
        f"{module_label(path)} is {type(module).__name__} in training mode: its output mixes the examples "
        f"of a batch, so a per-example gradient is undefined. Replace it with "
        f"nn.GroupNorm(num_groups, {getattr(module, 'num_features', 'num_channels')}): "
        f"`model, report = privacy_engine.fix_module(model)` replaces every BatchNorm of the model (affine "
        f"parameters carried over) before make_private; or put it in eval mode and freeze it."
    )


@dataclass(frozen=True)
class Problem:
    """One reason a module cannot be trained privately as it is.

    ``kind`` (one error class each, as Opacus has): ``"replace"`` (replace the module: ``fix_module`` does),
    ``"configuration"`` (a setting to change: ``fix_module`` does where that keeps the model's meaning),
    ``"unsupportable"`` (no per-sample gradient exists), ``"not_yet_supported"``. ``blocking``: wrapping
    refuses the model (False: it trains, but something about it is not private, see the message).
    """

    path: str
    kind: str
    message: str
    blocking: bool = True

    def __str__(self) -> str:
        return self.message


def module_problems(path: str, module: nn.Module) -> list[Problem]:
    """Every problem of ``module`` itself (not its children), labelled with ``path``."""
    problems: list[Problem] = []
    label = module_label(path)
    kind = type(module).__name__
    if isinstance(module, _BatchNorm) and module.training:
        problems.append(Problem(path, "replace", batchnorm_problem(path, module)))
    if isinstance(module, _InstanceNorm) and module.track_running_stats:
        # Blocking while training (as in Opacus): every training forward folds the batch's statistics,
        # un-noised, into buffers that leave with the model. In eval mode the buffers are only read.
        problems.append(
            Problem(
                path,
                "configuration",
                f"{label} is {kind}(track_running_stats=True): training updates its running statistics from the "
                f"batch's examples without noise, and eval mode uses them, so a released model leaks them. "
                f"Construct it with track_running_stats=False (fix_module does).",
                blocking=module.training,
            )
        )
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        if module.max_norm is not None:
            problems.append(
                Problem(
                    path,
                    "unsupportable",
                    f"{label} is {kind}(max_norm={module.max_norm}): every forward renormalises, in place and "
                    f"outside autograd, the weight rows its batch looks up. Which rows are rewritten depends on "
                    f"the private examples (the tokens they contain), and that change leaves with the model with "
                    f"no clipping and no noise, whatever the per-sample gradients. Construct it with "
                    f"max_norm=None (fix_module leaves it: that changes the model); to bound the vectors, rescale "
                    f"the looked-up vectors in the forward instead, out of place "
                    f"(v * (max_norm / v.norm(dim=-1, keepdim=True)).clamp(max=1)).",
                )
            )
        if module.scale_grad_by_freq:
            problems.append(
                Problem(
                    path,
                    "configuration",
                    f"{label} is {kind}(scale_grad_by_freq=True): the scaling uses "
                    f"word counts over the whole batch, so one example's gradient depends on the others. "
                    f"Construct it with scale_grad_by_freq=False.",
                )
            )
        if isinstance(module, nn.EmbeddingBag) and module.mode == "max":
            problems.append(
                Problem(
                    path,
                    "not_yet_supported",
                    f"{label} is EmbeddingBag(mode='max'): no per-sample gradient sampler "
                    f"supports it. Use mode='sum' or mode='mean'.",
                )
            )
        if module.sparse:
            problems.append(
                Problem(
                    path,
                    "configuration",
                    f"{label} is {kind}(sparse=True): sparse gradients are not "
                    f"supported. Construct it with sparse=False.",
                )
            )
    return problems


def find_all_problems(model: nn.Module) -> list[Problem]:
    """Every problem of every module of ``model``, blocking or not, in module order."""
    return [problem for path, module in model.named_modules() for problem in module_problems(path, module)]


def find_problems(model: nn.Module) -> list[str]:
    """Every reason this model cannot be wrapped, one line per offending module problem."""
    return [problem.message for problem in find_all_problems(model) if problem.blocking]
