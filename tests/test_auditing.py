"""privacy_engine.auditing: the estimators against JAX Privacy and on their own terms, and one-run canaries.

References: JAX Privacy's ``CanaryScoreAuditor`` on fixed score sets (live when ``jax_privacy`` imports,
else the numbers ``tests/auditing_jax_reference.py`` recorded in ``tests/auditing_jax_reference.json``);
scipy's beta / binomial / Mann-Whitney; dp-accounting's Gaussian mechanism; and scores with a known
privacy level (two Gaussians N(0, 1) vs N(mu, 1) are exactly mu-GDP).
"""

from __future__ import annotations

import itertools
import json
import math
import pathlib
from types import SimpleNamespace

import dp_accounting
import numpy as np
import pytest
import torch
from scipy.special import expit
from scipy.stats import beta, binom, mannwhitneyu
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import PrivacyEngine
from privacy_engine.auditing import (
    Bonferroni,
    CanaryScoreAuditor,
    Explicit,
    GradientCanaries,
    RocPoints,
    Split,
    clopper_pearson_lower,
    clopper_pearson_upper,
    gdp_delta,
    gdp_epsilon,
    gdp_mu,
    one_run_epsilon,
    one_run_gdp_mu,
    one_run_p_value,
)
from privacy_engine.auditing.clopper_pearson_epsilon import clopper_pearson_epsilon_at

REFERENCE = json.loads(pathlib.Path(__file__).with_name("auditing_jax_reference.json").read_text())
CONFIDENCE = 1 - REFERENCE["significance"]
DELTA = REFERENCE["delta"]


def our_values(in_scores, out_scores, explicit_threshold: float) -> dict[str, object]:
    """The estimators of this package under the names the reference file uses."""
    auditor = CanaryScoreAuditor(in_scores, out_scores)
    return {
        "cp_bonferroni_delta0": auditor.epsilon_lower_bound(CONFIDENCE, 0.0),
        "cp_bonferroni": auditor.epsilon_lower_bound(CONFIDENCE, DELTA),
        "cp_bonferroni_two_sided": auditor.epsilon_lower_bound(CONFIDENCE, DELTA, one_sided=False),
        "cp_explicit": auditor.epsilon_lower_bound(CONFIDENCE, DELTA, threshold=Explicit(explicit_threshold)),
        "cp_split_seed0": auditor.epsilon_lower_bound(CONFIDENCE, DELTA, threshold=Split(seed=0)),
        "tpr_at_fpr": list(auditor.tpr_at_fpr(np.array(REFERENCE["fprs"]))),
        "auroc": auditor.auroc(),
        "one_run_bonferroni": auditor.epsilon_one_run(CONFIDENCE, DELTA),
        "one_run_explicit": auditor.epsilon_one_run(CONFIDENCE, DELTA, threshold=Explicit(explicit_threshold)),
        "one_run_split_seed0": auditor.epsilon_one_run(CONFIDENCE, DELTA, threshold=Split(seed=0)),
        "one_run_fdp_bonferroni": auditor.epsilon_one_run_gdp(CONFIDENCE, DELTA),
    }


def assert_matches(ours: dict, theirs: dict) -> None:
    for name, value in ours.items():
        # JAX Privacy solves the one-run bounds to xtol 1e-6 (brentq); the rest is closed form.
        tolerance = 1e-5 if name.startswith("one_run") else 1e-10
        np.testing.assert_allclose(value, theirs[name], atol=tolerance, rtol=0, err_msg=name)


# ---------------------------------------------------------------------------------------- JAX Privacy
@pytest.mark.parametrize("name", sorted(REFERENCE["sets"]))
def test_estimators_equal_jax_privacys_recorded_values(name):
    record = REFERENCE["sets"][name]
    assert_matches(our_values(record["in"], record["out"], record["values"]["explicit_threshold"]), record["values"])


