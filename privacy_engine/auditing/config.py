"""``AuditConfig``: what ``make_private(audit=...)`` inserts into a run and how it reports."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from privacy_engine.auditing.checks import check_confidence, check_delta

__all__ = ["AuditConfig"]


@dataclass(frozen=True, kw_only=True)
class AuditConfig:
    """One-run auditing (Steinke, Nasr, Jagielski 2023) of a ``make_private`` run with gradient or input canaries.

    Each of ``num_canaries`` canaries is included in the run with probability 1/2 and, when included, takes
    part in every release as an example would; ``engine.audit_report()`` turns their scores into an epsilon
    lower bound beside the accountant's epsilon.

    * ``kind="gradient"`` (``GradientCanaries``): a direction in parameter space, added as one more clipped
      gradient to the clipped sum before the noise; scored against the released gradients.
    * ``kind="input"`` (``InputCanaries``): a canary example appended to the dataset the private loader samples
      (so it is sampled, clipped and noised exactly as a real example); scored as ``-loss`` of the trained model
      on it (``score_fn(model, example)`` when given). Examples: ``canary_fn(index) -> example`` when given,
      else ``(input, label)`` with an ``N(0, 1)`` input shaped and typed as the dataset's first input and a
      label uniform over ``num_classes``, both drawn from ``seed``. Including them changes the dataset: it has
      ``n + k`` examples (``k`` included, about ``num_canaries / 2``), and the sample rate the loader runs and the
      accountant records is ``batch_size / (n + k)``.

    Guarantee: gradient canaries change nothing of the privacy of the real examples: they are added to the
    clipped sum before the noise, do not depend on the data, and are counted in no accounting (a
    data-independent vector added before data-independent noise changes no neighbouring distribution). They
    do change the model's update (each included canary is one more clipped gradient of norm
    ``max_grad_norm``). Input canaries are examples: the accounting covers them as it covers every example
    (at the rate of the enlarged dataset), and they take their share of each batch.

    ==================================  ================================================
    field                               allowed (ValueError naming it otherwise)
    ==================================  ================================================
    num_canaries                        int >= 2 (one-run auditing needs several;
                                        hundreds to thousands for a useful bound)
    kind                                "gradient" or "input"
    directions                          "random" (unit vectors) or "dirac" (axes);
                                        gradient canaries only
    num_classes                         input canaries without canary_fn: int >= 2
                                        (labels uniform over it); else None
    canary_fn                           None or a callable index -> example (input
                                        canaries only; must not read the data)
    score_fn                            None or a callable (model, example) -> float,
                                        higher = more likely included (input only)
    confidence                          in (0, 1), default 0.95
    delta                               None (target_delta, else 1e-5) or in (0, 1)
    warn_factor                         in (0, 1]: warn when a bound >= factor * epsilon
    seed                                None (torch's global generator; the OS in
                                        secure mode) or an int >= 0 (not in secure mode)
    ==================================  ================================================
    """

    num_canaries: int
    kind: str = "gradient"
    directions: str = "random"
    confidence: float = 0.95
    delta: float | None = None
    warn_factor: float = 0.8
    seed: int | None = None
    num_classes: int | None = None
    canary_fn: Callable[[int], Any] | None = None
    score_fn: Callable[[Any, Any], float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_canaries, bool) or not isinstance(self.num_canaries, int) or self.num_canaries < 2:
            raise ValueError(f"num_canaries must be an int >= 2, got {self.num_canaries!r}")
        if self.kind not in ("gradient", "input"):
            raise ValueError(f'kind must be "gradient" or "input", got {self.kind!r}')
        self._check_input_fields()
        if self.directions not in ("random", "dirac"):
            raise ValueError(f'directions must be "random" or "dirac", got {self.directions!r}')
        check_confidence(self.confidence)
        if self.delta is not None:
            check_delta(self.delta, positive=True)
        factor = float(self.warn_factor)
        if not (0.0 < factor <= 1.0 and math.isfinite(factor)):
            raise ValueError(f"warn_factor must be in (0, 1], got {self.warn_factor!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be None or an int >= 0, got {self.seed!r}")

    def _check_input_fields(self) -> None:
        """num_classes, canary_fn and score_fn: input canaries only; num_classes or canary_fn needed for them."""
        if self.kind == "gradient":
            for name in ("num_classes", "canary_fn", "score_fn"):
                if getattr(self, name) is not None:
                    raise ValueError(f'{name} is for input canaries (kind="input"); gradient canaries take none')
            return
        for name in ("canary_fn", "score_fn"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ValueError(f"{name} must be callable or None, got {getattr(self, name)!r}")
        if self.num_classes is not None and (
            isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 2
        ):
            raise ValueError(f"num_classes must be None or an int >= 2, got {self.num_classes!r}")
        if self.num_classes is None and self.canary_fn is None:
            raise ValueError(
                'kind="input" needs num_classes (canary labels uniform over it, inputs drawn like the dataset\'s) '
                "or canary_fn (index -> example)"
            )

    def canary_seed(self, *, secure_mode: bool) -> int | None:
        """The seed the canaries are drawn from: ``seed``, or one draw from torch's global generator when it
        is None (so ``torch.manual_seed`` repeats an audited run); None in secure mode, where the canaries
        come from the OS and a given ``seed`` is refused (``ValueError``)."""
        if secure_mode:
            if self.seed is not None:
                raise ValueError("AuditConfig.seed with secure_mode: the canaries come from the OS; leave seed=None")
            return None
        return self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
