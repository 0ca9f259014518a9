"""Make a model trainable with per-sample gradients, and say what was changed and what is left.

``fix_module(model)`` returns a fixed copy of the model and a ``FixReport``:

- every ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` becomes a ``GroupNorm`` over the same channels, with
  the BatchNorm's affine weight and bias (and their ``requires_grad``) carried over. BatchNorm normalises
  each example with statistics of the whole batch, so an example's gradient depends on the others;
  GroupNorm uses each example's own statistics. The group count is ``gcd(32, channels)`` (Wu & He 2018,
  and what Opacus picks) for 2-D/3-D BatchNorm; for ``BatchNorm1d``, whose input may be ``(batch,
  channels)`` with no positions, it is the largest divisor of the channel count that is at most 32 and
  leaves at least two channels per group (a group of one value would normalise to 0);
- ``InstanceNorm*(track_running_stats=True)`` becomes the same layer without running statistics (they
  average the batch's examples without noise and would be released with the model);
- ``Embedding``/``EmbeddingBag`` with ``sparse=True`` or ``scale_grad_by_freq=True`` get those off.

Everything else that still stands in the way (``Embedding(max_norm=...)``, ``EmbeddingBag(mode="max")``,
a module a registered validator rejects) is listed in the report; nothing is changed silently. Fixing a
fixed model changes nothing (idempotent).

``ModuleValidator`` (``validate``, ``is_valid``, ``fix``, ``fix_and_validate``), the decorators
``register_module_validator``/``register_module_fixer`` and the error classes take the same names and
signatures as Opacus 1.6's, so a script's validator or fixer plugin registers here unchanged.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from privacy_engine.capture.common import HOOKED_MODULES
from privacy_engine.capture.module import GradSampleModule
from privacy_engine.models.validation import (
    Problem,
    UnsupportedModuleError,
    find_all_problems,
    module_label,
    module_problems,
)

logger = logging.getLogger(__name__)

__all__ = [
    "FixReport",
    "IllegalModuleConfigurationError",
    "ModuleValidator",
    "NotYetSupportedModuleError",
    "ShouldReplaceModuleError",
    "UnsupportableModuleError",
    "UnsupportedModuleError",
    "fix_module",
    "register_module_fixer",
    "register_module_validator",
]


# ---------------------------------------------------------------------------------- error classes (one per Problem.kind)
class UnsupportableModuleError(UnsupportedModuleError):
    """A module whose per-sample gradients cannot exist (it mixes examples, or renormalises in place)."""


class NotYetSupportedModuleError(UnsupportedModuleError):
    """A module no per-sample gradient rule covers yet."""


class ShouldReplaceModuleError(UnsupportedModuleError):
    """A module to replace by a private-friendly one (``fix_module`` / ``ModuleValidator.fix`` do)."""


class IllegalModuleConfigurationError(UnsupportedModuleError):
    """A setting to change (training mode off, running statistics kept, sparse gradients, ...)."""


_ERROR_OF_KIND: dict[str, type[UnsupportedModuleError]] = {
    "replace": ShouldReplaceModuleError,
    "configuration": IllegalModuleConfigurationError,
    "unsupportable": UnsupportableModuleError,
    "not_yet_supported": NotYetSupportedModuleError,
}


# ---------------------------------------------------------------------------------- the report
@dataclass(frozen=True)
class FixReport:
    """What ``fix_module`` changed (one line per module) and every problem left (one line each)."""

    changes: tuple[str, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Whether nothing is left in the way of private training."""
        return not self.problems

    def __str__(self) -> str:
        lines = [f"fix_module: {len(self.changes)} change(s), {len(self.problems)} problem(s) left"]
        lines.append("changed:" if self.changes else "changed: nothing")
        lines.extend(f"- {change}" for change in self.changes)
        lines.append("problems left:" if self.problems else "problems left: none")
        lines.extend(f"- {problem}" for problem in self.problems)
        return "\n".join(lines)


# ---------------------------------------------------------------------------------- built-in fixers
# Each takes (path, module, options) and returns (fix, description): a replacement module, a _Reconfigured
# (same module, attributes changed), or the module itself with description None when there is nothing to fix.
_Fix = Callable[[str, nn.Module, dict], tuple[object, str | None]]


def _factory_kwargs(module: nn.Module) -> dict[str, Any]:
    reference = next(iter(module.parameters()), None)
    if reference is None:
        reference = next(iter(module.buffers()), None)
    return {} if reference is None else {"device": reference.device, "dtype": reference.dtype}