def test_estimators_equal_jax_privacy_live():
    auditing = pytest.importorskip("jax_privacy.auditing")
    rng = np.random.default_rng(7)
    in_scores, out_scores = rng.normal(1.5, 1.0, 300), np.round(rng.normal(0.0, 1.0, 250), 1)  # ties too
    theirs = auditing.CanaryScoreAuditor(in_scores, out_scores)
    ours = CanaryScoreAuditor(in_scores, out_scores)
    alpha = 1 - CONFIDENCE
    assert ours.epsilon_lower_bound(CONFIDENCE, DELTA) == pytest.approx(theirs.epsilon_clopper_pearson(alpha, DELTA))
    assert ours.epsilon_one_run(CONFIDENCE, DELTA) == pytest.approx(theirs.epsilon_one_run(alpha, DELTA), abs=1e-5)
    assert ours.epsilon_one_run_gdp(CONFIDENCE, DELTA) == pytest.approx(
        theirs.epsilon_one_run_fdp(alpha, DELTA), abs=1e-5
    )
    assert ours.auroc() == pytest.approx(theirs.attack_auroc())


# ---------------------------------------------------------------------------------------- Clopper-Pearson
def test_clopper_pearson_bounds_are_the_beta_quantiles():
    rng = np.random.default_rng(0)
    for _ in range(20):
        trials = int(rng.integers(1, 500))
        successes = rng.integers(0, trials, size=5)  # < trials: the quantile is defined
        confidence = float(rng.uniform(0.5, 0.999))
        np.testing.assert_allclose(
            clopper_pearson_upper(successes, trials, confidence),
            beta.ppf(confidence, successes + 1, trials - successes),
        )
        positive = successes + 1
        np.testing.assert_allclose(
            clopper_pearson_lower(positive, trials, confidence),
            beta.ppf(1 - confidence, positive, trials - positive + 1),
        )
        # The defining property: at the upper bound, k or fewer successes have probability 1 - confidence.
        upper = clopper_pearson_upper(successes, trials, confidence)
        np.testing.assert_allclose(binom.cdf(successes, trials, upper), 1 - confidence, rtol=1e-6)


def test_clopper_pearson_edge_cases():
    assert clopper_pearson_upper(10, 10, 0.95) == 1.0
    assert clopper_pearson_upper(0, 10, 0.95) == pytest.approx(1 - 0.05 ** (1 / 10))
    assert clopper_pearson_lower(0, 10, 0.95) == 0.0
    assert clopper_pearson_upper(0, 0, 0.95) == 1.0
    for confidence in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="confidence"):
            clopper_pearson_upper(1, 10, confidence)
    with pytest.raises(ValueError, match="successes"):
        clopper_pearson_upper(11, 10, 0.95)


# ---------------------------------------------------------------------------------------- epsilon (Clopper-Pearson)
def test_perfectly_separated_scores_give_the_largest_bound_the_sample_sizes_allow():
    num_in, num_out, delta = 60, 90, 1e-5
    auditor = CanaryScoreAuditor(np.arange(num_in) + 1000.0, np.arange(num_out))
    assert len(auditor.roc) == 3  # +inf, the lowest in score, the lowest out score
    a = (1 - CONFIDENCE) / (2 * 3)
    largest = math.log(a ** (1 / num_in) - delta) - math.log(1 - a ** (1 / num_out))
    assert auditor.epsilon_lower_bound(CONFIDENCE, delta) == pytest.approx(largest, rel=1e-12)


def test_all_equal_scores_distinguish_nothing():
    auditor = CanaryScoreAuditor(np.full(50, 3.0), np.full(70, 3.0))
    assert auditor.epsilon_lower_bound(CONFIDENCE, 0.0, one_sided=False) == 0.0
    assert auditor.epsilon_one_run(CONFIDENCE, DELTA) == 0.0
    assert auditor.gdp_mu_one_run(CONFIDENCE) == 0.0
    assert auditor.auroc() == 0.5 and auditor.auroc(convex_hull=False) == 0.5
    np.testing.assert_allclose(auditor.tpr_at_fpr([0.0, 0.3, 1.0]), [0.0, 0.3, 1.0])


