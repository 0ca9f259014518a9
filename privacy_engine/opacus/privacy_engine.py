"""``opacus.privacy_engine``: Opacus's ``PrivacyEngine`` on this engine.

It is the engine's ``PrivacyEngine`` (the same planning, sampling, clipping, noise and accounting)
with Opacus's conventions where a script can see them:

- the constructor (keyword-only ``accountant="prv"``, ``secure_mode``) and accountants with
  Opacus's interface (``privacy_engine.opacus.accountants``: ``prv`` is the PLD accountant);
- ``make_private`` / ``make_private_with_epsilon`` with Opacus's keywords (``wrap_model``,
  ``rand_on_empty``, ``criterion``) and Opacus's return values (four in ghost mode, with the
  criterion; the engine's own ``PrivacyEngine`` returns three in every mode); the returned model
  saves with Opacus's state-dict keys (``_module.`` prefix) and the optimizer is
  ``privacy_engine.opacus.optimizers.DPOptimizer``: the engine builds this namespace's classes
  (``_OPACUS_CLASSES``, passed in its plan), so nothing changes class after it is made;
- ``load_checkpoint`` also reads files written by Opacus's ``save_checkpoint``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import Unpack

from accountants import Accountant
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.engine import PrivacyEngine as _PrivacyEngine
from privacy_engine.engine import checkpoint
from privacy_engine.engine.options import takes_settings
from privacy_engine.engine.plan import BuildClasses, Plan
from privacy_engine.opacus import _binding
from privacy_engine.opacus.accountants import create_accountant
from privacy_engine.opacus.grad_sample import (
    GradSampleModule,
    GradSampleModuleFastGradientClipping,
    GradSampleModuleNoOp,
)
from privacy_engine.opacus.optimizers import DPOptimizer
from privacy_engine.opacus.optimizers.adaclipoptimizer import AdaClipFromClipper
from privacy_engine.opacus.typed_settings import OpacusMakePrivateSettings, OpacusMakePrivateWithEpsilonSettings
from privacy_engine.opacus.validators import fixer_attribute

__all__ = ["PrivacyEngine", "forbid_accumulation_hook"]

_OPACUS_ACCOUNTANT_KEY = "privacy_accountant_state_dict"
_Method = TypeVar("_Method", bound=Callable[..., Any])

#: What ``make_private`` builds in this namespace: the engine's classes' subclasses with Opacus's
#: methods and state-dict keys (same constructors, no state of their own), constructed directly.
_OPACUS_CLASSES = BuildClasses(
    optimizer=DPOptimizer,
    hooks=GradSampleModule,
    ghost=GradSampleModuleFastGradientClipping,
    manual=GradSampleModuleNoOp,
)
#: ``clipping="adaptive"``: the optimizer is an ``AdaClipDPOptimizer``, as Opacus's make_private returns.
_OPACUS_ADACLIP_CLASSES = dataclasses.replace(_OPACUS_CLASSES, optimizer=AdaClipFromClipper)


def _takes_opacus_settings(entry_point: str) -> Callable[[_Method], _Method]:
    """``takes_settings(entry_point)`` (the engine's settings in the runtime signature) plus Opacus's
    ghost-mode ``criterion``, a keyword of this namespace only (the engine's entry points refuse it)."""

    def decorate(method: _Method) -> _Method:
        method = takes_settings(entry_point)(method)
        signature = inspect.signature(method)
        criterion = inspect.Parameter("criterion", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Any)
        method.__signature__ = signature.replace(parameters=[*signature.parameters.values(), criterion])  # type: ignore[attr-defined]
        return method

    return decorate


def forbid_accumulation_hook(module: nn.Module, _inputs: Any) -> None:
    """Forward pre-hook (``module.register_forward_pre_hook``) that refuses a training forward while
    per-sample gradients of an earlier backward pass are still held (no ``zero_grad()`` since), the
    check of Opacus's tutorials. Raises ``ValueError`` before the forward runs. Not needed with
    ``make_private``, whose step contract clips each backward pass on its own."""
    if not module.training:
        return
    for name, param in module.named_parameters():
        if getattr(param, "grad_sample", None) is not None:
            raise ValueError(
                f"parameter {name!r} still holds per-sample gradients of an earlier backward pass: call "
                f"optimizer.zero_grad() (or model.zero_grad()) after each step before the next forward"
            )


def _is_engine_checkpoint(path: Any) -> bool:
    """Whether ``path`` holds a checkpoint in the engine's format (its magic bytes); else Opacus's."""
    if isinstance(path, (str, os.PathLike)):
        with open(path, "rb") as file:
            return file.read(len(checkpoint.MAGIC)) == checkpoint.MAGIC
    start = path.tell()
    magic = path.read(len(checkpoint.MAGIC))
    path.seek(start)
    return magic == checkpoint.MAGIC


class PrivacyEngine(_PrivacyEngine):
    """The engine's ``PrivacyEngine`` with Opacus's interface (see the module docstring).

    Args:
        accountant: ``"prv"`` (Opacus's default; the PLD accountant here), ``"rdp"``, or an accountant
            instance; ``"gdp"`` raises (not provided). An Opacus-style ``IAccountant`` that is not an
            engine ``accountants.Accountant`` raises ``TypeError`` (the engine composes its steps
            with dp-accounting through ``accountants.Accountant``).
        secure_mode: OS-seeded noise and sampling; seeds and ``noise_generator`` are refused. Unlike
            Opacus, no ``torchcsprng`` is needed (see ``privacy_engine.noise`` for what it promises).
    """

    def __init__(self, *, accountant: str | Accountant = "prv", secure_mode: bool = False) -> None:
        if isinstance(accountant, str):
            accountant = create_accountant(accountant.strip().lower())
        if not isinstance(accountant, Accountant):
            raise TypeError(
                f"PrivacyEngine accounts with subclasses of accountants.Accountant (composed by dp-accounting); "
                f"{type(accountant).__name__} is an Opacus-style IAccountant: use it through "
                f"optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate)) instead"
            )
        super().__init__(accountant=accountant, secure_mode=secure_mode)

    # ------------------------------------------------------------------ Opacus's model checks
    def is_compatible(self, *, module: nn.Module, optimizer: Any = None, data_loader: Any = None) -> bool:
        """Whether ``ModuleValidator`` finds nothing in ``module`` (Opacus's method)."""
        return fixer_attribute("ModuleValidator").is_valid(module)

    def validate(self, *, module: nn.Module, optimizer: Any = None, data_loader: Any = None) -> None:
        """Raise ``UnsupportedModuleError`` listing every problem of ``module`` (Opacus's method)."""
        fixer_attribute("ModuleValidator").validate(module, strict=True)

    @classmethod
    def get_compatible_module(cls, module: nn.Module) -> nn.Module:
        """``ModuleValidator.fix(module)`` (a fixed copy), validated (Opacus's method)."""
        validator = fixer_attribute("ModuleValidator")
        fixed = validator.fix(module)
        validator.validate(fixed, strict=True)
        return fixed

    # ------------------------------------------------------------------ making things private
    @staticmethod
    def _opacus_options(wrap_model: bool, rand_on_empty: bool) -> None:
        if not wrap_model:
            raise NotImplementedError(
                "wrap_model=False (hooks on the unwrapped model) is not supported: use the returned wrapper as the "
                "model (it forwards attribute access to yours, and to_standard_module() gives yours back)"
            )
        if rand_on_empty:
            raise ValueError(
                "rand_on_empty=True is not supported: an empty Poisson batch comes out as zero-length tensors, "
                "which every layer here handles; random data in its place was never sampled"
            )

    def _make_private_opacus(self, entry_point: str, module: nn.Module, optimizer: Optimizer, data_loader: DataLoader,
                             settings: Mapping[str, Any]) -> tuple[Any, ...]:  # fmt: skip
        """The engine's ``entry_point`` with Opacus's return values: ``(module, optimizer,
        data_loader)``, with the criterion third in ghost mode."""
        settings = dict(settings)
        settings.setdefault("grad_sample_mode", "hooks")  # Opacus's default (the engine's "auto" may pick ghost)
        criterion = settings.pop("criterion", None)  # not the engine's setting: read here only
        made_module, made_optimizer, made_loader = self._make_private(
            entry_point, module, optimizer, data_loader, settings
        )
        if not isinstance(made_module, GhostClippingModule):
            return made_module, made_optimizer, made_loader
        # Opacus wraps the criterion in ghost mode to run its second backward pass; here clipping
        # happens inside the ordinary backward pass, so it comes back as given (default: cross-entropy).
        if criterion is None:
            criterion = nn.CrossEntropyLoss(reduction=made_optimizer.loss_reduction)
        return made_module, made_optimizer, criterion, made_loader

    def _build(self, plan: Plan, budget: Any) -> tuple[Any, ...]:
        # The engine's build, of this namespace's classes (Opacus's methods and keys), which connects what it
        # builds itself: not a hand-built pair for opacus._binding to connect.
        with _binding.built_by_make_private():
            flat_adaptive = plan.options.clipping == "adaptive"  # per-layer adaptive has no Opacus class
            classes = _OPACUS_ADACLIP_CLASSES if flat_adaptive else _OPACUS_CLASSES
            return super()._build(dataclasses.replace(plan, classes=classes), budget)

    @_takes_opacus_settings("make_private")
    def make_private(  # type: ignore[override]  # Opacus's signature: keywords only, four values in ghost mode
        self, *, module: nn.Module, optimizer: Optimizer, data_loader: DataLoader, wrap_model: bool = True,
        rand_on_empty: bool = False, **settings: Unpack[OpacusMakePrivateSettings],
    ) -> tuple[Any, ...]:  # fmt: skip
        """The engine's ``make_private`` (its guarantee and edge cases) with Opacus's keywords and
        return values; ``settings``: the fields of ``PrivacyOptions`` (``noise_multiplier``,
        ``max_grad_norm``, ..., and ``criterion``).

        Returns, as Opacus 1.6 does:

        ======================================  ==============================================
        grad_sample_mode                        returned
        ======================================  ==============================================
        "hooks", "functorch", "ew", "no_op"     ``(module, optimizer, data_loader)``
        "ghost"                                 ``(module, optimizer, criterion, data_loader)``
        ======================================  ==============================================

        The criterion is ``criterion=`` as given (default ``nn.CrossEntropyLoss`` with the
        ``loss_reduction``): clipping happens inside the ordinary backward pass, so it needs no
        wrapper. (The engine's own ``privacy_engine.PrivacyEngine`` returns three values in every
        mode.) ``grad_sample_mode`` may be Opacus's ``"hooks"``, ``"functorch"``, ``"ew"`` (an alias
        of ``"hooks"``), ``"ghost"`` or ``"no_op"`` (the loop sets ``p.grad_sample`` itself). A
        ``DPDataLoader`` from an earlier call is accepted (re-planned from the loader it stands for).

        ==============================  ==========================================
        case                            result
        ==============================  ==========================================
        wrap_model=False                NotImplementedError (before anything changes)
        rand_on_empty=True              ValueError (before anything changes)
        clipping="adaptive"             adaptive clipping (the engine's: its five options
                                        as keywords, as Opacus's AdaClipDPOptimizer)
        any other argument              as the engine's ``make_private``
        ==============================  ==========================================
        """
        self._opacus_options(wrap_model, rand_on_empty)
        return self._make_private_opacus("make_private", module, optimizer, data_loader, settings)

    @_takes_opacus_settings("make_private_with_epsilon")
    def make_private_with_epsilon(  # type: ignore[override]  # Opacus's signature, as make_private
        self, *, module: nn.Module, optimizer: Optimizer, data_loader: DataLoader, wrap_model: bool = True,
        rand_on_empty: bool = False, **settings: Unpack[OpacusMakePrivateWithEpsilonSettings],
    ) -> tuple[Any, ...]:  # fmt: skip
        """The engine's ``make_private_with_epsilon`` (calibrated on this engine's accountant over the
        steps the private loader runs) with Opacus's keywords; returns what ``make_private`` returns
        (four values in ghost mode, with the criterion). Like Opacus, it warns when the accountant
        already holds steps (the calibration assumes it starts empty)."""
        self._opacus_options(wrap_model, rand_on_empty)
        if self.accountant.steps > 0:
            warnings.warn(
                "make_private_with_epsilon with privacy budget already spent: the noise multiplier is calibrated as if "
                "this run were the only one, so the total epsilon will exceed target_epsilon",
                stacklevel=2,
            )
        return self._make_private_opacus("make_private_with_epsilon", module, optimizer, data_loader, settings)

    # ------------------------------------------------------------------ checkpoints
    def load_checkpoint(
        self,
        *,
        path: Any,
        module: nn.Module,
        optimizer: Optimizer | None = None,
        data_loader: DataLoader | None = None,
        noise_scheduler: Any = None,
        grad_clip_scheduler: Any = None,
        module_load_dict_kwargs: dict[str, Any] | None = None,
        torch_load_kwargs: dict[str, Any] | None = None,
    ) -> dict:
        """Restore a checkpoint written by ``save_checkpoint`` here (the engine's format: all of its
        guarantees) or by Opacus's ``save_checkpoint`` (a plain ``torch.save`` file).

        An Opacus file is unpickled with ``weights_only=True`` (it runs nothing) and restores the
        model (Opacus's ``_module.`` keys or plain keys), the accountant's history (Opacus's
        ``(noise_multiplier, sample_rate, steps)`` entries; any Opacus accountant, the steps are the
        same), the wrapped optimizer's state (the noise continues from this run's generators, with a
        warning) and the scheduler states given. Everything is checked before anything changes; if
        restoring the optimizer or a scheduler fails, the model and accountant are put back.

        ==========================================  ===========================================
        case (Opacus file)                          result
        ==========================================  ===========================================
        not a dict with "module_state_dict"         CheckpointError naming the file
        module keys do not match                    the model's load_state_dict error, nothing
                                                    changed
        data_loader given                           CheckpointError (Opacus saves no sampling
                                                    state)
        ==========================================  ===========================================
        """
        if _is_engine_checkpoint(path):
            return super().load_checkpoint(
                path=path, module=module, optimizer=optimizer, data_loader=data_loader,
                noise_scheduler=noise_scheduler, grad_clip_scheduler=grad_clip_scheduler,
                module_load_dict_kwargs=module_load_dict_kwargs, torch_load_kwargs=torch_load_kwargs,
            )  # fmt: skip
        name = checkpoint.display_name(path)
        load_kwargs = dict(torch_load_kwargs or {})
        load_kwargs.pop("weights_only", None)
        try:
            payload = torch.load(path, weights_only=True, **{"map_location": "cpu", **load_kwargs})
        except Exception as error:  # any unpickling failure: say which file and why
            raise checkpoint.CheckpointError(
                f"checkpoint {name} is neither a privacy_engine checkpoint nor a plain Opacus checkpoint readable "
                f"with torch.load(weights_only=True): {error}"
            ) from error
        if not isinstance(payload, dict) or "module_state_dict" not in payload:
            raise checkpoint.CheckpointError(
                f"checkpoint {name} is not an Opacus checkpoint (a dict with 'module_state_dict'); save it with "
                f"PrivacyEngine.save_checkpoint"
            )
        if data_loader is not None:
            raise checkpoint.CheckpointError(f"checkpoint {name} was written by Opacus and holds no data loader state")
        # Validate the accountant's part on a copy first: nothing may change if it is malformed.
        accountant_state = payload.get(_OPACUS_ACCOUNTANT_KEY)
        if accountant_state is not None:
            loaded = copy.deepcopy(self.accountant)
            loaded.load_state_dict(accountant_state)
            # On an engine shared by several optimizers, only the restored one's entries are replaced
            # (an Opacus file has no sources: its entries are taken as the restored optimizer's).
            restored_source = None if optimizer is None else str(getattr(optimizer, "source", ""))
            accountant_state = loaded.state_dict()
            for entry in accountant_state["history"]:
                entry["source"] = restored_source or ""
            accountant_state = checkpoint.ledger_after_restore(self, accountant_state, restored_source=restored_source)
        module_backup = copy.deepcopy(module.state_dict())
        accountant_backup = self.accountant.state_dict()
        try:
            module.load_state_dict(payload["module_state_dict"], **(module_load_dict_kwargs or {}))
            if accountant_state is not None:
                self.accountant.load_state_dict(accountant_state)
            optimizer_state = payload.get("optimizer_state_dict") or {}
            if optimizer is not None and optimizer_state:
                optimizer.load_state_dict(optimizer_state)
            for scheduler, key in ((noise_scheduler, "noise_scheduler_state_dict"),
                                   (grad_clip_scheduler, "grad_clip_scheduler_state_dict")):  # fmt: skip
                if scheduler is not None and payload.get(key):
                    scheduler.load_state_dict(payload[key])
        except BaseException:
            module.load_state_dict(module_backup)
            self.accountant.load_state_dict(accountant_backup)
            raise
        return payload
