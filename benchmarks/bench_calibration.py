"""Noise calibration: `calibrate_noise_multiplier` against dp-accounting's `calibrate_dp_mechanism`.

Both calibrate DP-SGD (Poisson-subsampled Gaussian, composed over `steps`) against dp-accounting's
PLD accountant at its default grid (1e-4); dp-accounting's search uses its defaults (bracket from
[0, 1], Brent, tol 1e-6). Each row prints both times, their ratio, both sigmas, and the epsilon of
each sigma recomputed independently with dp_accounting.pld.PLDAccountant.

    python benchmarks/bench_calibration.py            # steps 500/1000/2000 x epsilon 1/3/8
    python benchmarks/bench_calibration.py --quick    # steps 500 x epsilon 1/8
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import dp_accounting

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from accountants import calibrate_noise_multiplier


def _event(sigma: float, sample_rate: float, steps: int) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            sample_rate, dp_accounting.GaussianDpEvent(sigma)
        ),
        steps,
    )


def _pld_epsilon(sigma: float, sample_rate: float, steps: int, delta: float) -> float:
    accountant = dp_accounting.pld.PLDAccountant()
    return accountant.compose(_event(sigma, sample_rate, steps)).get_epsilon(delta)


def _timed(function, *args, **kwargs):
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - start


def dp_accounting_calibration(
    target_epsilon: float, delta: float, sample_rate: float, steps: int
) -> float:
    """The baseline: dp-accounting's generic calibration with its defaults."""
    return dp_accounting.calibrate_dp_mechanism(
        dp_accounting.pld.PLDAccountant,
        lambda sigma: _event(sigma, sample_rate, steps),
        target_epsilon,
        delta,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="two small configurations only"
    )
    parser.add_argument("--sample-rate", type=float, default=0.01)
    parser.add_argument("--delta", type=float, default=1e-5)
    args = parser.parse_args()

    steps_list = (500,) if args.quick else (500, 1000, 2000)
    epsilons = (1.0, 8.0) if args.quick else (1.0, 3.0, 8.0)
    q, delta = args.sample_rate, args.delta

    header = (
        f"{'steps':>5} {'q':>5} {'eps*':>4} | {'dp-acc s':>8} {'ours s':>7} {'ratio':>6} | "
        f"{'sigma dp-acc':>12} {'sigma ours':>10} {'diff %':>7} | {'eps(dp-acc)':>11} {'eps(ours)':>9}"
    )
    print(
        f"delta = {delta:g}; PLD grid 1e-4; times in seconds (wall clock, one run each)"
    )
    print(header)
    print("-" * len(header))
    ratios = []
    for steps in steps_list:
        for target in epsilons:
            sigma_ref, time_ref = _timed(
                dp_accounting_calibration, target, delta, q, steps
            )
            sigma_ours, time_ours = _timed(
                calibrate_noise_multiplier, target, delta, q, steps, accountant="pld"
            )
            eps_ref = _pld_epsilon(sigma_ref, q, steps, delta)
            eps_ours = _pld_epsilon(sigma_ours, q, steps, delta)
            ratios.append(time_ours / time_ref)
            print(
                f"{steps:>5} {q:>5g} {target:>4g} | {time_ref:>8.2f} {time_ours:>7.2f} "
                f"{time_ours / time_ref:>6.2f} | {sigma_ref:>12.5f} {sigma_ours:>10.5f} "
                f"{100 * (sigma_ours / sigma_ref - 1):>+7.3f} | {eps_ref:>11.5f} {eps_ours:>9.5f}",
                flush=True,
            )
    print(f"worst ratio {max(ratios):.2f}, mean ratio {sum(ratios) / len(ratios):.2f}")


if __name__ == "__main__":
    main()
