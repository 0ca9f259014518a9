"""The keyword settings of ``make_private`` and ``make_private_with_epsilon`` as ``TypedDict``s, for
static type checkers.

At runtime the settings are ``PrivacyOptions``' fields (``engine.options``), checked there, and
``takes_settings`` writes them into the methods' runtime signatures. A checker does not run that
code: it reads ``**settings: Unpack[MakePrivateSettings]`` (PEP 692) instead, so it knows every
keyword, its type and whether it is required, and flags a misspelt one. The lists below repeat
``PrivacyOptions``' fields once per entry point; ``tests/test_public_typing.py`` fails when they and
the dataclass (or ``ENTRY_POINTS``' required and refused settings) disagree.
"""

# No ``from __future__ import annotations`` here: the classes are built from evaluated annotations,
# so that ``__required_keys__`` sees ``NotRequired`` (the test compares it with PrivacyOptions).
from collections.abc import Callable, Sequence
from typing import Any

import torch
from typing_extensions import NotRequired, TypedDict

from privacy_engine.auditing.config import AuditConfig
from privacy_engine.noise import NoiseMechanism

__all__ = [
    "MakePrivateSettings",
    "MakePrivateWithEpsilonSettings",
    "PerformanceSettings",
]


class PerformanceSettings(TypedDict, total=False):
    """The settings that cannot affect privacy (``PerformanceFlags``): how the clipped sum is
    computed, never the bound, the noise, the sampling or what is accounted."""

    grad_sample_mode: str
    grad_scaler: torch.amp.GradScaler | None


class _OptionalSettings(PerformanceSettings, total=False):
    """The settings both entry points take and neither requires (defaults: ``PrivacyOptions``):
    those that decide the privacy guarantee, and the performance settings."""

    max_epsilon: float | None
    poisson_sampling: bool
    clipping: str
    loss_reduction: str
    batch_first: bool
    noise_seed: int | None
    noise_generator: torch.Generator | None
    noise_stream: str
    noise_mechanism: str | NoiseMechanism
    num_bands: int | None
    bandmf_coefficients: Sequence[float] | None
    num_buffers: int | None
    max_noise_memory: int | None
    total_steps: int | None
    max_batch_size: int | None
    nan_safe: bool
    rescale_to_unit_norm: bool
    audit: AuditConfig | None
    target_unclipped_quantile: float | None
    clipbound_learning_rate: float | None
    max_clipbound: float | None
    min_clipbound: float | None
    unclipped_num_std: float | None
    privacy_unit: str
    user_ids: Sequence[Any] | Callable[[int], Any] | None
    examples_per_user: int | None
    shuffle_user_examples: bool


class MakePrivateSettings(_OptionalSettings):
    """``PrivacyEngine.make_private``'s settings: ``noise_multiplier`` and ``max_grad_norm`` required."""

    noise_multiplier: float
    max_grad_norm: float | Sequence[float]
    target_delta: NotRequired[float | None]


class MakePrivateWithEpsilonSettings(_OptionalSettings):
    """``PrivacyEngine.make_private_with_epsilon``'s settings: the target ``(target_epsilon,
    target_delta)`` over ``epochs`` epochs and ``max_grad_norm`` required; no ``noise_multiplier``."""

    target_epsilon: float
    target_delta: float
    epochs: int
    max_grad_norm: float | Sequence[float]

