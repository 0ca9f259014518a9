"""Privacy auditing: empirical lower bounds on epsilon from canaries, to set next to the accountant's.

A privacy audit inserts canaries, scores them after training and turns the scores into a lower bound
that holds with a stated confidence. The accountant's epsilon is an upper bound; a lower bound above it
means a bug (in the code or in the analysis). One file per concept:

* ``checks.py``: argument checks (score arrays, confidence, delta);
* ``clopper_pearson.py``: exact one-sided binomial confidence bounds;
* ``roc.py``: ``RocPoints``, the attack's true/false positives per threshold (convex hull);
* ``thresholds.py``: how the threshold is chosen: ``Explicit``, ``Bonferroni``, ``Split``;
* ``clopper_pearson_epsilon.py``: epsilon from Clopper-Pearson bounds on TPR and FPR;
* ``one_run.py``: one-run auditing (Steinke, Nasr, Jagielski 2023) and its f-DP / GDP variant
  (Mahloujifar, Melis, Chaudhuri 2024);
* ``gdp.py``: mu-GDP to (epsilon, delta) and back;
* ``attack_metrics.py``: TPR at a fixed FPR, AUROC;
* ``auditor.py``: ``CanaryScoreAuditor``, all of the above over held-in / held-out scores;
* ``canaries.py``: ``GradientCanaries``, gradient canaries for one-run auditing of a ``DPOptimizer``
  (the engine's ``canaries`` component, added to the clipped sums before the noise);
* ``input_canaries.py``: ``InputCanaries``, canary examples appended to the dataset the private loader samples
  (``CanaryDataset``), scored by the trained model's loss on them;
* ``config.py``: ``AuditConfig``, what ``make_private(audit=...)`` inserts;
* ``report.py``: ``AuditReport`` (``engine.audit_report()``) and ``AuditBoundWarning``.

Layer: above ``training/`` (the canaries implement ``training.canary_slot.ClippedSumCanaries``, which the
optimizer calls) and below ``engine/`` (which builds them from ``AuditConfig`` and reports).
"""

from privacy_engine.auditing.auditor import CanaryScoreAuditor
from privacy_engine.auditing.canaries import GradientCanaries
from privacy_engine.auditing.clopper_pearson import clopper_pearson_lower, clopper_pearson_upper
from privacy_engine.auditing.config import AuditConfig
from privacy_engine.auditing.gdp import gdp_delta, gdp_epsilon, gdp_mu
from privacy_engine.auditing.input_canaries import CanaryDataset, InputCanaries
from privacy_engine.auditing.one_run import one_run_epsilon, one_run_gdp_mu, one_run_p_value
from privacy_engine.auditing.report import AuditBoundWarning, AuditReport, audit_report
from privacy_engine.auditing.roc import RocPoints
from privacy_engine.auditing.thresholds import Bonferroni, Explicit, Split, ThresholdStrategy

__all__ = [
    "AuditBoundWarning",
    "AuditConfig",
    "AuditReport",
    "Bonferroni",
    "CanaryDataset",
    "CanaryScoreAuditor",
    "Explicit",
    "GradientCanaries",
    "InputCanaries",
    "RocPoints",
    "Split",
    "ThresholdStrategy",
    "audit_report",
    "clopper_pearson_lower",
    "clopper_pearson_upper",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "one_run_epsilon",
    "one_run_gdp_mu",
    "one_run_p_value",
]
