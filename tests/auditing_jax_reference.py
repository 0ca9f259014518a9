"""Records JAX Privacy's auditing numbers on fixed score sets, for tests/test_auditing.py.

Run with JAX Privacy installed (in a throwaway environment: jax is no dependency of this project):

    python3 -m venv /tmp/jaxvenv && /tmp/jaxvenv/bin/pip install jax jax-privacy
    /tmp/jaxvenv/bin/python tests/auditing_jax_reference.py

It writes tests/auditing_jax_reference.json: the score sets (rounded, so the file alone reproduces them)
and, for each, what ``jax_privacy.auditing.CanaryScoreAuditor`` returns; the file names the version.
"""

from __future__ import annotations

import json
import pathlib
from importlib.metadata import version

import numpy as np

SIGNIFICANCE = 0.05
DELTA = 1e-5
FPRS = [0.0, 0.01, 0.1, 0.5, 1.0]


def score_sets() -> dict[str, tuple[list[float], list[float]]]:
    rng = np.random.default_rng(2024)
    sets = {
        "jax_docstring": (np.arange(100) + 9.5, np.arange(100)),
        "gaussian_mu1": (rng.normal(1.0, 1.0, 400), rng.normal(0.0, 1.0, 400)),
        "gaussian_mu3_unbalanced": (rng.normal(3.0, 1.0, 150), rng.normal(0.0, 1.0, 250)),
        "integer_ties": (rng.integers(2, 12, 300), rng.integers(0, 10, 300)),
        "overlapping_shift": (10.0 + np.arange(40), np.arange(40)),
        "separated": (100.0 + np.arange(40), np.arange(40)),
        "one_run_mu2": (rng.normal(2.0, 1.0, 500), rng.normal(0.0, 1.0, 500)),
    }
    return {name: (np.round(a, 4).tolist(), np.round(b, 4).tolist()) for name, (a, b) in sets.items()}


def jax_values(in_scores: list[float], out_scores: list[float]) -> dict[str, object]:
    from jax_privacy import auditing

    auditor = auditing.CanaryScoreAuditor(np.array(in_scores), np.array(out_scores))
    middle = float(np.median(np.concatenate([in_scores, out_scores])))
    cp = auditor.epsilon_clopper_pearson
    one_run = auditor.epsilon_one_run
    return {
        "explicit_threshold": middle,
        "cp_bonferroni_delta0": float(cp(SIGNIFICANCE, 0.0)),
        "cp_bonferroni": float(cp(SIGNIFICANCE, DELTA)),
        "cp_bonferroni_two_sided": float(cp(SIGNIFICANCE, DELTA, one_sided=False)),
        "cp_explicit": float(cp(SIGNIFICANCE, DELTA, threshold_strategy=auditing.Explicit(middle))),
        "cp_split_seed0": float(cp(SIGNIFICANCE, DELTA, threshold_strategy=auditing.Split(seed=0))),
        "tpr_at_fpr": [float(x) for x in auditor.tpr_at_given_fpr(np.array(FPRS))],
        "auroc": float(auditor.attack_auroc()),
        "one_run_bonferroni": float(one_run(SIGNIFICANCE, DELTA)),
        "one_run_explicit": float(one_run(SIGNIFICANCE, DELTA, threshold_strategy=auditing.Explicit(middle))),
        "one_run_split_seed0": float(one_run(SIGNIFICANCE, DELTA, threshold_strategy=auditing.Split(seed=0))),
        "one_run_fdp_bonferroni": float(auditor.epsilon_one_run_fdp(SIGNIFICANCE, DELTA)),
    }


def main() -> None:
    sets = score_sets()
    record = {
        "jax_privacy_version": version("jax-privacy"),
        "significance": SIGNIFICANCE,
        "delta": DELTA,
        "fprs": FPRS,
        "sets": {name: {"in": a, "out": b, "values": jax_values(a, b)} for name, (a, b) in sets.items()},
    }
    path = pathlib.Path(__file__).with_suffix(".json")
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path} (jax-privacy {record['jax_privacy_version']})")


if __name__ == "__main__":
    main()
