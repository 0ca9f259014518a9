"""The one check of each setting, whichever way it enters: ``make_private``'s keywords
(``PrivacyOptions``), a hand-built ``DPOptimizer``, ``ClippingConfig`` and
``NoiseMechanism.add_noise_`` all call the function below for the setting, so a value is refused by
the same code with the same message everywhere. Each function returns the value normalised (a float,
an int, a tuple) and raises naming the argument, the allowed range and the value received.

Lowest layer of the package: it imports nothing from ``privacy_engine`` (only torch and the
``accountants`` package), so every folder (clipping, noise, training, engine) may call it. The
``accountants`` package keeps its own entry checks (it is usable alone); ``target_delta`` is checked
by its ``check_delta``, the function the budget uses.

=================================  ====================================  ==================================
setting                            function                              refuses
=================================  ====================================  ==================================
noise_multiplier                   ``check_noise_multiplier``            not a real number; < 0, NaN, inf
max_grad_norm (one bound)          ``check_max_grad_norm``               not a real number; < 0, NaN (0
                                                                         too with ``positive=True``)
max_grad_norm (flat / per layer)   ``check_max_grad_norms``              a list for "flat"; an empty or
                                                                         non-numeric list
noise_multiplier * max_grad_norm   ``check_noise_std``                   an inf bound with noise; a std
                                                                         above the limit
rescale_to_unit_norm               ``check_rescale_to_unit_norm``        not a bool; True with a total
                                                                         bound of 0 or inf
clipping                           ``check_clipping``                    not "flat" / "per_layer"
loss_reduction                     ``check_loss_reduction``              not "mean" / "sum"
grad_sample_mode                   ``check_grad_sample_mode``            not one of ``GRAD_SAMPLE_MODES``
expected_batch_size                ``check_expected_batch_size``         missing with "mean"; not finite
                                                                         and > 0
batch_first, nan_safe, ... (bool)  ``check_flag``                        anything but True / False
privacy_unit                       ``check_privacy_unit``                not one of ``PRIVACY_UNITS``
target_epsilon                     ``check_target_epsilon``              not finite and > 0
target_delta                       ``check_target_delta``                outside (0, 1)
epochs, total_steps, num_bands,    ``check_count``                       not an int >= the minimum
max_batch_size, num_groups, ...                                          (bools refused)
sample_rate (Poisson sampling)     ``check_sample_rate``                 not a number in (0, 1]
noise_seed                         ``check_noise_seed``                  not an int >= 0
noise_generator                    ``check_noise_generator``             not a ``torch.Generator``
noise_stream                       ``check_noise_stream``                not one of ``NOISE_STREAMS``
noise_seed / noise_generator with  ``check_no_seed_for_given_noise``     either set (the mechanism is
a ready noise mechanism                                                  seeded by whoever built it)
noise_seed / noise_generator in    ``check_unseeded_in_secure_mode``     either set (secure noise is
secure mode                                                              seeded from the OS only)
clipping="adaptive" (engine)       ``check_clipping(adaptive=True)``     not one of ``CLIPPING_MODES`` +
                                                                         ``ADAPTIVE_CLIPPING_MODES``
target_unclipped_quantile          ``check_target_unclipped_quantile``   not a number in [0, 1]
clipbound_learning_rate            ``check_clipbound_learning_rate``     not finite and >= 0
min_clipbound, max_clipbound       ``check_clipbounds``                  min < 0, max not finite, min >= max
unclipped_num_std                  ``check_unclipped_num_std``           not finite and >= 0
noise_multiplier with              ``check_unclipped_num_std_for``       sigma > 0 and 2 sigma_b <= sqrt(G)
unclipped_num_std (adaptive)                                             sigma (the count would cost more
                                                                         than the whole step)
=================================  ====================================  ==================================
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch

from accountants._validation import check_delta

__all__ = [
    "ADAPTIVE_CLIPPING_MODES",
    "CLIPPING_MODES",
    "GRAD_SAMPLE_MODES",
    "LOSS_REDUCTIONS",
    "NOISE_STREAMS",
    "PRIVACY_UNITS",
    "check_clipbound_learning_rate",
    "check_clipbounds",
    "check_clipping",
    "check_count",
    "check_expected_batch_size",
    "check_flag",
    "check_grad_sample_mode",
    "check_loss_reduction",
    "check_max_grad_norm",
    "check_max_grad_norms",
    "check_no_seed_for_given_noise",
    "check_noise_generator",
    "check_noise_multiplier",
    "check_noise_seed",
    "check_noise_std",
    "check_noise_stream",
    "check_privacy_unit",
    "check_rescale_to_unit_norm",
    "check_sample_rate",
    "check_target_delta",
    "check_target_epsilon",
    "check_target_unclipped_quantile",
    "check_unclipped_num_std",
    "check_unclipped_num_std_for",
    "check_unseeded_in_secure_mode",
    "real_number",
    "total_bound",
]

CLIPPING_MODES = ("flat", "per_layer")
#: The noise streams (``privacy_engine.noise.counter_stream``): the serial Mersenne Twister (the default, and
#: every checkpoint written before the counter stream) and the counter-keyed stream drawn on several threads.
NOISE_STREAMS = ("mt19937", "counter-v1")
#: The engine's adaptive modes (Andrew et al. 2021): flat / per-layer clipping whose bound(s) track a quantile.
ADAPTIVE_CLIPPING_MODES = ("adaptive", "per_layer_adaptive")
LOSS_REDUCTIONS = ("mean", "sum")
#: What one neighbouring dataset differs by: one example, or one user (all of its examples).
PRIVACY_UNITS = ("example", "user")
# "ew" (torch's expanded weights) computes the same exact per-sample gradients as the hooks here,
# so it is an alias of "hooks"; "no_op" leaves per-sample gradients to the training loop.
GRAD_SAMPLE_MODES = ("auto", "hooks", "functorch", "ghost", "ew", "no_op")  # "auto": engine.mode_choice


def _is_real(value: Any) -> bool:
    if type(value) is float or type(value) is int:
        return True  # the usual case, checked at every step: without the (slower) ABC check below
    # bool is an int subclass: True as a bound or a noise multiplier is a bug, not a number.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def real_number(name: str, value: Any) -> float:
    """``value`` as a float; ``TypeError`` naming ``name`` unless it is a real number (bool is not)."""
    if not _is_real(value):
        raise TypeError(f"{name} must be a real number; got {value!r}")
    return float(value)


# ---------------------------------------------------------------------------------------------- the noise
def check_noise_multiplier(noise_multiplier: Any) -> float:
    """sigma (noise std / sensitivity) as a float.

    ======================  ====================================
    case                    result
    ======================  ====================================
    0                       0.0 (no noise: no privacy)
    finite and > 0          the float
    < 0, NaN, inf           ValueError naming noise_multiplier
    not a real number/bool  TypeError naming noise_multiplier
    ======================  ====================================
    """
    if not _is_real(noise_multiplier):
        raise TypeError(f"noise_multiplier must be a real number >= 0; got {noise_multiplier!r}")
    value = float(noise_multiplier)
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"noise_multiplier must be finite and >= 0 (0: no noise, no privacy); got {noise_multiplier!r}"
        )
    return value


def check_noise_std(noise_multiplier: float, max_grad_norm: float, *, limit: float = math.inf) -> float:
    """The noise std ``noise_multiplier * max_grad_norm`` of already checked values (the total bound
    for per-layer clipping); 0.0 means no noise.

    Guarantee: a returned std is finite and at most ``limit``, and is never taken for unclipped
    gradients (``max_grad_norm = inf``) with noise: no finite noise hides them.

    ==============================  ==================================================
    case                            result
    ==============================  ==================================================
    noise_multiplier = 0            0.0 (whatever the bound, inf included)
    max_grad_norm = 0               0.0
    max_grad_norm = inf, sigma > 0  ValueError: set a finite max_grad_norm
    std > limit, or overflow        ValueError naming noise_multiplier * max_grad_norm
    ==============================  ==================================================
    """
    if noise_multiplier == 0.0:
        return 0.0
    if math.isinf(max_grad_norm):
        raise ValueError(
            "max_grad_norm is inf (no clipping) with noise_multiplier > 0: no finite noise makes unclipped "
            "gradients private. Set a finite max_grad_norm, or noise_multiplier=0 for non-private training."
        )
    std = noise_multiplier * max_grad_norm
    if not std <= limit:  # also catches an overflow to inf
        within = "finite" if math.isinf(limit) else f"at most {limit:.3g}"
        raise ValueError(
            f"noise_multiplier * max_grad_norm must be {within}; got noise_multiplier={noise_multiplier!r} with "
            f"max_grad_norm={max_grad_norm!r}. Lower one of them."
        )
    return std


# ---------------------------------------------------------------------------------------------- clipping
def check_max_grad_norm(max_grad_norm: Any, *, name: str = "max_grad_norm", positive: bool = False) -> float:
    """One clipping bound C as a float (``name``: the argument, or ``max_grad_norm[i]`` in a list).

    ======================  ===========================================
    case                    result
    ======================  ===========================================
    C > 0, finite           the float
    C = inf                 inf (no clipping; noise then refused by
                            ``check_noise_std``)
    C = 0                   0.0 (every gradient clipped to zero);
                            ValueError with ``positive=True``
    C < 0 or NaN            ValueError naming ``name``
    not a real number/bool  TypeError naming ``name``
    ======================  ===========================================
    """
    value = real_number(name, max_grad_norm)
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be >= 0 (inf disables clipping); got {max_grad_norm!r}")
    if positive and value == 0:
        raise ValueError(f"{name} must be > 0 (0 would clip every gradient to zero); got {max_grad_norm!r}")
    return value


def check_max_grad_norms(max_grad_norm: Any, *, clipping: str, positive: bool = False) -> float | tuple[float, ...]:
    """``max_grad_norm`` for ``clipping`` (already checked): one bound for ``"flat"``; for
    ``"per_layer"`` one bound (split over the groups) or a non-empty list of them, returned as a tuple.
    Each bound by ``check_max_grad_norm`` (``positive`` passed on). How many bounds a model needs is
    the plan's question (it knows the layers)."""
    listed = not isinstance(max_grad_norm, (str, bytes)) and isinstance(max_grad_norm, Iterable)
    if clipping == "flat" and listed:
        raise TypeError(
            f"max_grad_norm must be one number for clipping='flat'; got {max_grad_norm!r} (one bound per layer "
            f"needs clipping='per_layer')"
        )
    if _is_real(max_grad_norm) or clipping == "flat":
        return check_max_grad_norm(max_grad_norm, positive=positive)  # a bad value is refused there
    if not listed:
        raise TypeError(f"max_grad_norm must be a number or a list of numbers; got {max_grad_norm!r}")
    bounds = tuple(max_grad_norm)
    if not bounds:
        raise ValueError("max_grad_norm is an empty list; give one bound per layer (or one number for all)")
    return tuple(
        check_max_grad_norm(bound, name=f"max_grad_norm[{index}]", positive=positive)
        for index, bound in enumerate(bounds)
    )


