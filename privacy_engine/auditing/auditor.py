"""CanaryScoreAuditor: privacy lower bounds and attack metrics from held-in / held-out canary scores."""

from __future__ import annotations

import functools

import numpy as np
from numpy.typing import ArrayLike

from privacy_engine.auditing import attack_metrics
from privacy_engine.auditing.checks import as_scores, check_confidence, check_delta
from privacy_engine.auditing.clopper_pearson_epsilon import clopper_pearson_epsilon_at
from privacy_engine.auditing.gdp import gdp_epsilon
from privacy_engine.auditing.one_run import one_run_epsilon_at, one_run_gdp_mu_at
from privacy_engine.auditing.roc import RocPoints
from privacy_engine.auditing.thresholds import Bonferroni, ThresholdStrategy, best_over_thresholds

_EVERY_THRESHOLD = Bonferroni()  # the default strategy (immutable)


class CanaryScoreAuditor:
    """Estimators over the attack scores of held-in canaries (trained on) and held-out ones (not).

    A higher score means "more likely held in"; negate scores that go the other way. The attack
    guesses "held in" for scores at or above a threshold; ``threshold`` (``Explicit``, ``Bonferroni``,
    ``Split``, see ``privacy_engine.auditing.thresholds``) says how the threshold is chosen and how the
    confidence is corrected for choosing it. The same class serves the two auditing set-ups:

    * many runs (or canaries whose inclusion is fixed): ``epsilon_lower_bound`` (Clopper-Pearson);
    * one run, each canary included with probability 1/2 (the held-in ones are those that were):
      ``epsilon_one_run`` and the f-DP variants ``gdp_mu_one_run`` / ``epsilon_one_run_gdp``.

    Edge cases of the constructor:

    ========================  ==========================================
    case                      result
    ========================  ==========================================
    empty in or out scores    ValueError naming ``in_scores`` /
                              ``out_scores``
    not 1-D, NaN or inf       ValueError naming the argument
    ties, all scores equal    allowed: tied scores fall on the same side
                              of every threshold
    ========================  ==========================================

    Example::

        auditor = CanaryScoreAuditor(in_scores, out_scores)
        auditor.epsilon_lower_bound(confidence=0.95, delta=1e-5)
        auditor.epsilon_one_run(confidence=0.95, delta=1e-5)
    """

    def __init__(self, in_scores: ArrayLike, out_scores: ArrayLike) -> None:
        self.in_scores = as_scores(in_scores, "in_scores")
        self.out_scores = as_scores(out_scores, "out_scores")

    @functools.cached_property
    def roc(self) -> RocPoints:
        """The vertices of the ROC's upper convex hull (``RocPoints.hull``)."""
        return RocPoints.hull(self.in_scores, self.out_scores)

    def epsilon_lower_bound(
        self, confidence: float = 0.95, delta: float = 0.0, *, threshold: ThresholdStrategy = _EVERY_THRESHOLD,
        one_sided: bool = True,
    ) -> float:  # fmt: skip
        """Epsilon lower bound from Clopper-Pearson intervals on the attack's TPR and FPR (Jagielski, Ullman,
        Oprea 2020; JAX Privacy's ``epsilon_clopper_pearson``):
        ``max(0, log(TPR_low - delta) - log(FPR_high))``, each bound at confidence ``1 - (1 - c) / 2``.

        Guarantee: if every held-in score comes from a run that is (epsilon, delta)-DP with respect to its
        canary, every score is independent of the others (one canary per run, or canaries that do not
        interact) and the scores are i.i.d. per group, then the result exceeds epsilon with probability at most
        ``1 - confidence`` (with the threshold strategy's correction; see ``thresholds``).
        ``one_sided=False`` also bounds with the two datasets swapped (``log(TNR_low - delta) - log(FNR_high)``,
        same thresholds); scores that go the wrong way must be negated, as the hull keeps only the
        upper-left part of the ROC.

        =====================================  ===========================================
        case                                   result
        =====================================  ===========================================
        all scores equal, or one distribution  0.0 (nothing distinguishable)
        perfectly separated scores             the largest bound the sample sizes allow:
                                               ``log((a^(1/n_in) - delta) / (1 - a^(1/n_out)))``,
                                               ``a = (1 - c) / (2 k)``, ``k`` hull vertices
        TPR_low <= delta at every threshold    0.0
        confidence not in (0, 1)               ValueError naming ``confidence``
        delta not in [0, 1)                    ValueError naming ``delta``
        =====================================  ===========================================
        """
        significance = 1 - check_confidence(confidence)
        delta = check_delta(delta)
        best_at = functools.partial(clopper_pearson_epsilon_at, delta=delta, one_sided=one_sided)
        return best_over_thresholds(threshold, self.in_scores, self.out_scores, significance, best_at)

    def epsilon_one_run(
        self, confidence: float = 0.95, delta: float = 0.0, *, threshold: ThresholdStrategy = _EVERY_THRESHOLD
    ) -> float:
        """Epsilon lower bound of one-run auditing (Steinke, Nasr, Jagielski 2023; ``one_run_epsilon``): the
        canaries scoring at or above the threshold are guessed included; ``m`` = all canaries.

        Guarantee: if each canary was included independently with probability 1/2, the run is
        (epsilon, delta)-DP with respect to each canary and the scores were computed without knowing which
        were included, the result exceeds epsilon with probability at most ``1 - confidence`` (with the
        threshold strategy's correction). Guesses of "excluded" (``k_-`` in the paper) are not made.

        ============================  ========================================
        case                          result
        ============================  ========================================
        all scores equal              0.0
        precision <= 1/2 everywhere   0.0 (nothing distinguishable)
        perfectly separated           the largest bound m canaries allow
        confidence not in (0, 1)      ValueError naming ``confidence``
        delta not in [0, 1)           ValueError naming ``delta``
        ============================  ========================================
        """
        significance = 1 - check_confidence(confidence)
        delta = check_delta(delta)
        best_at = functools.partial(one_run_epsilon_at, delta=delta)
        return best_over_thresholds(threshold, self.in_scores, self.out_scores, significance, best_at)

    def gdp_mu_one_run(self, confidence: float = 0.95, *, threshold: ThresholdStrategy = _EVERY_THRESHOLD) -> float:
        """mu lower bound of one-run f-DP auditing against mu-GDP (Mahloujifar, Melis, Chaudhuri 2024;
        ``one_run_gdp_mu``), under the assumptions of ``epsilon_one_run``: exceeds the run's true mu with
        probability at most ``1 - confidence``.

        ==========================  ========================================
        case                        result
        ==========================  ========================================
        nothing distinguishable     0.0
        confidence not in (0, 1)    ValueError naming ``confidence``
        ==========================  ========================================
        """
        significance = 1 - check_confidence(confidence)
        return best_over_thresholds(threshold, self.in_scores, self.out_scores, significance, one_run_gdp_mu_at)

    def epsilon_one_run_gdp(
        self, confidence: float = 0.95, delta: float = 1e-5, *, threshold: ThresholdStrategy = _EVERY_THRESHOLD
    ) -> float:
        """``gdp_epsilon(gdp_mu_one_run(confidence), delta)``: the epsilon at ``delta`` of the mu-GDP
        hypotheses the f-DP test rejects (JAX Privacy's ``epsilon_one_run_fdp``). A lower bound on epsilon
        for a run whose privacy curve is Gaussian (DP-SGD without subsampling); for other curves read it as
        "the run is not mu-GDP" rather than as an (epsilon, delta) statement.

        ==========================  ========================================
        case                        result
        ==========================  ========================================
        nothing distinguishable     0.0
        delta not in (0, 1)         ValueError naming ``delta``
        ==========================  ========================================
        """
        delta = check_delta(delta, positive=True)
        return gdp_epsilon(self.gdp_mu_one_run(confidence, threshold=threshold), delta)

    def tpr_at_fpr(self, fpr: float | ArrayLike) -> float | np.ndarray:
        """The largest TPR a threshold attack (randomising between two thresholds) reaches at ``fpr``
        (scalar or array). Not a privacy bound: an estimate, with no confidence.

        ===================  ===============================================
        case                 result
        ===================  ===============================================
        fpr = 0              the TPR at the threshold above every out score
        fpr = 1              1.0
        all scores equal     ``fpr`` (the chance diagonal)
        fpr not in [0, 1]    ValueError naming ``fpr``
        ===================  ===============================================
        """
        return attack_metrics.tpr_at_fpr(self.roc, fpr)

    def auroc(self, *, convex_hull: bool = True) -> float:
        """Area under the ROC: of its convex hull (randomised thresholds, JAX Privacy's ``attack_auroc``) or,
        with ``convex_hull=False``, of the plain ROC (``P[in > out] + P[in = out] / 2``, Mann-Whitney). An
        estimate, with no confidence.

        ========================  ======================================
        case                      result
        ========================  ======================================
        perfectly separated       1.0
        all scores equal          0.5
        in scores all below out   hull: 0.5 (the diagonal is reachable);
                                  plain: 0.0
        ========================  ======================================
        """
        if convex_hull:
            return attack_metrics.auroc_of_hull(self.roc)
        return attack_metrics.auroc_of_scores(self.in_scores, self.out_scores)
