"""Argument checks shared by the accountants, the event builders and calibration.

Every check runs before any state changes and raises an error that names the argument,
states the allowed range and shows the value received.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


def check_real(
    name: str,
    value: Any,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
) -> float:
    """Return `value` as a finite float in the stated interval, or raise naming `name`."""
    closing = ")" if high_open or math.isinf(high) else "]"
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{closing}"
    suffix = f" {hint}" if hint else ""
    # bool is an int subclass: True as a noise multiplier is a bug, not a number.
    if isinstance(value, bool):
        raise TypeError(
            f"{name} must be a real number in {interval}; got the bool {value!r}.{suffix}"
        )
    # float("1e-5") would succeed, but a string here is a caller's bug (e.g. an unparsed CLI flag).
    if isinstance(value, str | bytes):
        raise TypeError(
            f"{name} must be a real number in {interval}; got the string {value!r}.{suffix}"
        )
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must be a real number in {interval}; got {value!r} "
            f"of type {type(value).__name__}.{suffix}"
        ) from None
    if not math.isfinite(number):
        raise ValueError(
            f"{name} must be a finite number in {interval}; got {value!r}.{suffix}"
        )
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if too_low or too_high:
        raise ValueError(f"{name} must be in {interval}; got {value!r}.{suffix}")
    return number


def check_int(name: str, value: Any, *, low: int, hint: str = "") -> int:
    """Return `value` as a python int >= `low`, or raise naming `name`."""
    suffix = f" {hint}" if hint else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an integer >= {low}; got {value!r} of type "
            f"{type(value).__name__}.{suffix}"
        )
    number = int(value)
    if number < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {number}.{suffix}")
    return number


def check_delta(delta: Any, name: str = "delta") -> float:
    return check_real(
        name,
        delta,
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
        hint="Use a value well below 1/dataset_size, e.g. 1e-5.",
    )


def check_noise_multiplier(noise_multiplier: Any) -> float:
    return check_real(
        "noise_multiplier",
        noise_multiplier,
        low=0.0,
        hint="It is the noise std divided by the L2 sensitivity; 0 means no privacy.",
    )


def check_sample_rate(sample_rate: Any) -> float:
    return check_real(
        "sample_rate",
        sample_rate,
        low=0.0,
        high=1.0,
        hint="It is the Poisson sampling probability (expected batch size / examples sampled from).",
    )


def check_num_bands(num_bands: Any) -> int:
    return check_int(
        "num_bands",
        num_bands,
        low=1,
        hint="Use 1 for DP-SGD, b >= 2 for BandMF with b bands.",
    )


def check_truncation(
    group_size: Any, max_batch_size: Any
) -> tuple[int | None, int | None]:
    """Both None (no truncation) or both integers >= 1."""
    if (group_size is None) != (max_batch_size is None):
        missing = "group_size" if group_size is None else "max_batch_size"
        raise ValueError(
            f"{missing} is None but the other truncation argument is set: truncated Poisson "
            "sampling needs both group_size (examples sampled from) and max_batch_size (the cap); "
            "pass both, or neither for untruncated sampling."
        )
    if group_size is None:
        return None, None
    return (
        check_int(
            "group_size",
            group_size,
            low=1,
            hint="It is the number of examples sampled from.",
        ),
        check_int(
            "max_batch_size",
            max_batch_size,
            low=1,
            hint="It is the cap on the batch size.",
        ),
    )