def total_bound(max_grad_norm: float | tuple[float, ...]) -> float:
    """The L2 bound of a whole clipped gradient, from checked bounds: ``C`` for one number (flat, or
    split as ``C / sqrt(G)`` over ``G`` layers), ``sqrt(sum C_g^2)`` for one bound per group."""
    return math.hypot(*max_grad_norm) if isinstance(max_grad_norm, tuple) else max_grad_norm


def check_rescale_to_unit_norm(rescale_to_unit_norm: Any, total_bound: float) -> bool:
    """The flag, which needs a total bound that is finite and > 0 (the clipped gradients are divided
    by it). ``TypeError`` unless a bool; ``ValueError`` naming both settings otherwise."""
    check_flag("rescale_to_unit_norm", rescale_to_unit_norm)
    if rescale_to_unit_norm and not 0 < total_bound < math.inf:
        raise ValueError(
            f"rescale_to_unit_norm needs a finite max_grad_norm > 0 (the clipped gradients are divided by the "
            f"total bound); got a total bound of {total_bound!r}"
        )
    return rescale_to_unit_norm


def check_clipping(clipping: Any, *, adaptive: bool = False) -> str:
    """``"flat"`` or ``"per_layer"`` (with ``adaptive=True``, where the engine's options enter, also
    ``"adaptive"`` and ``"per_layer_adaptive"``); ``ValueError`` naming ``clipping`` otherwise."""
    modes = CLIPPING_MODES + ADAPTIVE_CLIPPING_MODES if adaptive else CLIPPING_MODES
    if not isinstance(clipping, str) or clipping not in modes:
        hint = ""
        if clipping in ADAPTIVE_CLIPPING_MODES:
            hint = " (adaptive clipping is the optimizer's: give it an AdaptiveClipping, or use make_private)"
        raise ValueError(f"clipping must be one of {modes}; got {clipping!r}{hint}")
    return clipping