def test_identical_distributions_give_about_zero():
    bounds = []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        auditor = CanaryScoreAuditor(rng.normal(size=1000), rng.normal(size=1000))
        bounds.append(auditor.epsilon_lower_bound(CONFIDENCE, DELTA, one_sided=False))
    assert max(bounds) < 0.1
    assert sum(b == 0 for b in bounds) >= 9


def test_gaussian_scores_never_certify_more_than_their_true_epsilon_beyond_the_confidence():
    # N(0, 1) vs N(mu, 1) is exactly mu-GDP: its epsilon at delta is gdp_epsilon(mu, delta).
    mu, delta, repetitions = 2.0, 1e-3, 200
    true_epsilon = gdp_epsilon(mu, delta)
    exceed = {"bonferroni": 0, "explicit": 0}
    for seed in range(repetitions):
        rng = np.random.default_rng(seed)
        auditor = CanaryScoreAuditor(rng.normal(mu, 1.0, 200), rng.normal(0.0, 1.0, 200))
        exceed["bonferroni"] += auditor.epsilon_lower_bound(CONFIDENCE, delta) > true_epsilon
        exceed["explicit"] += auditor.epsilon_lower_bound(CONFIDENCE, delta, threshold=Explicit(mu)) > true_epsilon
    allowed = binom.ppf(0.999, repetitions, 1 - CONFIDENCE)  # 95%: at most ~5% above, with slack for chance
    assert exceed["bonferroni"] <= allowed and exceed["explicit"] <= allowed


def test_bound_rises_with_the_distance_between_the_score_distributions():
    means = []
    for mu in (0.5, 1.0, 2.0, 4.0):
        bounds = []
        for seed in range(10):
            rng = np.random.default_rng(seed)
            bounds.append(CanaryScoreAuditor(rng.normal(mu, 1, 500), rng.normal(0, 1, 500)).epsilon_lower_bound())
        means.append(np.mean(bounds))
    assert all(b > a for a, b in itertools.pairwise(means)), means
    assert means[-1] > 2.0


def test_two_sided_bound_also_swaps_the_neighbouring_datasets():
    # DP bounds both directions, so log(TNR_low - delta) - log(FNR_high) is a bound too, at the same thresholds.
    rng = np.random.default_rng(1)
    in_scores, out_scores = rng.normal(1, 1, 400), rng.normal(0, 1, 400)
    auditor = CanaryScoreAuditor(in_scores, out_scores)
    points, level = auditor.roc, 1 - (1 - CONFIDENCE) / (2 * len(auditor.roc))
    tnr_low = 1 - clopper_pearson_upper(points.false_positives, points.num_out, level)
    fnr_high = clopper_pearson_upper(points.num_in - points.true_positives, points.num_in, level)
    with np.errstate(divide="ignore", invalid="ignore"):
        swapped = np.nanmax(np.log(tnr_low - DELTA) - np.log(fnr_high))  # nan where TNR_low <= delta
    one_sided = auditor.epsilon_lower_bound(CONFIDENCE, DELTA)
    two_sided = auditor.epsilon_lower_bound(CONFIDENCE, DELTA, one_sided=False)
    assert two_sided == pytest.approx(max(one_sided, swapped)) and swapped > one_sided


def test_bonferroni_divides_the_significance_by_the_number_of_hull_vertices():
    rng = np.random.default_rng(2)
    in_scores, out_scores = rng.normal(1, 1, 300), rng.normal(0, 1, 300)
    points = RocPoints.hull(in_scores, out_scores)
    expected, _ = clopper_pearson_epsilon_at(points, (1 - CONFIDENCE) / len(points), delta=DELTA, one_sided=True)
    bound = CanaryScoreAuditor(in_scores, out_scores).epsilon_lower_bound(CONFIDENCE, DELTA, threshold=Bonferroni())
    assert bound == expected > 0


def test_explicit_threshold_above_every_score_gives_zero():
    auditor = CanaryScoreAuditor([1.0, 2.0, 3.0], [0.0, 1.0])
    assert auditor.epsilon_lower_bound(threshold=Explicit(10.0)) == 0.0
    assert auditor.epsilon_one_run(threshold=Explicit(10.0)) == 0.0


