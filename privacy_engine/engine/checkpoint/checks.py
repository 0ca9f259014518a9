"""Checks that a checkpoint fits the objects it is loaded into, before any of them changes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from privacy_engine.engine import limits
from privacy_engine.engine.checkpoint.contents import (
    CLIP_SCHEDULER_KEY,
    ENGINE_KEY,
    LOADER_KEY,
    METADATA_KEY,
    MODULE_KEY,
    NOISE_SCHEDULER_KEY,
    OPTIMIZER_KEY,
    is_cyclic_loader_state,
    needs_loader,
)
from privacy_engine.engine.checkpoint.engine_state import check_restored_source
from privacy_engine.noise.secure_random import is_secure_generator
from privacy_engine.training.data_loader import DPDataLoader
from privacy_engine.training.optimizer import DPOptimizer
from privacy_engine.training.sampling import CyclicPoissonBatchSampler, PoissonBatchSampler

__all__ = ["check_counters", "check_loader_counter", "check_loader_state", "check_module_state", "sampling_generator_kind", "validate"]


def _ledger_entries(checkpoint: Mapping) -> list | None:
    engine_state = checkpoint.get(ENGINE_KEY)
    accountant_state = engine_state.get("accountant") if isinstance(engine_state, Mapping) else None
    history = accountant_state.get("history") if isinstance(accountant_state, Mapping) else None
    return history if isinstance(history, list) else None


def check_counters(checkpoint: Mapping) -> None:
    """Raise ``ValueError`` naming the counters unless the file agrees with itself: at most
    ``limits.MAX_LEDGER_ENTRIES`` ledger entries (validating each costs time), and for the saved
    optimizer, the ledger's steps recorded for it at least its noise mechanism's step counter (both
    advance in the same commit, ``DPOptimizer.step``, so they are equal unless the ledger was
    restored without the optimizer), which is at least its released steps (``steps_taken``; BandMF
    rows drawn and discarded count in the first two only). A ledger rewritten to fewer steps (or
    emptied) would otherwise restore a smaller epsilon on top of the later model and noise state.
    Changes nothing."""
    history = _ledger_entries(checkpoint)
    if history is not None and len(history) > limits.MAX_LEDGER_ENTRIES:
        raise ValueError(
            f"its privacy ledger has {len(history)} entries, over the limit MAX_LEDGER_ENTRIES="
            f"{limits.MAX_LEDGER_ENTRIES} (validating 10**5 entries takes ~3 s, and the time grows with them): a run "
            "records one entry per change of its settings, so the file was crafted or altered"
        )
    optimizer_state = checkpoint.get(OPTIMIZER_KEY)
    dp_state = optimizer_state.get("privacy_engine.dp_state") if isinstance(optimizer_state, Mapping) else None
    metadata = checkpoint.get(METADATA_KEY)
    source = metadata.get("optimizer_source") if isinstance(metadata, Mapping) else None
    if not isinstance(dp_state, Mapping):
        return
    noise_state = dp_state.get("noise")
    noise_steps = noise_state.get("step") if isinstance(noise_state, Mapping) else None
    steps_taken = dp_state.get("steps_taken")
    if not (_is_count(noise_steps) and _is_count(steps_taken)):
        return  # a custom mechanism without a step counter; the optimizer's own check names bad values
    if steps_taken > noise_steps:
        raise ValueError(
            f"its optimizer released steps_taken={steps_taken} steps but its noise mechanism's step counter is "
            f"{noise_steps}: every released step draws noise, so the file was altered"
        )
    if history is None or not isinstance(source, str):
        return
    ledger_steps = 0
    for entry in history:
        if isinstance(entry, Mapping) and str(entry.get("source", "")) == source:
            count = entry.get("num_steps")
            if not _is_count(count):
                return  # the accountant's own validation names the damaged entry
            ledger_steps += count
    # Fewer, not "different": a ledger with more steps than the optimizer's counters is legitimate (a
    # run resumed with load_checkpoint(module=...) only keeps the saved ledger and a fresh optimizer) and
    # only over-reports epsilon; fewer would under-report it.
    if ledger_steps < noise_steps:
        raise ValueError(
            f"its privacy ledger records {ledger_steps} steps for the saved optimizer (source {source!r}), but the "
            f"optimizer's noise step counter is {noise_steps} (steps_taken={steps_taken}): the ledger and the "
            "training state do not belong together (the ledger was rewritten, emptied or swapped), and restoring "
            "them would report the wrong epsilon"
        )


def check_loader_counter(checkpoint: Mapping) -> None:
    """Raise ``ValueError`` naming the counters unless the saved loader's step counter (``next_step``, the
    batches it has drawn) fits the saved optimizer's noise step counter. With BandMF (``num_bands > 1``) each
    noise row belongs to a loader step (a release at loader step t leaves the counter at t + 1; the rows of
    loader steps not released are drawn and discarded), so the loader has drawn at least as many batches as
    there are rows, and exactly as many when the file says no batch was in flight at the save. A rewound or
    swapped loader state would otherwise give released batches a second noise row, or the next batch the row
    of a later step. Changes nothing.

    Not checked for one band (Gaussian noise, one row per release): a run resumed with ``optimizer=`` but
    without ``data_loader=`` legitimately counts its loader's steps from 0 again beside the saved optimizer's
    counters, and its later checkpoints must load (a BandMF run cannot be resumed without its loader).

    ==========================================  ===========================
    case                                        result
    ==========================================  ===========================
    no loader or optimizer state, one band      nothing checked
    next_step < noise step counter              ValueError naming both
    next_step != noise step counter, no batch   ValueError naming both
    in flight (metadata ``batch_in_flight``)
    a counter not an int >= 0                   left to the checks naming it
    ==========================================  ===========================
    """
    engine_state, loader_state = checkpoint.get(ENGINE_KEY), checkpoint.get(LOADER_KEY)
    optimizer_state, metadata = checkpoint.get(OPTIMIZER_KEY), checkpoint.get(METADATA_KEY)
    plan = engine_state.get("noise_plan") if isinstance(engine_state, Mapping) else None
    dp_state = optimizer_state.get("privacy_engine.dp_state") if isinstance(optimizer_state, Mapping) else None
    if not (isinstance(plan, Mapping) and isinstance(loader_state, Mapping) and isinstance(dp_state, Mapping)):
        return
    num_bands, next_step = plan.get("num_bands"), loader_state.get("next_step")
    noise_state = dp_state.get("noise")
    noise_steps = noise_state.get("step") if isinstance(noise_state, Mapping) else None
    if not (_is_count(num_bands) and _is_count(next_step) and _is_count(noise_steps)) or num_bands <= 1:
        return
    in_flight = isinstance(metadata, Mapping) and metadata.get("batch_in_flight") is True
    if next_step < noise_steps or (next_step != noise_steps and not in_flight):
        raise ValueError(
            f"its loader's step counter is next_step={next_step} but its BandMF noise step counter is {noise_steps} "
            f"(steps_taken={dp_state.get('steps_taken')!r}, a batch in flight: {in_flight}): each BandMF noise row "
            "belongs to one loader step, so the loader has drawn at least as many batches as there are rows (as many "
            "when no batch is in flight); the loader state and the training state do not belong together (one was "
            "rewound, swapped or altered)"
        )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

def check_module_state(module: nn.Module, saved: Any, *, strict: bool = True) -> None:
    """Raise ``ValueError`` naming the first entry where ``saved`` does not fit ``module``
    (missing or unexpected key when ``strict``, another shape or dtype); changes nothing."""
    if not isinstance(saved, Mapping):
        raise ValueError(f"the model state is a {type(saved).__name__}, not a state dict")
    current = module.state_dict()
    if strict:
        missing = [key for key in current if key not in saved]
        if missing:
            raise ValueError(
                f"the model has {missing[0]!r}, which the saved model state lacks ({len(missing)} missing): build "
                "the same model as the saved run"
            )
        unexpected = [key for key in saved if key not in current]
        if unexpected:
            raise ValueError(
                f"the saved model state has {unexpected[0]!r}, which this model lacks ({len(unexpected)} "
                "unexpected): build the same model as the saved run"
            )
    for key, value in current.items():
        if key not in saved or not isinstance(value, torch.Tensor):
            continue
        stored = saved[key]
        if not isinstance(stored, torch.Tensor):
            raise ValueError(f"the saved model state's {key!r} is a {type(stored).__name__}, not a tensor")
        if tuple(stored.shape) != tuple(value.shape) or stored.dtype != value.dtype:
            raise ValueError(
                f"{key!r} was saved with shape {list(stored.shape)} and {stored.dtype}, the model's has shape "
                f"{list(value.shape)} and {value.dtype}: build (and convert) the model as in the saved run"
            )


def check_loader_state(data_loader: Any, state: Any) -> None:
    """Raise ``ValueError`` unless ``data_loader.load_state_dict(state)`` restores a sampling state
    of the same kind: Poisson or cyclic, the same generator kind, and for cyclic sampling groups
    that partition exactly this loader's examples into as many groups. Changes nothing."""
    if not isinstance(state, Mapping):
        raise ValueError(f"the saved loader state is a {type(state).__name__}, not a dict")
    next_step = state.get("next_step")
    if isinstance(next_step, bool) or not isinstance(next_step, int) or next_step < 0:
        raise ValueError(f"the saved loader state's next_step is {next_step!r}, not an int >= 0")
    if callable(getattr(data_loader, "check_state_dict", None)):
        data_loader.check_state_dict(state)  # a loader that knows its own state best
        return
    sampler = data_loader.batch_sampler
    if type(sampler) not in (PoissonBatchSampler, CyclicPoissonBatchSampler):
        return  # another sampler (e.g. distributed): its load_state_dict validates before changing anything
    cyclic = isinstance(sampler, CyclicPoissonBatchSampler)
    if cyclic != is_cyclic_loader_state(state):
        saved_kind, kind = ("Poisson", "cyclic Poisson") if cyclic else ("cyclic Poisson", "Poisson")
        raise ValueError(
            f"the loader state was saved from {saved_kind} sampling, this loader uses {kind} sampling: make_private "
            "with the same noise mechanism and num_bands / max_batch_size as the saved run"
        )
    if cyclic:
        groups = state["groups"]
        if not isinstance(groups, (list, tuple)) or len(groups) != sampler.num_groups:
            count = len(groups) if isinstance(groups, (list, tuple)) else groups
            raise ValueError(
                f"the loader state has {count} cyclic groups, this loader has {sampler.num_groups}: make_private with "
                "the same num_bands as the saved run"
            )
        for number, group in enumerate(groups):
            if not isinstance(group, torch.Tensor) or group.dim() != 1 or group.is_floating_point():
                raise ValueError(f"the loader state's group {number} is not a 1-D integer tensor")
        members = torch.cat([g.to(torch.long) for g in groups]) if groups else torch.zeros(0, dtype=torch.long)
        population = getattr(sampler, "indices", None)
        if population is None:
            population = torch.arange(sampler.num_samples)
        if members.numel() != population.numel() or not torch.equal(members.sort().values, population.sort().values):
            raise ValueError(
                f"the loader state's groups hold {members.numel()} examples that are not exactly this loader's "
                f"{population.numel()} examples: resume with the same dataset (and train subset) as the saved run"
            )
    saved_kind = state.get("generator")
    kind = sampling_generator_kind(sampler.generator)
    if saved_kind != kind:
        raise ValueError(
            f"the loader state was sampled with {_GENERATOR_KINDS.get(saved_kind, repr(saved_kind))}, this loader "
            f"samples with {_GENERATOR_KINDS[kind]}: make_private with the same secure_mode and noise_generator "
            "settings as the saved run"
        )
    generator_state = state.get("generator_state")
    if kind != "own":
        if generator_state is not None:
            raise ValueError(f"the loader state of a loader sampling with {_GENERATOR_KINDS[kind]} holds a generator "
                             "state: it was altered")
    else:
        size = torch.Generator().get_state().numel()
        if not (isinstance(generator_state, torch.Tensor) and generator_state.dtype == torch.uint8
                and tuple(generator_state.shape) == (size,)):  # fmt: skip
            raise ValueError(f"the loader state's generator_state is not a CPU generator state ({size} uint8 bytes)")