def check_grad_sample_mode(grad_sample_mode: Any) -> str:
    """One of ``GRAD_SAMPLE_MODES`` (how per-sample gradients or their norms are computed);
    ``ValueError`` naming ``grad_sample_mode`` otherwise."""
    if not isinstance(grad_sample_mode, str) or grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise ValueError(f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES}; got {grad_sample_mode!r}")
    return grad_sample_mode


def check_loss_reduction(loss_reduction: Any) -> str:
    """``"mean"`` or ``"sum"`` (how the loss reduces over the batch); ``ValueError`` otherwise."""
    if not isinstance(loss_reduction, str) or loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}; got {loss_reduction!r}")
    return loss_reduction


def check_expected_batch_size(expected_batch_size: Any, *, loss_reduction: str) -> float | None:
    """The divisor of the noisy sum with ``loss_reduction="mean"``: a finite number > 0 (needed);
    with ``"sum"`` it is not used and returned as given."""
    if loss_reduction != "mean":
        return expected_batch_size
    if expected_batch_size is None:
        raise ValueError("expected_batch_size is needed for loss_reduction='mean' (the noisy sum is divided by it)")
    if not _is_real(expected_batch_size):
        raise TypeError(f"expected_batch_size must be a number > 0; got {expected_batch_size!r}")
    if not (math.isfinite(expected_batch_size) and expected_batch_size > 0):
        raise ValueError(f"expected_batch_size must be finite and > 0; got {expected_batch_size!r}")
    return expected_batch_size