def test_split_is_reproducible_and_refuses_an_empty_side():
    rng = np.random.default_rng(3)
    auditor = CanaryScoreAuditor(rng.normal(2, 1, 200), rng.normal(0, 1, 200))
    first = auditor.epsilon_lower_bound(threshold=Split(seed=5))
    assert first == auditor.epsilon_lower_bound(threshold=Split(seed=5)) > 0
    with pytest.raises(ValueError, match="in_scores"):
        CanaryScoreAuditor([1.0], [0.0, 1.0]).epsilon_lower_bound(threshold=Split(seed=0))
    with pytest.raises(ValueError, match="fraction"):
        Split(fraction=1.0)


# ---------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("method", ["epsilon_lower_bound", "epsilon_one_run", "gdp_mu_one_run", "epsilon_one_run_gdp"])
def test_confidence_out_of_range_is_refused_by_name(method):
    auditor = CanaryScoreAuditor([1.0, 2.0], [0.0, 1.0])
    for confidence in (0.0, 1.0, 1.2, -0.5, float("nan")):
        with pytest.raises(ValueError, match="confidence"):
            getattr(auditor, method)(confidence)


def test_bad_scores_and_delta_are_refused_by_name():
    with pytest.raises(ValueError, match="in_scores"):
        CanaryScoreAuditor([], [1.0])
    with pytest.raises(ValueError, match="out_scores"):
        CanaryScoreAuditor([1.0], [])
    with pytest.raises(ValueError, match="in_scores"):
        CanaryScoreAuditor([[1.0]], [1.0])
    with pytest.raises(ValueError, match="out_scores"):
        CanaryScoreAuditor([1.0], [float("nan")])
    auditor = CanaryScoreAuditor([1.0, 2.0], [0.0, 1.0])
    for delta in (-1e-6, 1.0):
        with pytest.raises(ValueError, match="delta"):
            auditor.epsilon_lower_bound(0.95, delta)
        with pytest.raises(ValueError, match="delta"):
            auditor.epsilon_one_run(0.95, delta)
    with pytest.raises(ValueError, match="delta"):
        auditor.epsilon_one_run_gdp(0.95, 0.0)  # the Gaussian curve has epsilon = inf at delta = 0
    with pytest.raises(ValueError, match="fpr"):
        auditor.tpr_at_fpr(1.5)


# ---------------------------------------------------------------------------------------- TPR at FPR, AUROC
def test_auroc_without_hull_is_the_mann_whitney_statistic():
    rng = np.random.default_rng(4)
    in_scores, out_scores = rng.integers(0, 8, 300).astype(float), rng.integers(0, 6, 200).astype(float)  # ties
    auditor = CanaryScoreAuditor(in_scores, out_scores)
    statistic = mannwhitneyu(in_scores, out_scores).statistic / (len(in_scores) * len(out_scores))
    assert auditor.auroc(convex_hull=False) == pytest.approx(statistic, rel=1e-12)
    assert auditor.auroc() >= auditor.auroc(convex_hull=False)


def test_tpr_at_a_vertex_fpr_is_the_empirical_tpr_there():
    rng = np.random.default_rng(5)
    in_scores, out_scores = rng.normal(1, 1, 300), rng.normal(0, 1, 400)
    auditor = CanaryScoreAuditor(in_scores, out_scores)
    points = auditor.roc
    for index in range(1, len(points)):  # vertex 0 (+inf) shares FPR 0 with a higher TPR
        threshold = points.thresholds[index]
        fpr = np.mean(out_scores >= threshold)
        assert auditor.tpr_at_fpr(fpr) == pytest.approx(np.mean(in_scores >= threshold))
    fprs = np.linspace(0, 1, 11)
    assert np.all(np.diff(auditor.tpr_at_fpr(fprs)) >= 0)


def test_separated_scores_have_auroc_one_and_reversed_ones_the_diagonal_hull():
    assert CanaryScoreAuditor([5.0, 6.0], [1.0, 2.0]).auroc() == 1.0
    reversed_scores = CanaryScoreAuditor([1.0, 2.0], [5.0, 6.0])
    assert reversed_scores.auroc() == 0.5 and reversed_scores.auroc(convex_hull=False) == 0.0