def _copy_affine(source: nn.Module, target: nn.Module) -> None:
    with torch.no_grad():
        for name in ("weight", "bias"):
            old, new = getattr(source, name, None), getattr(target, name, None)
            if isinstance(old, nn.Parameter) and isinstance(new, nn.Parameter):
                new.copy_(old)
                new.requires_grad_(old.requires_grad)


def default_group_count(module: _BatchNorm) -> int:
    """The GroupNorm group count that replaces ``module`` (see the module docstring)."""
    channels = module.num_features
    if not isinstance(module, nn.BatchNorm1d):
        return math.gcd(32, channels)
    divisors = [g for g in range(1, min(32, channels) + 1) if channels % g == 0 and channels // g >= 2]
    return max(divisors) if divisors else 1


def _batchnorm_replacement(path: str, module: nn.Module, options: dict) -> tuple[nn.Module, str | None]:
    mode = "eval mode, with its running statistics" if not module.training else "training mode"
    if options.get("replace_bn_with_in"):
        dims = {nn.BatchNorm1d: nn.InstanceNorm1d, nn.BatchNorm2d: nn.InstanceNorm2d, nn.BatchNorm3d: nn.InstanceNorm3d}
        instance_norm = dims.get(type(module))
        if instance_norm is None:
            raise UnsupportableModuleError(
                f"{module_label(path)} is {type(module).__name__}: no InstanceNorm has its input layout; fix it "
                f"without replace_bn_with_in (GroupNorm)"
            )
        replacement = instance_norm(module.num_features, eps=module.eps, affine=module.affine, **_factory_kwargs(module))
    else:
        groups = options.get("num_groups") or default_group_count(module)
        replacement = nn.GroupNorm(groups, module.num_features, eps=module.eps, affine=module.affine, **_factory_kwargs(module))
    _copy_affine(module, replacement)
    replacement.train(module.training)
    carried = "affine weight and bias carried over; " if module.affine else ""
    return replacement, (
        f"{module_label(path)}: {type(module).__name__}({module.num_features}) ({mode}) -> {replacement!r}: {carried}"
        f"each example is now normalised with its own statistics (running statistics dropped)"
    )


def _instance_norm_without_running_stats(path: str, module: nn.Module, options: dict) -> tuple[nn.Module, str | None]:
    if not module.track_running_stats:
        return module, None
    replacement = type(module)(
        module.num_features, eps=module.eps, momentum=module.momentum, affine=module.affine,
        track_running_stats=False, **_factory_kwargs(module),
    )  # fmt: skip
    _copy_affine(module, replacement)
    replacement.train(module.training)
    return replacement, (
        f"{module_label(path)}: {type(module).__name__}(track_running_stats=True) -> track_running_stats=False: "
        f"running statistics (averaged over examples without noise) dropped; it normalises with each example's "
        f"own statistics in eval mode too"
    )


def _embedding_settings(path: str, module: nn.Module, options: dict) -> tuple[object, str | None]:
    changed = [name for name in ("sparse", "scale_grad_by_freq") if getattr(module, name)]
    if not changed:
        return module, None
    # The same module with its flags off (set when the fixes are installed): its weight stays the same
    # Parameter, so nothing else about the model changes.
    notes = {"sparse": "dense gradients", "scale_grad_by_freq": "gradients no longer divided by batch-wide counts"}
    return _Reconfigured(module, {name: False for name in changed}), (
        f"{module_label(path)}: {type(module).__name__} "
        + ", ".join(f"{name}=True -> False ({notes[name]})" for name in changed)
    )


class _Reconfigured:
    """A fix that keeps the module and changes attributes (applied with the replacements)."""

    def __init__(self, module: nn.Module, settings: dict[str, Any]) -> None:
        self.module = module
        self.settings = settings

    def apply(self) -> nn.Module:
        for name, value in self.settings.items():
            setattr(self.module, name, value)
        return self.module


_BUILT_IN_FIXES: dict[type[nn.Module], _Fix] = {
    **{kind: _batchnorm_replacement for kind in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)},
    **{kind: _instance_norm_without_running_stats for kind in (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)},
    nn.Embedding: _embedding_settings,
    nn.EmbeddingBag: _embedding_settings,
}