def check_privacy_unit(privacy_unit: Any) -> str:
    """``"example"`` (neighbouring datasets differ by one example) or ``"user"`` (by one user, all of its
    examples); ``ValueError`` naming ``privacy_unit`` otherwise."""
    if not isinstance(privacy_unit, str) or privacy_unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy_unit must be one of {PRIVACY_UNITS}; got {privacy_unit!r}")
    return privacy_unit


def check_flag(name: str, value: Any) -> bool:
    """``value`` if it is a bool; ``TypeError`` naming ``name`` otherwise (1 and "yes" are not)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------- targets
def check_target_epsilon(target_epsilon: Any) -> float:
    """The epsilon to calibrate for: finite and > 0."""
    value = real_number("target_epsilon", target_epsilon)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"target_epsilon must be finite and > 0; got {target_epsilon!r}")
    return value


def check_target_delta(target_delta: Any) -> float:
    """The delta of a target or budget, in (0, 1): the accountants' own check (the one the budget
    and the accountants apply), under this argument's name."""
    return check_delta(target_delta, "target_delta")


def check_count(name: str, value: Any, *, low: int = 1, what: str = "") -> int:
    """An int >= ``low`` (``epochs``, ``total_steps``, ``num_bands``, ``max_batch_size``); bools
    refused. ``what`` says what the number counts, in the message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        meaning = f" ({what})" if what else ""
        raise ValueError(f"{name} must be an int >= {low}{meaning}; got {value!r}")
    return int(value)


def check_sample_rate(sample_rate: Any, *, name: str = "sample_rate") -> float:
    """The probability that an example is in a batch (Poisson sampling), as a float in (0, 1].

    ======================  =====================================
    case                    result
    ======================  =====================================
    0 < q <= 1              the float
    q <= 0, q > 1, NaN      ValueError naming ``name``
    not a number            ValueError naming ``name``
    ======================  =====================================
    """
    try:
        rate = float(sample_rate)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be a number in (0, 1], got {sample_rate!r}") from error
    if not (0.0 < rate <= 1.0):
        raise ValueError(
            f"{name} must be in (0, 1] (the probability that an example is in a batch), got {rate}"
        )
    return rate


def check_noise_seed(noise_seed: Any, *, name: str = "noise_seed") -> int | None:
    """None (one draw from torch's global generator, or the OS in secure mode) or an int >= 0
    (numpy integers too; bools refused). ``name``: the argument (``seed`` of a noise mechanism)."""
    if noise_seed is None:
        return None
    if isinstance(noise_seed, bool) or not isinstance(noise_seed, numbers.Integral) or noise_seed < 0:
        raise ValueError(f"{name} must be an int >= 0 or None; got {noise_seed!r}")
    return int(noise_seed)


def check_noise_stream(noise_stream: Any) -> str:
    """One of ``NOISE_STREAMS``: which random stream the noise's standard draws come from (the same
    distribution either way; the seeded numbers differ)."""
    if not isinstance(noise_stream, str) or noise_stream not in NOISE_STREAMS:
        raise ValueError(f"noise_stream must be one of {list(NOISE_STREAMS)}, got {noise_stream!r}")
    return noise_stream


def check_no_seed_for_given_noise(noise_seed: Any, noise_generator: Any = None) -> None:
    """A ready noise mechanism (``noise_mechanism=`` / ``noise=``) is seeded by whoever built it:
    ``noise_seed`` and ``noise_generator`` seed the default noise only. ``ValueError`` if either is set."""
    if noise_seed is not None or noise_generator is not None:
        raise ValueError(
            "noise_seed/noise_generator seed the default noise only: seed the noise mechanism you pass yourself "
            "(its seed=)"
        )


def check_unseeded_in_secure_mode(name: str, seed: Any, *, secure_mode: bool) -> None:
    """In secure mode the noise is seeded from the OS only: ``ValueError`` naming ``name`` (the
    ``noise_seed`` / ``noise_generator`` argument) unless it is None."""
    if secure_mode and seed is not None:
        raise ValueError(f"{name} must be None with secure_mode=True (secure noise is seeded from the OS only)")


def check_noise_generator(noise_generator: Any) -> Any:
    """None or a ``torch.Generator`` (it seeds the noise and drives the sampling)."""
    if noise_generator is None:
        return None
    if not isinstance(noise_generator, torch.Generator):
        raise TypeError(f"noise_generator must be a torch.Generator; got {type(noise_generator).__name__}")
    return noise_generator


# ------------------------------------------------------------------------------- adaptive clipping
def check_target_unclipped_quantile(target_unclipped_quantile: Any) -> float:
    """The quantile gamma of the per-example norms the clip norm tracks: a number in [0, 1]."""
    value = real_number("target_unclipped_quantile", target_unclipped_quantile)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"target_unclipped_quantile must be in [0, 1]; got {target_unclipped_quantile!r}")
    return value


def check_clipbound_learning_rate(clipbound_learning_rate: Any) -> float:
    """eta of the geometric update ``C <- C exp(-eta (b - gamma))``: finite and >= 0 (0 keeps C fixed)."""
    value = real_number("clipbound_learning_rate", clipbound_learning_rate)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"clipbound_learning_rate must be finite and >= 0; got {clipbound_learning_rate!r}")
    return value


def check_clipbounds(min_clipbound: Any, max_clipbound: Any) -> tuple[float, float]:
    """The range the clip norm is clamped to: ``0 <= min_clipbound < max_clipbound < inf`` (a finite
    maximum keeps the noise std finite; Opacus refuses ``max <= min`` too)."""
    low = real_number("min_clipbound", min_clipbound)
    high = real_number("max_clipbound", max_clipbound)
    if not (math.isfinite(low) and low >= 0):
        raise ValueError(f"min_clipbound must be finite and >= 0; got {min_clipbound!r}")
    if not (math.isfinite(high) and high > 0):
        raise ValueError(f"max_clipbound must be finite and > 0; got {max_clipbound!r}")
    if high <= low:
        raise ValueError(f"max_clipbound must be larger than min_clipbound; got {max_clipbound!r} <= {min_clipbound!r}")
    return low, high


def check_unclipped_num_std(unclipped_num_std: Any) -> float:
    """sigma_b, the std of the noise on the count of unclipped examples: finite and >= 0."""
    value = real_number("unclipped_num_std", unclipped_num_std)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"unclipped_num_std must be finite and >= 0; got {unclipped_num_std!r}")
    return value


def check_unclipped_num_std_for(noise_multiplier: float, unclipped_num_std: float, *, num_groups: int = 1) -> None:
    """Adaptive clipping accounts the pair (gradient, count) as one Gaussian step at ``noise_multiplier``
    sigma, which needs ``sigma^-2 - G (2 sigma_b)^-2 > 0`` (G counts, one per clipping group, each of
    sensitivity 1/2): ``ValueError`` naming ``unclipped_num_std`` unless ``2 sigma_b > sqrt(G) sigma``.
    sigma = 0 (no noise, no privacy) needs nothing."""
    if noise_multiplier > 0 and not 2.0 * unclipped_num_std > math.sqrt(num_groups) * noise_multiplier:
        needed = math.sqrt(num_groups) * noise_multiplier / 2.0
        groups = "" if num_groups == 1 else f" * sqrt({num_groups} clipping groups)"
        raise ValueError(
            f"unclipped_num_std must be > noise_multiplier{groups} / 2 = {needed:.6g} for adaptive clipping (the "
            f"count of unclipped examples would cost all of the step's privacy: Andrew et al. 2021, Theorem 1); "
            f"got {unclipped_num_std!r}"
        )