# ---------------------------------------------------------------------------------------- one run
def test_one_run_p_value_without_delta_is_the_binomial_tail():
    for m, r, v, eps in [(1000, 100, 80, 1.0), (200, 200, 150, 0.5), (50, 10, 10, 3.0)]:
        assert one_run_p_value(m, r, v, eps, 0.0) == pytest.approx(binom.sf(v - 1, r, expit(eps)))


def test_one_run_p_value_delta_term_follows_the_paper():
    # Steinke et al. 2023 (Algorithm in the appendix), written as a loop over the pmf.
    def reference(m, r, v, eps, delta):
        q = 1 / (1 + math.exp(-eps))
        tail = binom.sf(v - 1, r, q)
        alpha, total = 0.0, 0.0
        for i in range(1, v + 1):
            total += binom.pmf(v - i, r, q)
            alpha = max(alpha, total / i)
        return min(tail + alpha * delta * 2 * m, 1.0)

    for args in [(1000, 100, 80, 1.0, 1e-5), (1000, 300, 250, 1.5, 1e-4), (100, 100, 100, 2.0, 1e-3)]:
        assert one_run_p_value(*args) == pytest.approx(reference(*args), rel=1e-9)


def test_one_run_epsilon_is_where_the_p_value_reaches_the_level():
    m, r, v = 1000, 200, 180
    epsilon = one_run_epsilon(m, r, v, CONFIDENCE, DELTA)
    assert epsilon > 1.0
    assert one_run_p_value(m, r, v, epsilon, DELTA) == pytest.approx(1 - CONFIDENCE, rel=1e-6)
    assert one_run_epsilon(m, r, r // 2, CONFIDENCE, DELTA) == 0.0  # precision 1/2: nothing distinguishable
    assert one_run_epsilon(m, 0, 0, CONFIDENCE, DELTA) == 0.0
    with pytest.raises(ValueError, match="num_correct"):
        one_run_epsilon(m, 10, 11, CONFIDENCE, DELTA)


def test_one_run_bound_on_perfect_guesses_is_the_largest_the_canaries_allow():
    num_in, num_out = 500, 500
    auditor = CanaryScoreAuditor(np.arange(num_in) + 1e4, np.arange(num_out))
    # Bonferroni over the 3 hull vertices; the best is guessing exactly the held-in ones, all correct.
    largest = one_run_epsilon(num_in + num_out, num_in, num_in, 1 - (1 - CONFIDENCE) / 3, DELTA)
    assert auditor.epsilon_one_run(CONFIDENCE, DELTA) == pytest.approx(largest)
    assert one_run_epsilon(1000, 1000, 1000, CONFIDENCE, 0.0) > one_run_epsilon(100, 100, 100, CONFIDENCE, 0.0)


def one_run_gaussian_scores(mu: float, num_canaries: int, seed: int) -> CanaryScoreAuditor:
    """Each canary included with probability 1/2; its score N(mu, 1) if included, else N(0, 1): the
    scores are mu-GDP towards each canary."""
    rng = np.random.default_rng(seed)
    included = rng.random(num_canaries) < 0.5
    scores = rng.normal(0.0, 1.0, num_canaries) + mu * included
    return CanaryScoreAuditor(scores[included], scores[~included])


def test_one_run_bounds_stay_below_the_true_privacy_of_gdp_canaries():
    mu, delta, repetitions = 2.0, 1e-5, 40
    true_epsilon = gdp_epsilon(mu, delta)
    epsilon_over = mu_over = 0
    for seed in range(repetitions):
        auditor = one_run_gaussian_scores(mu, 1000, seed)
        epsilon_over += auditor.epsilon_one_run(CONFIDENCE, delta) > true_epsilon
        mu_over += auditor.gdp_mu_one_run(CONFIDENCE) > mu
    allowed = binom.ppf(0.999, repetitions, 1 - CONFIDENCE)
    assert epsilon_over <= allowed and mu_over <= allowed


def test_one_run_bounds_rise_with_mu_and_the_gdp_variant_is_tighter():
    epsilon_bounds, gdp_bounds = [], []
    for mu in (0.5, 1.0, 2.0, 4.0):
        auditor = one_run_gaussian_scores(mu, 1000, seed=11)
        epsilon_bounds.append(auditor.epsilon_one_run(CONFIDENCE, DELTA))
        gdp_bounds.append(auditor.epsilon_one_run_gdp(CONFIDENCE, DELTA))
    assert all(b > a for a, b in itertools.pairwise(epsilon_bounds))
    assert all(b > a for a, b in itertools.pairwise(gdp_bounds))
    assert all(g >= e for g, e in zip(gdp_bounds, epsilon_bounds))


def test_one_run_gdp_mu_is_zero_without_correct_guesses_and_refuses_bad_counts():
    assert one_run_gdp_mu(100, 10, 0, CONFIDENCE) == 0.0
    assert one_run_gdp_mu(100, 50, 50, CONFIDENCE) > one_run_gdp_mu(100, 50, 40, CONFIDENCE)
    with pytest.raises(ValueError, match="num_guesses"):
        one_run_gdp_mu(10, 11, 1, CONFIDENCE)


# ---------------------------------------------------------------------------------------- GDP
def test_gdp_epsilon_matches_dp_accountings_gaussian_mechanism():
    # get_sigma_gaussian: the analytic Gaussian mechanism (Balle and Wang 2018), solved by bisection.
    for epsilon, delta in [(0.5, 1e-5), (2.0, 1e-5), (8.0, 1e-3), (1.0, 1e-6)]:
        assert 1 / gdp_mu(epsilon, delta) == pytest.approx(dp_accounting.get_sigma_gaussian(epsilon, delta), rel=1e-6)
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(1.0))
    assert gdp_epsilon(1.0, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-3)