# ---------------------------------------------------------------------------------- fix_module
def _check_fixable(model: nn.Module, options: dict) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"fix_module takes an nn.Module; got {type(model).__name__}")
    if isinstance(model, GradSampleModule) or any(m in HOOKED_MODULES for m in model.modules()):
        raise ValueError("the model is wrapped for per-sample gradients; fix the original model before wrapping it")
    num_groups = options.get("num_groups")
    if num_groups is not None:
        if options.get("replace_bn_with_in"):
            raise ValueError("num_groups and replace_bn_with_in=True exclude each other (GroupNorm or InstanceNorm)")
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
            raise ValueError(f"num_groups must be a positive int; got {num_groups!r}")
        for path, module in model.named_modules():
            if type(module) in _BUILT_IN_FIXES and isinstance(module, _BatchNorm) and module.num_features % num_groups:
                raise ValueError(
                    f"num_groups={num_groups} does not divide the {module.num_features} channels of "
                    f"{module_label(path, module)}; pick a divisor, or leave num_groups out"
                )


def fix_module(
    model: nn.Module, *, num_groups: int | None = None, replace_bn_with_in: bool = False, inplace: bool = False
) -> tuple[nn.Module, FixReport]:
    """Replace or reconfigure every module that stands in the way of exact, private per-sample gradients;
    return ``(fixed_model, report)``.

    Guarantee: the returned model computes the same function as ``model`` except where the report says
    otherwise (one line per changed module: a BatchNorm's batch statistics become each example's own
    GroupNorm statistics; running statistics are dropped; embedding gradient flags are turned off), its
    parameters keep their values and ``requires_grad``, and ``report.problems`` lists everything that
    still stands in the way (``validation.find_all_problems`` plus registered validators). Fixing again
    changes nothing. ``model`` itself is untouched unless ``inplace=True``; an optimizer built over the old
    parameters must be rebuilt (replaced layers have new parameters).

    ======================================  =================================================
    case                                    result
    ======================================  =================================================
    BatchNorm1d/2d/3d, SyncBatchNorm        GroupNorm (``num_groups`` or the default count),
                                            affine parameters carried over
    ``replace_bn_with_in=True``             InstanceNorm instead (SyncBatchNorm: error)
    InstanceNorm, track_running_stats=True  same layer without running statistics
    Embedding sparse / scale_grad_by_freq   flag turned off
    Embedding max_norm, EmbeddingBag max    left, listed in ``report.problems``
    a type with a registered fixer          the fixer's result replaces it
    module shared at two paths              one replacement, installed at both
    the model itself is a BatchNorm         the returned model is its replacement
    ``num_groups`` not dividing a           ValueError naming the layer, nothing changed
    BatchNorm's channels
    model wrapped (GradSampleModule)        ValueError: fix before wrapping
    ======================================  =================================================
    """
    options = {"num_groups": num_groups, "replace_bn_with_in": replace_bn_with_in}
    _check_fixable(model, options)
    root = model if inplace else copy.deepcopy(model)
    # Decide every fix first (a fixer that raises leaves an in-place model unchanged), then install them.
    fixes: dict[int, tuple[object, str | None]] = {}
    locations: list[tuple[str, nn.Module]] = []
    for path, module in root.named_modules(remove_duplicate=False):
        if any(prefix == "" or path.startswith(prefix + ".") for prefix, _ in locations):
            continue  # inside a module being replaced: its replacement brings its own children
        if id(module) not in fixes:
            fixes[id(module)] = _replacement(path, module, options)
        if fixes[id(module)][0] is not module:
            locations.append((path, module))
    installed: dict[int, nn.Module] = {}
    changes: list[str] = []
    for path, module in locations:
        fix, description = fixes[id(module)]
        if id(module) not in installed:  # a module shared at several paths gets one replacement
            installed[id(module)] = fix.apply() if isinstance(fix, _Reconfigured) else fix
            changes.append(description or f"{module_label(path)}: {type(module).__name__} changed by a registered fixer")
        new_module = installed[id(module)]
        if path == "":
            root = new_module
        elif new_module is not module:
            parent_path, _, name = path.rpartition(".")
            parent = root.get_submodule(parent_path) if parent_path else root
            parent._modules[name] = new_module
    for change in changes:
        logger.info("fix_module: %s", change)
    return root, FixReport(changes=tuple(changes), problems=tuple(_remaining_problems(root)))


def _replacement(path: str, module: nn.Module, options: dict) -> tuple[object, str | None]:
    user_fixer = ModuleValidator.FIXERS.get(type(module))
    if user_fixer is not None:
        kwargs = {k: v for k, v in options.items() if v not in (None, False)}
        replacement = user_fixer(module, **kwargs)
        if not isinstance(replacement, nn.Module):
            raise TypeError(
                f"the fixer registered for {type(module).__name__} returned {type(replacement).__name__}; a fixer "
                f"must return an nn.Module"
            )
        if replacement is module:
            return module, None
        return replacement, (
            f"{module_label(path)}: {type(module).__name__} -> {type(replacement).__name__} (registered fixer)"
        )
    built_in = _BUILT_IN_FIXES.get(type(module))
    if built_in is None:
        return module, None
    return built_in(path, module, options)


