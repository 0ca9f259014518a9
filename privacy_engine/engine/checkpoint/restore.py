"""Restoring a checkpoint: all of it, or nothing."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from privacy_engine.engine.checkpoint.checks import validate
from privacy_engine.engine.checkpoint.contents import (
    CLIP_SCHEDULER_KEY,
    ENGINE_KEY,
    LOADER_KEY,
    METADATA_KEY,
    MODULE_KEY,
    NOISE_SCHEDULER_KEY,
    OPTIMIZER_KEY,
    inexact_resume_reason,
)
from privacy_engine.engine.checkpoint.file import CheckpointError
from privacy_engine.interrupts import deferred_keyboard_interrupt

__all__ = ["restore_checkpoint"]

def _fail(name: str, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {name}: {problem}; nothing was restored")


# ---------------------------------------------------------------------------------------------- restore
def _validate_or_fail(name: str, engine: Any, checkpoint: dict, **objects: Any) -> None:
    """``checks.validate``, its ValueError / TypeError made a ``CheckpointError`` naming the file."""
    try:
        validate(engine, checkpoint, **objects)
    except (ValueError, TypeError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise _fail(name, str(error)) from error


def _snapshot_module(module: nn.Module) -> dict:
    return {
        key: value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
        for key, value in module.state_dict().items()
    }


def restore_checkpoint(
    engine: Any,
    checkpoint: dict,
    *,
    name: str,
    module: nn.Module,
    optimizer: Any = None,
    data_loader: Any = None,
    noise_scheduler: Any = None,
    grad_clip_scheduler: Any = None,
    module_load_dict_kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Restore ``checkpoint`` (from ``read_checkpoint``) into the objects given, all or nothing.

    Guarantee: every part is checked against the objects it goes into before any of them changes;
    on any mismatch ``CheckpointError`` names the file and the first mismatch, says what to do,
    and model, optimizer, accountant, noise, loader and schedulers are exactly as they were. The
    restore itself runs with Ctrl-C held off and is undone if a part still fails.

    ==============================================  ============================================
    mismatch (checked in this order)                error names
    ==============================================  ============================================
    secure_mode of the engine                       secure_mode
    accountant kind / damaged history               the accountant kinds
    noise plan (mechanism, bands, coefficients,     the field, saved and current values
    noise multiplier, sample rate, truncation)
    model keys, shapes, dtypes                      the first differing key
    optimizer= given, none in the file              optimizer
    optimizer class, groups, state shapes           the group / parameter
    optimizer made private in another position      the make_private call of each
    noise mechanism, coefficients, layout           the noise state field
    clipper bounds / mode                           the clipper field
    data_loader= given, none in the file            data_loader
    loader kind, groups, generator kind             the loader field
    BandMF without loader state or loader           data_loader
    scheduler given, none in the file               the scheduler
    ==============================================  ============================================

    The ledger. On an engine shared by several private optimizers, only the entries of the optimizer
    restored (``optimizer=``) are replaced by the saved ones; every other optimizer keeps its steps
    (``engine_state.ledger_after_restore``), so rolling back one model never erases another's privacy
    cost. The optimizer given must have been made private in the same position (first, second, ...) as
    the saved one (``CheckpointError`` otherwise).

    Exact or fresh noise. The saved noise generators continue only if the resume is exact: the
    loader's state is restored and no drawn batch was waiting for its step when the file was saved.
    Otherwise the noise continues from new generators (``NoiseMechanism.reseed``; a warning says
    why), the waiting batch is skipped and a partly accumulated logical step is dropped: the saved
    generators would add the noise the interrupted run added (or was about to add) to one batch to
    another, and two releases with the same noise reveal the difference of their gradients.

    An optimizer state in the file but no ``optimizer=`` restores the rest (with a warning).
    A loader that samples from torch's global generator (one built by hand without a generator)
    restores its position but not that shared generator: its batches do not continue exactly.
    """
    load_kwargs = dict(module_load_dict_kwargs or {})
    _validate_or_fail(name, engine, checkpoint, module=module, optimizer=optimizer, data_loader=data_loader,
                      noise_scheduler=noise_scheduler, grad_clip_scheduler=grad_clip_scheduler,
                      strict=bool(load_kwargs.get("strict", True)))  # fmt: skip
    if optimizer is None and OPTIMIZER_KEY in checkpoint:
        warnings.warn(
            f"checkpoint {name} holds an optimizer state (with the noise state) but no optimizer= was given: it is not "
            "restored, so training on would continue with the current optimizer's noise",
            stacklevel=3,
        )
    fresh_noise_reason = inexact_resume_reason(engine, checkpoint, optimizer, data_loader)
    undo: list = []
    with deferred_keyboard_interrupt():
        try:
            _restore_parts(engine, checkpoint, undo, module=module, optimizer=optimizer, data_loader=data_loader,
                           noise_scheduler=noise_scheduler, grad_clip_scheduler=grad_clip_scheduler,
                           load_kwargs=load_kwargs, fresh_noise=fresh_noise_reason is not None,
                           batch_in_flight=bool(checkpoint.get(METADATA_KEY, {}).get("batch_in_flight")))  # fmt: skip
        except BaseException as error:
            for step in reversed(undo):
                step()
            if isinstance(error, (ValueError, TypeError, RuntimeError)) and not isinstance(error, CheckpointError):
                raise _fail(name, f"{type(error).__name__}: {error}") from error
            raise
    if fresh_noise_reason is not None:
        warnings.warn(
            f"checkpoint {name}: the noise continues from new generators, not the saved ones, because "
            f"{fresh_noise_reason}. The saved generators would add noise the interrupted run used on one batch to "
            "another batch, which reveals the difference of their gradients. Training stays private; it is not "
            "bit-identical to an uninterrupted run.",
            stacklevel=3,
        )