def test_gdp_conversions_invert_each_other_and_handle_the_ends():
    for mu, delta in [(0.3, 1e-5), (1.0, 1e-6), (3.0, 1e-3)]:
        epsilon = gdp_epsilon(mu, delta)
        assert gdp_delta(mu, epsilon) == pytest.approx(delta, rel=1e-8)
        assert gdp_mu(epsilon, delta) == pytest.approx(mu, rel=1e-8)
    assert gdp_delta(0.0, 1.0) == 0.0 and gdp_epsilon(0.0, 1e-5) == 0.0
    assert gdp_epsilon(1e-3, 0.5) == 0.0  # delta already met at epsilon = 0
    with pytest.raises(ValueError, match="delta"):
        gdp_epsilon(1.0, 0.0)
    with pytest.raises(ValueError, match="mu"):
        gdp_delta(-1.0, 1.0)


# ---------------------------------------------------------------------------------------- gradient canaries
def test_canary_gradient_is_the_clipped_sum_of_the_included_directions():
    canaries = GradientCanaries(40, 300, seed=0)
    directions = canaries._directions
    np.testing.assert_allclose(directions.norm(dim=1).numpy(), 1.0, rtol=1e-6)
    expected = 2.5 * directions[canaries.included].sum(0)
    # (numpy, not torch.testing: its first call imports torch.distributed, seconds on 2 cores)
    np.testing.assert_allclose(
        canaries.canary_gradient(sample_rate=1.0, clip_norm=2.5).numpy(), expected.numpy(), atol=1e-5
    )
    assert 8 < int(canaries.included.sum()) < 32
    same = GradientCanaries(40, 300, seed=0)
    assert torch.equal(same.included, canaries.included) and torch.equal(same._directions, directions)