_GENERATOR_KINDS = {
    "own": "its own torch.Generator",
    "global": "torch's global generator",
    "secure": "OS randomness (secure mode)",
}


def sampling_generator_kind(generator: Any) -> str:
    """``"secure"``, ``"global"`` (None: torch's global generator) or ``"own"``."""
    if is_secure_generator(generator):
        return "secure"
    return "global" if generator is None else "own"


def _check_scheduler(name: str, key: str, scheduler: Any, checkpoint: Mapping) -> None:
    if scheduler is None:
        return
    if key not in checkpoint:
        raise ValueError(f"{name}= was given but the checkpoint holds no {name} state (save it with {name}=)")
    if not callable(getattr(scheduler, "load_state_dict", None)):
        raise TypeError(f"{name} has no load_state_dict(); pass the scheduler whose state was saved")


def validate(engine: Any, checkpoint: dict, *, module: nn.Module, optimizer: Any, data_loader: Any,
             noise_scheduler: Any, grad_clip_scheduler: Any, strict: bool) -> None:  # fmt: skip
    """Everything a restore will need, checked in the order of the error table of
    ``restore_checkpoint``; raises ValueError / TypeError on the first mismatch."""
    for key in (MODULE_KEY, ENGINE_KEY):
        if key not in checkpoint:
            raise ValueError(f"the checkpoint has no {key!r} (it was altered)")
    check_counters(checkpoint)
    check_loader_counter(checkpoint)
    engine.check_state_dict(checkpoint[ENGINE_KEY])
    check_module_state(module, checkpoint[MODULE_KEY], strict=strict)
    if optimizer is not None:
        if OPTIMIZER_KEY not in checkpoint:
            raise ValueError(
                "optimizer= was given but the checkpoint holds no optimizer state (it was saved without "
                "optimizer=): load without optimizer=, or use a checkpoint saved with it"
            )
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(
                f"optimizer is a {type(optimizer).__name__}; pass the DPOptimizer returned by make_private"
            )
        saved_class = checkpoint.get(METADATA_KEY, {}).get("optimizer_class")
        current_class = type(optimizer.original_optimizer).__qualname__
        if saved_class is not None and saved_class != current_class:
            raise ValueError(
                f"the optimizer state was saved from a {saved_class}, this run's optimizer is a {current_class}: "
                "make the same optimizer private as in the saved run"
            )
        optimizer.check_state_dict(checkpoint[OPTIMIZER_KEY])
        check_restored_source(engine, optimizer, checkpoint.get(METADATA_KEY, {}).get("optimizer_source"))
    loader_state = checkpoint.get(LOADER_KEY)
    if data_loader is not None:
        if loader_state is None:
            raise ValueError(
                "data_loader= was given but the checkpoint holds no loader state (it was saved without "
                "data_loader=): load without data_loader=, or use a checkpoint saved with it"
            )
        if not isinstance(data_loader, DPDataLoader):
            raise TypeError(f"data_loader is a {type(data_loader).__name__}; pass the DPDataLoader from make_private")
        check_loader_state(data_loader, loader_state)
    saved_plan = checkpoint[ENGINE_KEY].get("noise_plan")
    saved_bands = 1 if not isinstance(saved_plan, Mapping) else int(saved_plan.get("num_bands", 1))
    saved_groups = len(loader_state["groups"]) if is_cyclic_loader_state(loader_state) else 1
    if saved_bands > 1 or saved_groups > 1 or needs_loader(engine):
        if loader_state is None:
            raise ValueError(
                "this is a BandMF run with cyclic sampling, but the checkpoint holds no loader state: its group "
                "assignment and position are lost, and a new assignment could sample an example fewer than "
                "num_bands steps after its last participation. Resume from a checkpoint saved with data_loader="
            )
        if data_loader is None:
            raise ValueError(
                "this is a BandMF run with cyclic sampling: pass data_loader= (the DPDataLoader from make_private) "
                "so that its group assignment and position are restored; a new assignment could sample an example "
                "fewer than num_bands steps after its last participation"
            )
    _check_scheduler("noise_scheduler", NOISE_SCHEDULER_KEY, noise_scheduler, checkpoint)
    _check_scheduler("grad_clip_scheduler", CLIP_SCHEDULER_KEY, grad_clip_scheduler, checkpoint)