def _restore_engine(engine: Any, backup: tuple) -> None:
    state, plan = backup
    engine.accountant.load_state_dict(state["accountant"])
    engine.noise_plan = plan



def _restore_parts(engine: Any, checkpoint: dict, undo: list, *, module: nn.Module, optimizer: Any, data_loader: Any,
                   noise_scheduler: Any, grad_clip_scheduler: Any, load_kwargs: dict, fresh_noise: bool,
                   batch_in_flight: bool) -> None:  # fmt: skip
    """Load every part, appending to ``undo`` how to put each one back before changing it."""
    engine_backup = engine.state_dict(), engine.noise_plan
    undo.append(lambda: _restore_engine(engine, engine_backup))
    engine.load_state_dict(checkpoint[ENGINE_KEY], optimizer=optimizer)
    if data_loader is not None:
        loader_backup = data_loader.state_dict()
        undo.append(lambda: data_loader.load_state_dict(loader_backup))
        data_loader.load_state_dict(checkpoint[LOADER_KEY])
    if optimizer is not None:
        optimizer_backup = optimizer.state_dict()
        undo.append(lambda: optimizer.load_state_dict(optimizer_backup))
        optimizer.load_state_dict(checkpoint[OPTIMIZER_KEY])
        if fresh_noise:
            optimizer.noise.reseed()
        if batch_in_flight:
            optimizer.discard_logical_step()
    module_backup = _snapshot_module(module)
    undo.append(lambda: module.load_state_dict(module_backup))
    module.load_state_dict(checkpoint[MODULE_KEY], **load_kwargs)
    for scheduler, key in ((noise_scheduler, NOISE_SCHEDULER_KEY), (grad_clip_scheduler, CLIP_SCHEDULER_KEY)):
        if scheduler is not None:
            backup = copy.deepcopy(scheduler.state_dict())
            undo.append(lambda scheduler=scheduler, backup=backup: scheduler.load_state_dict(backup))
            scheduler.load_state_dict(checkpoint[key])
