"""The engine's part of a checkpoint: its noise plan as plain data, and the check that a saved
engine state fits the engine it is loaded into."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from privacy_engine.engine.noise_plan import BandCandidate, MechanismCandidate, NoisePlan

__all__ = ["PLAN_FIELDS_TO_MATCH", "check_engine_state", "check_restored_source", "ledger_after_restore",
           "plan_from_dict", "plan_to_dict"]

def plan_to_dict(plan: Any) -> dict | None:
    """A ``NoisePlan`` as plain data (None stays None)."""
    return None if plan is None else dataclasses.asdict(plan)


def plan_from_dict(data: Any) -> Any:
    """The ``NoisePlan`` written by ``plan_to_dict``; ValueError naming an unknown or missing field."""
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise ValueError(f"the saved noise_plan is a {type(data).__name__}, not a dict")
    fields = {field.name for field in dataclasses.fields(NoisePlan)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(
            f"the saved noise_plan has fields {unknown} that this version's NoisePlan lacks: load it with the "
            "version of privacy_engine that wrote it"
        )
    values = dict(data)
    if values.get("coefficients") is not None:
        values["coefficients"] = tuple(float(c) for c in values["coefficients"])
    candidate_fields = {field.name for field in dataclasses.fields(BandCandidate)}
    candidates = []
    for candidate in values.get("candidates", ()):
        if not isinstance(candidate, Mapping) or set(candidate) != candidate_fields:
            raise ValueError("the saved noise_plan's candidates are not BandCandidate fields")
        candidates.append(BandCandidate(**candidate))
    values["candidates"] = tuple(candidates)
    mechanism_fields = {field.name for field in dataclasses.fields(MechanismCandidate)}
    rows = []
    for row in values.get("mechanism_candidates", ()):
        if not isinstance(row, Mapping) or set(row) != mechanism_fields:
            raise ValueError("the saved noise_plan's mechanism_candidates are not MechanismCandidate fields")
        rows.append(MechanismCandidate(**row))
    values["mechanism_candidates"] = tuple(rows)
    try:
        return NoisePlan(**values)
    except TypeError as error:
        raise ValueError(f"the saved noise_plan does not rebuild a NoisePlan: {error}") from error


#: NoisePlan fields a resumed run must share with the saved one (the rest describe how it was chosen).
PLAN_FIELDS_TO_MATCH = ("mechanism", "num_bands", "coefficients", "noise_multiplier", "sample_rate", "group_size",
                        "max_batch_size")  # fmt: skip


def check_engine_state(engine: Any, state: Any) -> Any:
    """Check an engine state dict against ``engine``; return its ``NoisePlan`` (or None).

    Raises ValueError naming the first mismatch: not a dict, secure_mode, accountant kind or a
    damaged accountant state, a noise plan that differs from the engine's own in one of
    ``PLAN_FIELDS_TO_MATCH`` (but for DP-SGD's ``noise_multiplier``: a resume at a changed sigma, whose plan is
    returned with this engine's sigma). Changes nothing."""
    if not isinstance(state, Mapping) or "accountant" not in state or "secure_mode" not in state:
        raise ValueError("the engine state is not a dict with 'accountant' and 'secure_mode' (it was altered)")
    if state["secure_mode"] is not engine.secure_mode:
        raise ValueError(
            f"it was written by a PrivacyEngine(secure_mode={state['secure_mode']!r}), this engine has "
            f"secure_mode={engine.secure_mode}: build PrivacyEngine(secure_mode={state['secure_mode']!r}) to resume it"
        )
    accountant_state = state["accountant"]
    saved_kind = accountant_state.get("accountant") if isinstance(accountant_state, Mapping) else None
    if saved_kind != engine.accountant.name:
        raise ValueError(
            f"its accountant is {saved_kind!r}, this engine's is {engine.accountant.name!r}: build "
            f"PrivacyEngine(accountant={saved_kind!r}) to resume it"
        )
    engine.accountant.fresh().load_state_dict(dict(accountant_state))  # validates, changes nothing here
    plan = plan_from_dict(state.get("noise_plan"))
    current = engine.noise_plan
    if plan is not None and current is not None:
        # DP-SGD resumed at another sigma is allowed and accounted: the ledger holds the saved steps at the saved
        # sigma, the optimizer records the next ones at this run's (DPOptimizer.load_state_dict keeps it). BandMF's
        # guarantee is for one noise scale on every row: its sigma must match.
        # Truncated sampling too: its accounted group size is the worst one at the planned sigma.
        sigma_may_change = plan.mechanism == current.mechanism == "gaussian" and plan.max_batch_size is None
        if sigma_may_change and plan.noise_multiplier != current.noise_multiplier:
            plan = dataclasses.replace(plan, noise_multiplier=current.noise_multiplier)
        for field in PLAN_FIELDS_TO_MATCH:
            saved_value, value = getattr(plan, field), getattr(current, field)
            if saved_value != value:
                raise ValueError(
                    f"it was saved from a run with {field}={saved_value!r}, this engine was made private with "
                    f"{field}={value!r}: call make_private with the settings of the saved run"
                )
    return plan


def check_restored_source(engine: Any, optimizer: Any, saved_source: Any) -> None:
    """Raise ValueError unless the optimizer given to a restore is the one whose ledger entries the
    file saved under ``saved_source`` (entries are labelled by the order of ``make_private`` calls on
    an engine: ``""`` for the first, ``"1"`` for the second, ...). Changes nothing."""
    if optimizer is None or saved_source is None:
        return
    current = getattr(optimizer, "source", "")
    if str(saved_source) != current:
        def nth(source: str) -> str:
            return "#1" if source == "" else f"#{int(source) + 1}" if source.isdigit() else repr(source)

        raise ValueError(
            f"its optimizer came from make_private call {nth(str(saved_source))} on its engine, the optimizer given "
            f"from call {nth(current)}: the saved optimizer's ledger entries would be restored as another "
            f"optimizer's. Call make_private for the models in the same order as in the saved run"
        )


def ledger_after_restore(engine: Any, saved_accountant_state: Mapping, *, restored_source: str | None) -> dict:
    """The accountant state a restore loads: the saved entries of ``restored_source`` (the optimizer
    restored) and, for every other source, the longer of its current and saved entries.

    Guarantee: a restore never removes a step of an optimizer it does not restore. A rolled-back
    optimizer's entries become the saved ones (its releases after the save are undone with it, as in a
    single-model resume); another optimizer's entries are the current ones (a rollback on a live engine:
    they already hold the saved ones and more) unless the file holds more of its steps (a resume in a new
    process, where they are not recorded yet). Changes nothing.

    ==========================================  =============================================
    case                                        ledger after the restore
    ==========================================  =============================================
    one optimizer on the engine and in the      the saved ledger (a resume or a rollback)
    file, no ``restored_source``
    ``restored_source`` s (optimizer= given)    saved entries of s + each other source's
                                                longer history (current or saved)
    several sources, no optimizer= given        each source's longer history: nothing is
                                                rolled back (which optimizer is meant is
                                                unknown)
    ==========================================  =============================================
    """
    state = dict(saved_accountant_state)
    saved = [dict(entry) for entry in state["history"]]
    current = [entry.to_dict() for entry in engine.accountant.history]
    sources = {str(entry.get("source", "")) for entry in saved + current}
    single = getattr(engine, "_optimizers_made", 0) <= 1 and sources <= {""}
    if single and restored_source in (None, ""):
        return state

    def steps(entries: list[dict], source: str) -> int:
        return sum(int(e["num_steps"]) for e in entries if str(e.get("source", "")) == source)

    kept_current = {t for t in sources if t != restored_source and steps(current, t) >= steps(saved, t)}
    history = [e for e in current if str(e.get("source", "")) in kept_current]
    history += [e for e in saved if str(e.get("source", "")) not in kept_current]
    state["history"] = history
    return state
