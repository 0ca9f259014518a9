"""Noise and clip-norm schedules: a noise multiplier (sigma) and a clip norm (C) that change between releases.

A ``DPOptimizer``'s ``noise_multiplier`` and ``max_grad_norm`` may be set between steps (that is all a
schedule does); each release is noised at the sigma and clipped at the C in force when it is released, and
recorded with the accountant at that sigma. The accountant merges consecutive steps of equal sigma into one
entry and composes the entries in order (a ``ComposedDpEvent`` of one ``SelfComposedDpEvent`` of
``PoissonSampledDpEvent(GaussianDpEvent)`` per run of equal sigma), which dp-accounting composes exactly: the
epsilon of a scheduled run is the epsilon of the steps that ran. C does not enter the accounting (the noise
is drawn at sigma times the C in force, so every step is the Gaussian mechanism at sigma).

The schedulers here follow torch's LR schedulers: built on the optimizer (which applies the value for
counter 0), then ``step()`` once per epoch or per optimizer step, as the user decides; ``state_dict()`` holds
plain data only (the counter and the numbers, never a function), so it loads with
``torch.load(weights_only=True)`` and through ``save_checkpoint(noise_scheduler=..., grad_clip_scheduler=...)``.

What is refused, before anything changes (``DPOptimizer.noise_multiplier`` / ``max_grad_norm`` setters):

==============================================  ===============================================
case                                            result
==============================================  ===============================================
sigma changed with correlated noise (BandMF,    ValueError: BandMF's guarantee is for one noise
any mechanism whose event is not DP-SGD's)      scale on every row
sigma changed under truncated sampling          ValueError: the worst group size was chosen at
(``max_batch_size``)                            the planned sigma
sigma < 0, NaN, inf / not a number              ValueError / TypeError naming noise_multiplier
sigma with adaptive clipping                    allowed while sigma_delta exists (ValueError
                                                naming unclipped_num_std otherwise)
C changed with adaptive clipping                ValueError: the clip norms are adaptive's
C changed while clipped sums wait for the       ValueError: they were clipped at the old C
release (micro-batches of one logical step,
fast clipping after backward)
C changed with BandMF                           allowed: the row of step t is scaled by
                                                C_t / C_0 (``BandMFNoise.clip_norm_may_change``)
C < 0, NaN / not a number                       ValueError / TypeError naming max_grad_norm
C = inf with sigma > 0                          ValueError (no finite noise hides it)
==============================================  ===============================================
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from typing import Any

from accountants.events import DEFAULT_EVENT_KIND
from privacy_engine.settings_checks import check_max_grad_norms, check_noise_multiplier, check_noise_std

__all__ = [
    "ExponentialGradClip",
    "ExponentialNoise",
    "GradClipScheduler",
    "LambdaGradClip",
    "LambdaNoise",
    "NoiseScheduler",
    "StepGradClip",
    "StepNoise",
    "checked_clip_bounds",
    "checked_noise_multiplier",
]


def checked_noise_multiplier(optimizer: Any, value: Any) -> float:
    """``value`` as the noise multiplier ``optimizer`` may release its next steps at; raises (changing
    nothing) what the module table says. A value equal to the current one is always accepted."""
    value = check_noise_multiplier(value)
    current = optimizer.__dict__.get("_noise_multiplier")
    if current is None or value == current:
        return value
    event = optimizer.privacy_event
    if event.num_bands > 1 or event.kind != DEFAULT_EVENT_KIND:
        raise ValueError(
            f"noise_multiplier cannot change from {current} to {value} with {type(optimizer.noise).__name__}: its noise "
            f"is correlated across steps (event {event.kind!r}, num_bands={event.num_bands}) and its guarantee covers "
            "one noise scale on every row. Noise schedules work with DP-SGD's Gaussian noise; keep sigma fixed here "
            "(a clip-norm schedule is allowed)"
        )
    if getattr(optimizer.accountant, "max_batch_size", None) is not None:
        raise ValueError(
            f"noise_multiplier cannot change from {current} to {value} under truncated sampling (max_batch_size): "
            "each step is accounted at the group size whose epsilon was the largest at the planned sigma, and at "
            "another sigma another group size may be the worst. Keep sigma fixed with max_batch_size"
        )
    adaptive = optimizer.clipper.adaptive
    if adaptive is not None:
        adaptive.gradient_noise_multiplier(value)  # raises, naming unclipped_num_std, if no sigma_delta exists
    check_noise_std(value, optimizer.clipper.sensitivity)
    return value


def checked_clip_bounds(optimizer: Any, value: Any) -> tuple[float, ...]:
    """``value`` (one number, or for per-layer clipping one per group) as the clipper's bounds per group, the
    clip norm the next releases clip at; raises (changing nothing) what the module table says."""
    clipper = optimizer.clipper
    bounds = check_max_grad_norms(value, clipping=clipper.config.clipping)
    if isinstance(bounds, tuple):
        if len(bounds) != clipper.num_groups:
            raise ValueError(
                f"max_grad_norm has {len(bounds)} bounds, the clipper has {clipper.num_groups} groups: give one per "
                "group, or one number (split equally over the groups)"
            )
        per_group = bounds
    else:
        per_group = (
            (bounds,) if clipper.num_groups == 1 else (bounds / math.sqrt(clipper.num_groups),) * clipper.num_groups
        )
    if per_group == tuple(clipper.bounds):
        return per_group
    if clipper.adaptive is not None:
        raise ValueError(
            "max_grad_norm cannot be set with adaptive clipping: the clip norms in force are adaptive clipping's, "
            "set from the released counts at every step. Use fixed clipping for a clip-norm schedule"
        )
    if clipper.has_accumulated:
        raise ValueError(
            "max_grad_norm cannot change while clipped sums wait for the release (micro-batches of one logical "
            "step, or a fast-clipping backward before step()): they were clipped at the old bound and the noise "
            "would be drawn at the new one. Change it after optimizer.step() (schedulers step after it)"
        )
    total = 1.0 if clipper.config.rescale_to_unit_norm else math.sqrt(sum(b * b for b in per_group))
    check_noise_std(optimizer.noise_multiplier, total)
    if optimizer.privacy_event.num_bands > 1 and not isinstance(
        getattr(optimizer.noise, "clip_norm_may_change", None), bool
    ):
        raise ValueError(
            f"max_grad_norm cannot change with {type(optimizer.noise).__name__}: its noise is correlated across steps "
            "and it has no clip_norm_may_change switch to scale each row by the clip norm in force"
        )
    return per_group


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, (str, int)) and _is_plain(item) for key, item in value.items())
    return False


class _Scheduler(abc.ABC):
    """A torch-LR-scheduler-like counter that sets one optimizer attribute at each ``step()``."""

    _attribute: str

    def __init__(self, optimizer: Any, *, last_epoch: int = -1) -> None:
        if not hasattr(optimizer, self._attribute):
            raise ValueError(
                f"{type(self).__name__} needs an optimizer with a .{self._attribute} attribute: pass the DPOptimizer "
                "make_private returned"
            )
        if isinstance(last_epoch, bool) or not isinstance(last_epoch, int) or last_epoch < -1:
            raise ValueError(f"last_epoch must be an int >= -1; got {last_epoch!r}")
        self.optimizer = optimizer
        self.last_epoch = last_epoch
        self.step()

    @abc.abstractmethod
    def _value(self) -> Any:
        """The value for counter ``last_epoch`` (already advanced)."""

    def step(self) -> None:
        """Advance the counter by one and set the optimizer's value for it (in force from the next release).
        Raises what the optimizer's setter raises; the counter then stays where it was."""
        self.last_epoch += 1
        try:
            setattr(self.optimizer, self._attribute, self._value())
        except BaseException:
            self.last_epoch -= 1
            raise

    def state_dict(self) -> dict[str, Any]:
        """Every attribute but the optimizer that is plain data (numbers, strings, None, and lists, tuples and
        dicts of them: the counter ``last_epoch``, ``gamma``, ``step_size``, a ``Lambda`` schedule's base value,
        a subclass's own numbers), so ``torch.load(weights_only=True)`` reads it. Functions are left out (Opacus
        keeps them, which only a full unpickling reads back): a ``Lambda`` schedule is rebuilt with its function."""
        return {name: value for name, value in self.__dict__.items() if name != "optimizer" and _is_plain(value)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()``. The optimizer's value is not set here: it is restored with the optimizer's
        own state (the value in force when the checkpoint was written). ``ValueError``, nothing changed, for a
        state that is not a dict of plain data or that names ``optimizer``."""
        if not isinstance(state_dict, dict) or not all(isinstance(k, str) for k in state_dict):
            raise ValueError(f"a scheduler state must be a dict from state_dict(); got {type(state_dict).__name__}")
        bad = sorted(name for name, value in state_dict.items() if name == "optimizer" or not _is_plain(value))
        if bad:
            raise ValueError(f"{type(self).__name__} state holds {bad}, which are not plain data (or the optimizer)")
        self.__dict__.update(state_dict)


class NoiseScheduler(_Scheduler):
    """Base class of noise schedules: ``step()`` sets ``optimizer.noise_multiplier`` to
    ``get_noise_multiplier()`` (subclasses implement it; ``last_epoch`` is the counter).

    Guarantee: each release is noised at, and recorded with the accountant at, the sigma in force when it is
    released; the epsilon reported is dp-accounting's composition of the steps that ran (module docstring).
    Refusals (correlated noise, invalid sigma): ``DPOptimizer``'s setter, before anything changes."""

    _attribute = "noise_multiplier"

    def get_noise_multiplier(self) -> float:
        """The noise multiplier for counter ``last_epoch``."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_noise_multiplier()")

    def _value(self) -> float:
        return self.get_noise_multiplier()


class GradClipScheduler(_Scheduler):
    """Base class of clip-norm schedules: ``step()`` sets ``optimizer.max_grad_norm`` to
    ``get_max_grad_norm()`` (subclasses implement it; ``last_epoch`` is the counter).

    Guarantee: every example's contribution to a release is clipped to the C in force at that release and the
    noise is drawn at sigma times that C, so each step stays the Gaussian mechanism at sigma (C is not
    accounted). Refusals (adaptive clipping, sums waiting at the old C, invalid C): ``DPOptimizer``'s setter."""

    _attribute = "max_grad_norm"

    def get_max_grad_norm(self) -> float:
        """The clip norm for counter ``last_epoch``."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_max_grad_norm()")

    def _value(self) -> float:
        return self.get_max_grad_norm()


class _ExponentialRule:
    """The value multiplied by ``gamma`` at every ``step()`` (the factors accumulate): v_t = v_0 gamma^t."""

    def __init__(self, optimizer: Any, *, gamma: float, last_epoch: int = -1) -> None:
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)  # type: ignore[call-arg]

    def _value(self) -> float:
        current = getattr(self.optimizer, self._attribute)  # type: ignore[attr-defined]
        return current if self.last_epoch == 0 else current * self.gamma  # type: ignore[attr-defined]


class _StepRule:
    """The value multiplied by ``gamma`` every ``step_size`` calls of ``step()`` (the factors accumulate)."""

    def __init__(self, optimizer: Any, *, step_size: int, gamma: float, last_epoch: int = -1) -> None:
        if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size < 1:
            raise ValueError(f"step_size must be an int >= 1; got {step_size!r}")
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer, last_epoch=last_epoch)  # type: ignore[call-arg]

    def _value(self) -> float:
        current = getattr(self.optimizer, self._attribute)  # type: ignore[attr-defined]
        multiple = self.last_epoch > 0 and self.last_epoch % self.step_size == 0  # type: ignore[attr-defined]
        return current * self.gamma if multiple else current


class _LambdaRule:
    """v_t = v_base * ``function(t)``, v_base the optimizer's value when the scheduler is built (the factors do
    not accumulate); a subclass names the function's keyword (``_function_name``) and the base's attribute."""

    _function_name: str
    _base_name: str

    def __init__(self, optimizer: Any, function: Callable[[int], float], *, last_epoch: int) -> None:
        if not callable(function):
            raise TypeError(f"{self._function_name} must be a function of the counter; got {function!r}")
        setattr(self, self._function_name, function)
        setattr(self, self._base_name, getattr(optimizer, self._attribute))  # type: ignore[attr-defined]
        super().__init__(optimizer, last_epoch=last_epoch)  # type: ignore[call-arg]

    def _value(self) -> float:
        function = getattr(self, self._function_name)
        return getattr(self, self._base_name) * function(self.last_epoch)  # type: ignore[attr-defined]


class ExponentialNoise(_ExponentialRule, NoiseScheduler):
    """sigma multiplied by ``gamma`` at every ``step()`` (the factors accumulate): sigma_t = sigma_0 gamma^t."""

    def get_noise_multiplier(self) -> float:
        """The current sigma at counter 0, else the current sigma times ``gamma``."""
        return self._value()


class StepNoise(_StepRule, NoiseScheduler):
    """sigma multiplied by ``gamma`` every ``step_size`` calls of ``step()`` (the factors accumulate)."""

    def get_noise_multiplier(self) -> float:
        """The current sigma times ``gamma`` when the counter is a positive multiple of ``step_size``."""
        return self._value()


class LambdaNoise(_LambdaRule, NoiseScheduler):
    """sigma_t = sigma_base * ``noise_lambda(t)``, sigma_base the optimizer's sigma when the scheduler is built
    (the factors do not accumulate). ``state_dict`` keeps ``base_noise_multiplier``, not the function."""

    _function_name = "noise_lambda"
    _base_name = "base_noise_multiplier"

    def __init__(self, optimizer: Any, *, noise_lambda: Callable[[int], float], last_epoch: int = -1) -> None:
        super().__init__(optimizer, noise_lambda, last_epoch=last_epoch)

    def get_noise_multiplier(self) -> float:
        """``base_noise_multiplier * noise_lambda(last_epoch)``."""
        return self._value()


class ExponentialGradClip(_ExponentialRule, GradClipScheduler):
    """C multiplied by ``gamma`` at every ``step()`` (the factors accumulate): C_t = C_0 gamma^t."""

    def get_max_grad_norm(self) -> float:
        """The current C at counter 0, else the current C times ``gamma``."""
        return self._value()


class StepGradClip(_StepRule, GradClipScheduler):
    """C multiplied by ``gamma`` every ``step_size`` calls of ``step()`` (the factors accumulate)."""

    def get_max_grad_norm(self) -> float:
        """The current C times ``gamma`` when the counter is a positive multiple of ``step_size``."""
        return self._value()


class LambdaGradClip(_LambdaRule, GradClipScheduler):
    """C_t = C_base * ``scheduler_function(t)``, C_base the optimizer's C when the scheduler is built (the
    factors do not accumulate). ``state_dict`` keeps ``base_max_grad_norm``, not the function."""

    _function_name = "scheduler_function"
    _base_name = "base_max_grad_norm"

    def __init__(self, optimizer: Any, *, scheduler_function: Callable[[int], float], last_epoch: int = -1) -> None:
        super().__init__(optimizer, scheduler_function, last_epoch=last_epoch)

    def get_max_grad_norm(self) -> float:
        """``base_max_grad_norm * scheduler_function(last_epoch)``."""
        return self._value()
