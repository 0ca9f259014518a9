"""What a setting may cost before anything is allocated: one documented limit per setting whose
memory or time grows with its value, and the checks that refuse a value over it with an error
naming the setting and the estimated cost.

Each limit was chosen from measurements on a 2-core CPU machine (numbers in the comments), so
that a setting within every limit plans in seconds and a few hundred MB at most. They guard
against typos and unbounded inputs (``total_steps=10**9`` was killed by the OOM killer at 24 GB
before any message); a run that really needs more can raise the constant in its own process
(``privacy_engine.engine.limits.MAX_... = ...``), knowing the cost.
"""

from __future__ import annotations

__all__ = [
    "MAX_ACCOUNTED_STEPS",
    "MAX_BANDMF_TOTAL_STEPS",
    "MAX_LEDGER_ENTRIES",
    "MAX_NUM_BANDS",
    "MAX_STRATEGY_WORK",
    "MAX_TARGET_EPSILON",
    "ResourceLimitError",
    "check_accounted_steps",
    "check_bandmf_size",
    "check_target_epsilon",
]

#: BandMF's strategy is optimised over ``total_steps`` steps: O(total_steps) float64 arrays
#: (about 80 bytes per step at the peak) and O(total_steps * num_bands) time per L-BFGS step.
#: Measured: 10**6 steps, 64 bands: 4.7 s and ~100 MB per strategy optimised.
MAX_BANDMF_TOTAL_STEPS = 10**6
#: Bands b: the mechanism keeps b noise tensors the size of the model, and the strategy costs
#: O(total_steps * b). Measured: b=1024 over 10**4 steps 0.7 s; b=1024 over 65536 steps 6.7 s.
MAX_NUM_BANDS = 1024
#: total_steps * num_bands for one strategy optimisation (~7 s at this size, see above).
MAX_STRATEGY_WORK = 64 * 10**6
#: Steps the calibration of ``make_private_with_epsilon`` accounts for (epochs * steps per epoch):
#: PLD composition time grows with them. Measured: 5 * 10**5 steps 1.7 s, 5 * 10**6 steps 54 s.
MAX_ACCOUNTED_STEPS = 10**6
#: Above this epsilon the guarantee says nothing useful, and calibration searches the finest PLD
#: grids near the smallest sigma. Measured: target_epsilon=50 1.5 s, 200 3.5 s, 1000 11 s, 10**6 14 s.
MAX_TARGET_EPSILON = 100.0

#: Entries of a privacy ledger loaded from a checkpoint: each is validated (and PLD-composed).
#: Measured: 10**4 entries 0.23 s, 10**5 entries 2.8 s (2 * 10**6 took 119 s). A run records one
#: entry per change of its settings, so 10**5 covers a per-step noise schedule of 10**5 steps.
MAX_LEDGER_ENTRIES = 10**5

# Peak bytes per step of the strategy optimisation (about ten float64 arrays of total_steps entries).
_STRATEGY_BYTES_PER_STEP = 80


class ResourceLimitError(ValueError):
    """A setting whose cost (memory or time) would exceed its documented limit; raised before
    anything is allocated. The message names the setting, its estimated cost and the limit."""


def _gigabytes(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.3g} GB"


def check_bandmf_size(*, total_steps: int | None, num_bands: int | None, optimised: bool = True,
                      setting: str = "total_steps") -> None:  # fmt: skip
    """ResourceLimitError naming ``setting`` / ``num_bands`` unless BandMF with ``total_steps``
    steps and ``num_bands`` bands fits ``MAX_BANDMF_TOTAL_STEPS`` and ``MAX_NUM_BANDS``, and (when
    the strategy is ``optimised``, not given) ``MAX_STRATEGY_WORK``. None: not known yet."""
    if num_bands is not None and num_bands > MAX_NUM_BANDS:
        raise ResourceLimitError(
            f"num_bands={num_bands} exceeds the limit MAX_NUM_BANDS={MAX_NUM_BANDS}: BandMF keeps num_bands noise "
            f"tensors the size of the model and optimises its strategy in O(total_steps * num_bands) time"
        )
    if total_steps is None:
        return
    if total_steps > MAX_BANDMF_TOTAL_STEPS:
        raise ResourceLimitError(
            f"{setting}={total_steps} steps exceeds the limit MAX_BANDMF_TOTAL_STEPS={MAX_BANDMF_TOTAL_STEPS} for "
            f"noise_mechanism='bandmf': optimising its strategy would need about "
            f"{_gigabytes(total_steps * _STRATEGY_BYTES_PER_STEP)} of memory and time proportional to the steps: "
            "use fewer steps"
        )
    if optimised and num_bands is not None and total_steps * num_bands > MAX_STRATEGY_WORK:
        raise ResourceLimitError(
            f"{setting}={total_steps} with num_bands={num_bands} is {total_steps * num_bands} step-bands, over the "
            f"limit MAX_STRATEGY_WORK={MAX_STRATEGY_WORK} (about 7 s per strategy there, growing linearly): use fewer "
            "steps or bands, or give bandmf_coefficients"
        )


def check_accounted_steps(steps: int, *, epochs: int) -> None:
    """ResourceLimitError naming ``epochs`` unless the ``steps`` a calibration accounts for are at
    most ``MAX_ACCOUNTED_STEPS``."""
    if steps > MAX_ACCOUNTED_STEPS:
        raise ResourceLimitError(
            f"epochs={epochs} means calibrating the noise over {steps} accounted steps, over the limit "
            f"MAX_ACCOUNTED_STEPS={MAX_ACCOUNTED_STEPS} (5 * 10**6 steps took 54 s to calibrate, and the time grows "
            "with the steps): use fewer epochs"
        )


def check_target_epsilon(target_epsilon: float) -> None:
    """ResourceLimitError naming ``target_epsilon`` above ``MAX_TARGET_EPSILON``."""
    if target_epsilon > MAX_TARGET_EPSILON:
        raise ResourceLimitError(
            f"target_epsilon={target_epsilon!r} exceeds the limit MAX_TARGET_EPSILON={MAX_TARGET_EPSILON}: such a "
            "target protects nothing in practice, and calibrating for it searches the finest privacy-loss grids "
            "(target_epsilon=1000 took 11 s). Use make_private with a noise_multiplier if you mean it"
        )
