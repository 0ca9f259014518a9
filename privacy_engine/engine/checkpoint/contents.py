"""What a checkpoint holds (``build_checkpoint``), under which keys, and whether a resume from it
can continue the saved noise exactly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from privacy_engine.engine.checkpoint.file import PAYLOAD_FORMAT
from privacy_engine.training.data_loader import DPDataLoader
from privacy_engine.training.optimizer import DPOptimizer

__all__ = ["RESERVED_KEYS", "build_checkpoint"]

# Keys the checkpoint writes itself; a caller's checkpoint_dict may not use them.
MODULE_KEY = "module_state_dict"
ENGINE_KEY = "privacy_engine_state_dict"
OPTIMIZER_KEY = "optimizer_state_dict"
LOADER_KEY = "data_loader_state_dict"
NOISE_SCHEDULER_KEY = "noise_scheduler_state_dict"
CLIP_SCHEDULER_KEY = "grad_clip_scheduler_state_dict"
METADATA_KEY = "privacy_engine_metadata"
RESERVED_KEYS = ("format", MODULE_KEY, ENGINE_KEY, OPTIMIZER_KEY, LOADER_KEY, NOISE_SCHEDULER_KEY,
                 CLIP_SCHEDULER_KEY, METADATA_KEY)  # fmt: skip


def is_cyclic_loader_state(state: Any) -> bool:
    """Whether a saved loader state is cyclic sampling's (it holds the ``groups``)."""
    return isinstance(state, Mapping) and "groups" in state


def needs_loader(engine: Any) -> bool:
    """BandMF with cyclic sampling over several groups: the loader's groups must carry over."""
    plan = getattr(engine, "noise_plan", None)
    return plan is not None and int(plan.num_bands) > 1


def build_checkpoint(
    engine: Any,
    *,
    module: nn.Module,
    optimizer: Any = None,
    data_loader: Any = None,
    noise_scheduler: Any = None,
    grad_clip_scheduler: Any = None,
    checkpoint_dict: Mapping[str, Any] | None = None,
    module_state_dict_kwargs: Mapping[str, Any] | None = None,
) -> dict:
    """The payload of ``engine.save_checkpoint`` (plain data; see the module docstring).

    ============================================  ==========================================
    case                                          result
    ============================================  ==========================================
    checkpoint_dict uses a key the checkpoint     ValueError naming the key
    writes itself
    optimizer not the DPOptimizer of the run      TypeError
    data_loader not a DPDataLoader                TypeError
    BandMF / cyclic sampling without data_loader  ValueError: the groups and position must
                                                  be saved to resume
    ============================================  ==========================================
    """
    extra = dict(checkpoint_dict or {})
    clashing = [key for key in extra if key in RESERVED_KEYS]
    if clashing:
        raise ValueError(f"checkpoint_dict uses the key {clashing[0]!r}, which the checkpoint writes itself; rename it")
    if optimizer is not None and not isinstance(optimizer, DPOptimizer):
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__}; pass the DPOptimizer returned by make_private (its state "
            "holds the noise state)"
        )
    if data_loader is not None and not isinstance(data_loader, DPDataLoader):
        raise TypeError(
            f"data_loader is a {type(data_loader).__name__}; pass the DPDataLoader returned by make_private (it "
            "holds the sampling state)"
        )
    if data_loader is None and needs_loader(engine):
        raise ValueError(
            "this run uses BandMF noise with cyclic sampling: pass data_loader= to save_checkpoint, so that its "
            "group assignment and position are saved (without them a resumed run could sample an example fewer "
            "than num_bands steps after its last participation, which the accounting does not allow)"
        )
    checkpoint: dict[str, Any] = {"format": PAYLOAD_FORMAT, **extra}
    checkpoint[MODULE_KEY] = module.state_dict(**dict(module_state_dict_kwargs or {}))
    checkpoint[ENGINE_KEY] = engine.state_dict()
    metadata: dict[str, Any] = {"optimizer_class": None, "batch_in_flight": False}
    if optimizer is not None:
        checkpoint[OPTIMIZER_KEY] = optimizer.state_dict()
        metadata["optimizer_class"] = type(optimizer.original_optimizer).__qualname__
        # Whose ledger entries a restore with this optimizer replaces (the others' are kept).
        metadata["optimizer_source"] = str(getattr(optimizer, "source", ""))
    if data_loader is not None:
        checkpoint[LOADER_KEY] = data_loader.state_dict()
        if optimizer is not None:
            metadata["batch_in_flight"] = _batch_in_flight(optimizer, checkpoint[LOADER_KEY]["next_step"])
    if noise_scheduler is not None:
        checkpoint[NOISE_SCHEDULER_KEY] = noise_scheduler.state_dict()
    if grad_clip_scheduler is not None:
        checkpoint[CLIP_SCHEDULER_KEY] = grad_clip_scheduler.state_dict()
    checkpoint[METADATA_KEY] = metadata
    return checkpoint


def _batch_in_flight(optimizer: Any, loader_next_step: int) -> bool:
    """True if the loader has yielded a batch that no released step has used yet (a save between
    drawing a batch and its ``optimizer.step()``, or between micro-batches of one logical step)."""
    last_released = getattr(getattr(optimizer, "contract", None), "last_released_step", None)
    released_next = 0 if last_released is None else last_released + 1
    return loader_next_step > released_next or bool(getattr(optimizer, "_in_logical_step", False))


def inexact_resume_reason(engine: Any, checkpoint: Mapping, optimizer: Any, data_loader: Any) -> str | None:
    """Why the saved noise generators must not continue (None: they may)."""
    if optimizer is None or engine.secure_mode:
        return None  # nothing restored, or secure mode: the generators are fresh anyway
    if data_loader is None or LOADER_KEY not in checkpoint:
        return "the loader's sampling state was not restored (save and load with data_loader=)"
    if checkpoint.get(METADATA_KEY, {}).get("batch_in_flight"):
        return ("it was saved after a batch was drawn from the loader and before optimizer.step() released it (save "
                "right after optimizer.step())")
    return None
