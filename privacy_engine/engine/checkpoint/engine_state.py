"""The engine's part of a checkpoint: its noise plan as plain data, and the check that a saved
engine state fits the engine it is loaded into."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from privacy_engine.engine.noise_plan import BandCandidate, NoisePlan

__all__ = ["PLAN_FIELDS_TO_MATCH", "check_engine_state", "plan_from_dict", "plan_to_dict"]

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
    ``PLAN_FIELDS_TO_MATCH``. Changes nothing."""
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
        for field in PLAN_FIELDS_TO_MATCH:
            saved_value, value = getattr(plan, field), getattr(current, field)
            if saved_value != value:
                raise ValueError(
                    f"it was saved from a run with {field}={saved_value!r}, this engine was made private with "
                    f"{field}={value!r}: call make_private with the settings of the saved run"
                )
    return plan