def _remaining_problems(model: nn.Module) -> list[str]:
    problems = [problem.message for problem in find_all_problems(model)]
    for path, module in model.named_modules():
        validator = ModuleValidator.VALIDATORS.get(type(module))
        if validator is not None:
            problems.extend(str(_with_path(error, path)) for error in validator(module))
    return problems


# ---------------------------------------------------------------------------------- ModuleValidator
def _with_path(error: Exception, path: str) -> Exception:
    """``error`` with the module's path in front of its message (where its class allows)."""
    message = str(error)
    label = module_label(path)
    if message.startswith(label):
        return error
    try:
        return type(error)(f"{label}: {message}")
    except Exception:  # noqa: BLE001  (an error class with another constructor: keep it as it is)
        return error


def _error_for(problem: Problem) -> UnsupportedModuleError:
    return _ERROR_OF_KIND.get(problem.kind, UnsupportedModuleError)(problem.message)


class ModuleValidator:
    """Check and fix a model for private training (the same methods and registries as Opacus's
    ``ModuleValidator``).

    ``VALIDATORS`` and ``FIXERS`` hold what ``register_module_validator``/``register_module_fixer``
    registered (by exact type). The built-in checks (``validation.module_problems``) apply to every module
    whose type has no registered validator; the built-in fixes (``fix_module``) to every type without a
    registered fixer.
    """

    VALIDATORS: ClassVar[dict[type, Callable[..., list]]] = {}
    FIXERS: ClassVar[dict[type, Callable[..., nn.Module]]] = {}

    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False) -> list[UnsupportedModuleError]:
        """Every problem of ``module`` and its submodules as error objects (``strict=True``: raise
        ``UnsupportedModuleError`` listing them, its ``errors`` attribute holding the list, if any)."""
        errors: list[Exception] = []
        if not module.training:
            errors.append(
                IllegalModuleConfigurationError(
                    "the model is in eval mode: per-sample gradients are computed in training mode (call model.train())"
                )
            )
        for path, submodule in module.named_modules():
            validator = cls.VALIDATORS.get(type(submodule))
            if validator is not None:
                errors.extend(_with_path(error, path) for error in validator(submodule))
            else:
                errors.extend(_error_for(problem) for problem in module_problems(path, submodule))
        if strict and errors:
            error = UnsupportedModuleError("the model cannot be trained privately as it is:\n- " + "\n- ".join(map(str, errors)))
            error.errors = errors
            raise error
        return errors

    @classmethod
    def is_valid(cls, module: nn.Module) -> bool:
        """Whether ``validate`` finds nothing."""
        return not cls.validate(module, strict=False)

    @classmethod
    def fix(cls, module: nn.Module, **kwargs) -> nn.Module:
        """A fixed copy of ``module`` (``fix_module(module, **kwargs)[0]``; changes are logged at INFO)."""
        return fix_module(module, **kwargs)[0]

    @classmethod
    def fix_and_validate(cls, module: nn.Module, **kwargs) -> nn.Module:
        """``fix``, then ``validate(strict=True)``; returns the fixed copy."""
        fixed = cls.fix(module, **kwargs)
        cls.validate(fixed, strict=True)
        return fixed


def _registrar(table_name: str, decorator: str):
    def register(target_class_or_classes: type | Sequence[type], validator_class: type = ModuleValidator):
        classes = (
            list(target_class_or_classes) if isinstance(target_class_or_classes, Sequence) else [target_class_or_classes]
        )
        for target in classes:
            if not (isinstance(target, type) and issubclass(target, nn.Module)):
                raise TypeError(f"{decorator}() takes nn.Module subclasses; got {target!r}")

        def decorate(function):
            for target in classes:
                getattr(validator_class, table_name)[target] = function
            return function

        return decorate

    return register


register_module_validator = _registrar("VALIDATORS", "register_module_validator")
register_module_validator.__doc__ = """Register the decorated ``validate(module) -> list[UnsupportedModuleError]`` for
these module classes (exact types; replaces the built-in checks for them). Same signature as Opacus's."""
register_module_fixer = _registrar("FIXERS", "register_module_fixer")
register_module_fixer.__doc__ = """Register the decorated ``fix(module, **kwargs) -> nn.Module`` for these module
classes (exact types; replaces the built-in fix for them). Same signature as Opacus's."""