def test_dirac_canaries_use_distinct_coordinates_and_score_them():
    canaries = GradientCanaries(20, 50, seed=1, directions="dirac")
    assert len(set(canaries._coordinates.tolist())) == 20
    gradient = canaries.canary_gradient(sample_rate=1.0, clip_norm=1.0)
    assert gradient.sum() == canaries.included.sum() and gradient.abs().max() == 1.0
    canaries.score(gradient)
    np.testing.assert_array_equal(canaries.scores.numpy(), canaries.included.double().numpy())
    with pytest.raises(ValueError, match="dim"):
        GradientCanaries(20, 10, seed=1, directions="dirac")
    with pytest.raises(ValueError, match="released_update"):
        canaries.score(torch.zeros(49))
    with pytest.raises(ValueError, match="sample_rate"):
        canaries.canary_gradient(sample_rate=0.0, clip_norm=1.0)


def test_attach_refuses_what_would_miscount_a_canary():
    params = [nn.Parameter(torch.zeros(3, 4)), nn.Parameter(torch.zeros(4))]
    optimizer = SimpleNamespace(clipper=SimpleNamespace(params=params), sample_rate=0.1, shuffled_batches=None)
    with pytest.raises(ValueError, match="dim"):
        GradientCanaries(5, 17, seed=0).attach(optimizer)
    with pytest.raises(ValueError, match="sample_rate"):
        GradientCanaries(5, 16, seed=0).attach(SimpleNamespace(**{**vars(optimizer), "sample_rate": None}))
    with pytest.raises(ValueError, match="poisson_sampling"):
        GradientCanaries(5, 16, seed=0).attach(SimpleNamespace(**{**vars(optimizer), "shuffled_batches": object()}))


def train_with_canaries(
    noise_multiplier: float, *, steps=1, batch_size=32, examples=32, num_canaries=1000, features=400,
    directions="random", seed=0,
):  # fmt: skip
    """``steps`` Poisson-sampled steps (q = batch_size / examples) of a linear model with gradient canaries;
    (accountant epsilon at 1e-5, the canaries' auditor)."""
    torch.manual_seed(seed)
    x, y = torch.randn(examples, features), torch.randint(0, 10, (examples,))
    model = nn.Linear(features, 10)
    engine = PrivacyEngine()
    wrapped, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size), noise_multiplier=noise_multiplier,
        max_grad_norm=1.0, poisson_sampling=True, noise_seed=seed,
    )  # fmt: skip
    loader.batch_sampler.steps = steps
    dim = sum(p.numel() for p in model.parameters())
    canaries = GradientCanaries(num_canaries, dim, seed=seed, directions=directions)
    canaries.attach(optimizer)
    for xb, yb in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(wrapped(xb), yb).backward()
        optimizer.step()
    assert canaries.steps_scored == steps
    return engine.accountant.get_epsilon(1e-5), canaries.auditor()


def test_one_run_audit_of_training_stays_below_the_accountant_and_rises_as_noise_falls():
    lower_bounds = []
    for sigma in (2.0, 1.0, 0.5):
        claimed, auditor = train_with_canaries(sigma)
        lower_bound = auditor.epsilon_one_run(CONFIDENCE, 1e-5)
        assert lower_bound < claimed, (sigma, lower_bound, claimed)
        # q = 1, one step: the run is exactly (1 / sigma)-GDP towards each canary.
        assert auditor.gdp_mu_one_run(CONFIDENCE) <= 1 / sigma
        lower_bounds.append(lower_bound)
    assert lower_bounds[0] > 0.2 and lower_bounds[0] < lower_bounds[1] < lower_bounds[2], lower_bounds


@pytest.mark.slow
@pytest.mark.parametrize("directions", ["random", "dirac"])
def test_one_run_audit_of_subsampled_training_stays_below_the_accountant(directions):
    # q = 1/2, 10 steps: each included canary takes part in a step with probability q, as an example does.
    lower_bounds = []
    for sigma in (1.0, 0.6):
        claimed, auditor = train_with_canaries(
            sigma, steps=10, batch_size=32, examples=64, directions=directions
        )  # fmt: skip
        lower_bound = auditor.epsilon_one_run(CONFIDENCE, 1e-5)
        assert 0.5 < lower_bound < claimed, (sigma, lower_bound, claimed)
        lower_bounds.append(lower_bound)
    assert lower_bounds[0] < lower_bounds[1]
