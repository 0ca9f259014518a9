"""``AuditReport``: a run's one-run audit beside the accountant's epsilon, and the warning when they meet."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

from privacy_engine.auditing.canaries import GradientCanaries
from privacy_engine.auditing.checks import check_confidence, check_delta
from privacy_engine.auditing.input_canaries import InputCanaries

__all__ = ["AuditBoundWarning", "AuditReport", "audit_report"]


class AuditBoundWarning(UserWarning):
    """The audit's epsilon lower bound came within ``warn_factor`` of the accountant's epsilon (or above
    it). One-run auditing with gradient canaries is far from tight, so this almost surely means a bug: in
    the code (noise too small, a canary counted twice) or in the accounting."""


@dataclass(frozen=True, kw_only=True)
class AuditReport:
    """One-run audit of a training run (``engine.audit_report()``); ``str(report)`` is a table.

    ``epsilon_lower_bound``: the one-run epsilon-DP bound (Steinke, Nasr, Jagielski 2023) at ``delta`` and
    ``confidence``: valid for every mechanism. ``gdp_mu_lower_bound`` / ``gdp_epsilon_lower_bound``: the
    f-DP test against mu-GDP (Mahloujifar, Melis, Chaudhuri 2024) and its epsilon at ``delta``: a lower bound
    on epsilon only for a Gaussian privacy curve (one full-batch step); with subsampling or BandMF read it as
    "the run is not mu-GDP", so it is shown, not compared. ``claimed_epsilon``: the accountant's at ``delta``
    (``inf`` without noise). ``close_to_claim``: ``epsilon_lower_bound >= warn_factor * claimed_epsilon``."""

    num_canaries: int
    num_included: int
    steps: int
    confidence: float
    delta: float
    epsilon_lower_bound: float
    gdp_mu_lower_bound: float
    gdp_epsilon_lower_bound: float
    claimed_epsilon: float
    warn_factor: float
    kind: str = "gradient"

    @property
    def close_to_claim(self) -> bool:
        """Whether the epsilon-DP lower bound is at least ``warn_factor`` times the claimed epsilon (a bug)."""
        return self.epsilon_lower_bound > 0 and self.epsilon_lower_bound >= self.warn_factor * self.claimed_epsilon

    def rows(self) -> list[tuple[str, str]]:
        """The table's rows: (quantity, value)."""
        return [
            ("canaries (included / total)", f"{self.num_included} / {self.num_canaries} ({self.kind})"),
            ("released steps", str(self.steps)),
            ("delta", f"{self.delta:.3g}"),
            ("accountant's epsilon (upper bound)", f"{self.claimed_epsilon:.4g}"),
            (f"one-run epsilon lower bound ({self.confidence:.0%})", f"{self.epsilon_lower_bound:.4g}"),
            (f"one-run GDP mu lower bound ({self.confidence:.0%})", f"{self.gdp_mu_lower_bound:.4g}"),
            ("  its epsilon at delta (Gaussian curves only)", f"{self.gdp_epsilon_lower_bound:.4g}"),
            ("lower bound / claimed epsilon", _ratio(self.epsilon_lower_bound, self.claimed_epsilon)),
        ]

    def __str__(self) -> str:
        rows = self.rows()
        width = max(len(name) for name, _ in rows)
        lines = ["privacy audit (one run)", "-" * (width + 14)]
        lines += [f"{name:<{width}}  {value}" for name, value in rows]
        if self.close_to_claim:
            lines.append(f"WARNING: the lower bound is >= {self.warn_factor:g} x the claimed epsilon: likely a bug")
        return "\n".join(lines)

    def plot(self, path: Any) -> bool:
        """Write a bar chart (claimed epsilon, lower bounds) to ``path`` with matplotlib; returns False and
        writes nothing when matplotlib is not installed."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return False
        figure, axes = plt.subplots(figsize=(5, 3))
        names = ["accountant (upper)", "one-run (lower)", "GDP one-run (lower)"]
        values = [self.claimed_epsilon, self.epsilon_lower_bound, self.gdp_epsilon_lower_bound]
        finite = [v if math.isfinite(v) else 0.0 for v in values]
        axes.bar(names, finite, color=["tab:blue", "tab:orange", "tab:gray"])
        axes.set_ylabel(f"epsilon at delta={self.delta:.1g}")
        axes.set_title(f"{self.num_canaries} canaries, {self.steps} steps, {self.confidence:.0%} confidence")
        figure.tight_layout()
        figure.savefig(path)
        plt.close(figure)
        return True


def _ratio(lower: float, claimed: float) -> str:
    if not math.isfinite(claimed) or claimed <= 0:
        return "-"
    return f"{lower / claimed:.3f}"


def audit_report(canaries: GradientCanaries | InputCanaries, *, claimed_epsilon: float, delta: float, confidence: float = 0.95,
                 warn_factor: float = 0.8) -> AuditReport:  # fmt: skip
    """The ``AuditReport`` of ``canaries``' scores (input canaries: as last computed, ``compute_scores``); warns
    ``AuditBoundWarning`` when ``close_to_claim``.

    Guarantee: if the run is (claimed_epsilon, delta)-DP towards each canary, ``epsilon_lower_bound`` exceeds
    ``claimed_epsilon`` with probability at most ``1 - confidence`` over the canaries' inclusion.

    ==================================  ================================================
    case                                result
    ==================================  ================================================
    no canary included, or all          ValueError (use more canaries)
    no step released                    every bound 0.0
    confidence / delta out of range     ValueError naming it
    lower bound >= factor * claimed     the report, and AuditBoundWarning
    ==================================  ================================================
    """
    confidence = check_confidence(confidence)
    delta = check_delta(delta, positive=True)
    auditor = canaries.auditor()
    mu = auditor.gdp_mu_one_run(confidence)
    report = AuditReport(
        num_canaries=canaries.num_canaries, num_included=int(canaries.included.sum()), steps=canaries.steps_scored,
        confidence=confidence, delta=delta, epsilon_lower_bound=auditor.epsilon_one_run(confidence, delta),
        gdp_mu_lower_bound=mu, gdp_epsilon_lower_bound=auditor.epsilon_one_run_gdp(confidence, delta),
        claimed_epsilon=float(claimed_epsilon), warn_factor=float(warn_factor),
        kind="input" if isinstance(canaries, InputCanaries) else "gradient",
    )  # fmt: skip
    if report.close_to_claim:
        warnings.warn(
            f"the one-run audit's epsilon lower bound {report.epsilon_lower_bound:.4g} is within a factor "
            f"{report.warn_factor:g} of the accountant's epsilon {report.claimed_epsilon:.4g} (delta={delta:g}): a "
            f"correct run stays far below it; check the noise, the clipping and the accounting",
            AuditBoundWarning,
            stacklevel=3,
        )
    return report
