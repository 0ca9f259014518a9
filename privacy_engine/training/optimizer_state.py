"""A ``DPOptimizer``'s state dict: the wrapped optimizer's plus the DP state, checked before it loads.

The DP state (under ``"privacy_engine.dp_state"``) holds the noise mechanism's state (outside secure
mode, its generator states: the future noise), the clipper's accumulator and the step counters, so a
resumed run continues exactly. Everything is checked before anything is loaded; a failed load
changes nothing.
"""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from privacy_engine.training.optimizer_arguments import check_noise_multiplier
from privacy_engine.training.schedules import checked_noise_multiplier

if TYPE_CHECKING:
    from privacy_engine.clipping import PerSampleGradientClipper
    from privacy_engine.noise import NoiseMechanism

__all__ = ["STATE_DICT_KEY", "OptimizerState"]

STATE_DICT_KEY = "privacy_engine.dp_state"
_DP_STATE_KEYS = ("noise", "clipper", "noise_multiplier", "steps_taken", "skip_next_step", "in_logical_step")


class OptimizerState:
    """``DPOptimizer``'s ``state_dict``, ``check_state_dict`` and ``load_state_dict`` (a mixin)."""

    original_optimizer: Optimizer
    clipper: PerSampleGradientClipper
    noise: NoiseMechanism
    noise_multiplier: float
    initial_noise_multiplier: float
    steps_taken: int
    _skip_next_step: bool
    _in_logical_step: bool
    canaries: Any

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus the DP state under ``"privacy_engine.dp_state"``:
        noise mechanism (outside secure mode its generator states: the future noise), clipper
        accumulator, counters. Plain data only (loads with ``torch.load(weights_only=True)``).
        Keep it as secret as the training data."""
        state = self.original_optimizer.state_dict()
        state[STATE_DICT_KEY] = {
            "noise": self.noise.state_dict(),
            "clipper": self.clipper.state_dict(),
            "noise_multiplier": self.noise_multiplier,
            "initial_noise_multiplier": self.initial_noise_multiplier,
            "steps_taken": self.steps_taken,
            "skip_next_step": self._skip_next_step,
            "in_logical_step": self._in_logical_step,
        }
        if self.canaries is not None:  # only with an audit: without one the state is exactly as before
            state[STATE_DICT_KEY]["canaries"] = self.canaries.state_dict()
        return state

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise ``ValueError`` naming the first mismatch unless ``load_state_dict(state_dict)``
        restores it onto this optimizer; changes nothing.

        ==============================================  ==================================
        mismatch                                        error names
        ==============================================  ==================================
        not a dict / no DP state                        the missing part
        number of param groups / parameters per group   the group
        a hyperparameter of this class missing          the keys (another optimizer class)
        per-parameter state for an unknown index, or    the parameter index and state key
        a tensor of another shape than the parameter
        noise state (mechanism, layout, generators)     see NoiseMechanism.check_state_dict
        clipper mode / bounds / accumulator shapes      the clipper field
        counters of the wrong type                      the counter
        ==============================================  ==================================
        """
        if not isinstance(state_dict, dict) or STATE_DICT_KEY not in state_dict:
            raise ValueError(
                f"the optimizer state has no DP state ({STATE_DICT_KEY!r}): it was not saved from a DPOptimizer"
            )
        saved_groups = self._check_param_groups(state_dict.get("param_groups"))
        self._check_parameter_state(saved_groups, state_dict.get("state"))
        self._check_dp_state(state_dict[STATE_DICT_KEY])

    def _check_param_groups(self, saved_groups: Any) -> list[dict[str, Any]]:
        """The saved param groups, checked against the wrapped optimizer's (same count, same number of
        parameters each, every hyperparameter of its class present)."""
        groups = self.original_optimizer.param_groups
        if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
            count = len(saved_groups) if isinstance(saved_groups, list) else saved_groups
            raise ValueError(f"the optimizer state has {count} param groups, this optimizer has {len(groups)}")
        for index, (saved, group) in enumerate(zip(saved_groups, groups)):
            if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
                raise ValueError(f"the optimizer state's param group {index} is not a param group")
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"the optimizer state's param group {index} has {len(saved['params'])} parameters, this "
                    f"optimizer's has {len(group['params'])}: make the same parameters private as in the saved run"
                )
            # Every hyperparameter of this optimizer's class must be there (extra keys, such as an LR
            # scheduler's initial_lr, are fine).
            lacking = sorted(set(self.original_optimizer.defaults) - set(saved))
            if lacking:
                raise ValueError(
                    f"the optimizer state's param group {index} lacks {lacking}, which this "
                    f"{type(self.original_optimizer).__name__} has: another optimizer class was saved"
                )
        return saved_groups

    def _check_parameter_state(self, saved_groups: list[dict[str, Any]], per_parameter: Any) -> None:
        """Per-parameter state only for parameters the groups list, its tensors of their shapes."""
        params = [p for group in self.original_optimizer.param_groups for p in group["params"]]
        saved_ids = [i for saved in saved_groups for i in saved["params"]]
        position = {saved_id: n for n, saved_id in enumerate(saved_ids)}
        if not isinstance(per_parameter, dict):
            raise ValueError("the optimizer state's 'state' is not a dict")
        for key, values in per_parameter.items():
            if key not in position:
                raise ValueError(f"the optimizer state holds state for parameter {key!r}, which no param group lists")
            param = params[position[key]]
            for name, value in values.items() if isinstance(values, dict) else ():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(param.shape):
                    raise ValueError(
                        f"the optimizer state's {name!r} for parameter {position[key]} has shape {list(value.shape)}, "
                        f"the parameter has shape {list(param.shape)}: resume with the same model"
                    )

    def _check_dp_state(self, dp_state: Any) -> None:
        """The DP state: every key present, counters of their types, noise and clipper states that
        fit this run."""
        missing = [key for key in _DP_STATE_KEYS if not isinstance(dp_state, dict) or key not in dp_state]
        if missing:
            raise ValueError(f"the optimizer's DP state lacks {missing} (it was altered)")
        try:
            check_noise_multiplier(dp_state["noise_multiplier"])
            check_noise_multiplier(dp_state.get("initial_noise_multiplier", dp_state["noise_multiplier"]))
            checked_noise_multiplier(self, self._noise_multiplier_to_restore(dp_state))
        except TypeError as error:
            raise ValueError(str(error)) from error
        steps = dp_state["steps_taken"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"the optimizer's DP state has steps_taken={steps!r}; expected an int >= 0")
        for flag in ("skip_next_step", "in_logical_step"):
            if not isinstance(dp_state[flag], bool):
                raise ValueError(f"the optimizer's DP state has {flag}={dp_state[flag]!r}; expected a bool")
        self.noise.check_state_dict(dp_state["noise"], tensors=self.clipper.params)
        self._check_clipper_state(dp_state["clipper"])
        if (self.canaries is None) != ("canaries" not in dp_state):
            saved, here = ("with", "without") if self.canaries is None else ("without", "with")
            raise ValueError(
                f"the optimizer's DP state was saved {saved} an audit's canaries and this optimizer is {here}: "
                f"make_private with the audit= of the saved run"
            )
        if self.canaries is not None:
            self.canaries.check_state_dict(dp_state["canaries"])

    def _noise_multiplier_to_restore(self, dp_state: dict[str, Any]) -> float:
        """The sigma of the next release after loading ``dp_state``: the saved sigma in force (an exact resume,
        a noise schedule's value included) when the saved run was built with this run's sigma; otherwise this
        run's own sigma (a resume at a changed sigma: the ledger keeps the saved steps at their sigma and the
        steps from here on are recorded at this one)."""
        saved_initial = float(dp_state.get("initial_noise_multiplier", dp_state["noise_multiplier"]))
        if saved_initial == self.initial_noise_multiplier:
            return float(dp_state["noise_multiplier"])
        return self.noise_multiplier

    def _check_clipper_state(self, saved: Any) -> None:
        current = self.clipper.state_dict()
        if not isinstance(saved, dict) or not {"accumulated", "totals", "bounds", "clipping"} <= set(saved):
            raise ValueError("the clipper state is not a dict from PerSampleGradientClipper.state_dict()")
        if saved["clipping"] != current["clipping"] or list(saved["bounds"]) != list(current["bounds"]):
            raise ValueError(
                f"the clipper state was saved with clipping={saved['clipping']!r}, max_grad_norm bounds "
                f"{list(saved['bounds'])}; this run has clipping={current['clipping']!r}, bounds "
                f"{list(current['bounds'])}: make_private with the clipping of the saved run"
            )
        accumulated = saved["accumulated"]
        if not isinstance(accumulated, dict):
            raise ValueError("the clipper state's accumulator is not a dict")
        params = self.clipper.params
        for index, total in accumulated.items():
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(params):
                raise ValueError(f"the clipper state accumulates parameter {index!r}, which this run does not have")
            if not isinstance(total, torch.Tensor) or tuple(total.shape) != tuple(params[index].shape):
                raise ValueError(
                    f"the clipper state's sum for parameter {index} does not have the parameter's shape "
                    f"{list(params[index].shape)}"
                )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()`` so training continues exactly (same noise as the run that
        saved it; secure mode: fresh OS-seeded generators). A plain optimizer state dict (no DP
        state) loads the wrapped optimizer only, with a warning. Everything is checked first
        (``check_state_dict``); on an error nothing is changed."""
        state_dict = dict(state_dict)
        if STATE_DICT_KEY not in state_dict:
            warnings.warn(
                "state_dict has no DP state (saved from a plain optimizer?): only the wrapped optimizer's "
                "state is loaded; the noise continues from its current state"
            )
            self.original_optimizer.load_state_dict(state_dict)
            return
        self.check_state_dict(state_dict)
        dp_state = state_dict.pop(STATE_DICT_KEY)
        inner_backup = copy.deepcopy(self.original_optimizer.state_dict())
        clipper_backup = self.clipper.state_dict()
        noise_backup = self.noise.state_dict()
        try:
            self.original_optimizer.load_state_dict(state_dict)
            self.clipper.load_state_dict(dp_state["clipper"])
            self.noise.load_state_dict(dp_state["noise"])
        except BaseException:
            self.original_optimizer.load_state_dict(inner_backup)
            self.clipper.load_state_dict(clipper_backup)
            self.noise.load_state_dict(noise_backup)
            raise
        if self.canaries is not None:  # checked above: loading cannot fail
            self.canaries.load_state_dict(dp_state["canaries"])
        self.noise_multiplier = self._noise_multiplier_to_restore(dp_state)  # checked above: cannot raise
        self.steps_taken = int(dp_state["steps_taken"])
        self._skip_next_step = bool(dp_state["skip_next_step"])
        self._in_logical_step = bool(dp_state["in_logical_step"])
