"""Epsilon time per step with and without the composition cache (PLD, default grid 1e-4), and the
budget guard's cost.

Workload: DP-SGD with sigma 1.0, q 0.01, delta 1e-5 (epsilon 6.2 after 10,000 steps); alternating
histories switch between sigma 1.0 and 1.3. "Without the cache" is what the accountant did before
it had one: dp-accounting's PLDAccountant composing the whole event from scratch at every
get_epsilon after a step (it also rebuilds each entry's PLD).

Tables:
  1. Epsilon asked every step, one growing entry. At n recorded steps, the cached path is timed over
     the next 66 steps (two rebuild cycles of pld.MAX_DRIFT + 1 steps, so rebuilds are amortised as
     in a run); the uncached path is one from-scratch composition at n. The mean over a 10,000-step
     run is estimated from these points: per-step cost interpolated linearly in n between them and
     averaged over n = 1..10,000 (`--full` also runs the 10,000 steps and prints the measured mean).
  2. 100 alternating entries: the first get_epsilon of such a history (cold: no cache, no PLD
     built yet), and the history built one step at a time with epsilon asked every step. The
     uncached baseline is timed on 20 entries and scaled by 5 (dp-accounting's cost is linear in
     entries; `--full` times the 100 entries).
  3. The budget guard: PrivacyBudget.check_release per step (one optimizer: a plan, then a countdown;
     two interleaved optimizers: one composition per check), and steps_left.

Every epsilon printed next to dp-accounting's is the absolute difference from dp-accounting's own
composition of the same event. Times: wall clock and CPU time of this process (on a shared machine
the CPU time is the figure to compare; wall time includes waiting for a core).

    python benchmarks/bench_epsilon.py            # ~10 min on 2 busy cores
    python benchmarks/bench_epsilon.py --quick    # fewer points, ~3 min
    python benchmarks/bench_epsilon.py --full     # + the real 10,000-step run and 100-entry baseline
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import sys
import time
from typing import Self

import dp_accounting

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from accountants import PLDAccountant, _pld_ops
from accountants import pld as pld_module
from privacy_engine.engine.budget import PrivacyBudget, PrivacyBudgetExceeded

DELTA = 1e-5
STEP = {"noise_multiplier": 1.0, "sample_rate": 0.01}
OTHER = {"noise_multiplier": 1.3, "sample_rate": 0.01}
WINDOW = 2 * (pld_module.MAX_DRIFT + 1)


class Timer:
    def __enter__(self) -> Self:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def forget_shared_caches() -> None:
    """Drop the PLDs shared between accountants, so that a measurement starts cold."""
    pld_module._ATOM_PLDS.clear()
    _pld_ops._SPECTRA.clear()


def dp_epsilon(accountant: PLDAccountant) -> tuple[float, Timer]:
    with Timer() as timer:
        epsilon = dp_accounting.pld.PLDAccountant().compose(accountant.event()).get_epsilon(DELTA)
    return epsilon, timer


def every_step_table(points: list[int]) -> list[tuple[int, float, float, float]]:
    print("\n1. Epsilon asked every step (one entry growing; ms per step)")
    print(f"{'steps n':>8} {'cached wall':>12} {'cached cpu':>11} {'uncached wall':>14} {'uncached cpu':>13} "
          f"{'|eps - dp| at most drift':>25}")  # fmt: skip
    rows = []
    for steps in points:
        forget_shared_caches()
        accountant = PLDAccountant()
        accountant.step(**STEP, num_steps=steps)
        reference, uncached = dp_epsilon(accountant)
        accountant.get_epsilon(DELTA)  # the run so far; then the next WINDOW steps, asked each time
        with Timer() as cached:
            for _ in range(WINDOW):
                accountant.step(**STEP)
                accountant.get_epsilon(DELTA)
        # Compared where the cached value is furthest from a rebuild (MAX_DRIFT extra trims).
        probe = copy.deepcopy(accountant)
        probe.get_epsilon(DELTA)  # rebuilt the way dp-accounting builds it (no cache in a copy)
        for _ in range(pld_module.MAX_DRIFT):
            probe.step(**STEP)
            probe.get_epsilon(DELTA)
        assert probe._composition().drift == pld_module.MAX_DRIFT
        difference = abs(probe.get_epsilon(DELTA) - dp_epsilon(probe)[0])
        rows.append((steps, cached.wall / WINDOW, cached.cpu / WINDOW, uncached.wall))
        print(f"{steps:>8} {1e3 * cached.wall / WINDOW:>12.1f} {1e3 * cached.cpu / WINDOW:>11.1f} "
              f"{1e3 * uncached.wall:>14.0f} {1e3 * uncached.cpu:>13.0f} {difference:>25.1e}")  # fmt: skip
        del reference
    return rows


def estimate_run(rows: list[tuple[int, float, float, float]], total: int = 10_000) -> None:
    def interpolate(n: int, column: int) -> float:
        for (n0, *v0), (n1, *v1) in itertools.pairwise(rows):
            if n0 <= n <= n1:
                return v0[column] + (v1[column] - v0[column]) * (n - n0) / (n1 - n0)
        return rows[-1][column + 1] if n > rows[-1][0] else rows[0][column + 1]

    means = [sum(interpolate(n, column) for n in range(1, total + 1)) / total for column in range(3)]
    print(f"   estimated mean over a {total:,}-step run: cached {1e3 * means[0]:.1f} ms wall, "
          f"{1e3 * means[1]:.1f} ms cpu per step; uncached {means[2]:.2f} s per step "
          f"({means[2] * total / 3600:.1f} h in all)")  # fmt: skip


def full_run(total: int = 10_000) -> None:
    forget_shared_caches()
    accountant = PLDAccountant()
    with Timer() as timer:
        for _ in range(total):
            accountant.step(**STEP)
            accountant.get_epsilon(DELTA)
    difference = abs(accountant.get_epsilon(DELTA) - dp_epsilon(accountant)[0])
    print(f"   measured {total:,}-step run: {1e3 * timer.wall / total:.1f} ms wall, "
          f"{1e3 * timer.cpu / total:.1f} ms cpu per step; final |eps - dp| {difference:.1e}")  # fmt: skip


def alternating_history(entries: int, steps_per_entry: int) -> PLDAccountant:
    accountant = PLDAccountant()
    for index in range(entries):
        accountant.step(**(STEP if index % 2 == 0 else OTHER), num_steps=steps_per_entry)
    return accountant


def alternating_table(full: bool) -> None:
    print("\n2. 100 alternating entries (sigma 1.0 / 1.3, 10 steps each)")
    forget_shared_caches()
    accountant = alternating_history(100, 10)
    with Timer() as cold:
        epsilon = accountant.get_epsilon(DELTA)
    reference_entries = 100 if full else 20
    reference, uncached = dp_epsilon(alternating_history(reference_entries, 10))
    scale = 100 / reference_entries
    exact = dp_epsilon(accountant)[0] if full else None
    print(
        f"   cold first get_epsilon: {cold.wall:.2f} s wall, {cold.cpu:.2f} s cpu"
        + (f"; |eps - dp| {abs(epsilon - exact):.1e}" if exact is not None else "")
    )
    print(
        f"   uncached (dp-accounting from scratch): {scale * uncached.wall:.1f} s wall, {scale * uncached.cpu:.1f} s cpu"
        + ("" if full else f" (20 entries: {uncached.wall:.1f} s, times 5)")
    )
    forget_shared_caches()
    accountant = PLDAccountant()
    with Timer() as built:
        for index in range(100):
            accountant.step(**(STEP if index % 2 == 0 else OTHER))
            accountant.get_epsilon(DELTA)
    difference = abs(accountant.get_epsilon(DELTA) - dp_epsilon(accountant)[0])
    print(f"   built one step at a time, asked every step: {1e3 * built.wall / 100:.1f} ms wall, "
          f"{1e3 * built.cpu / 100:.1f} ms cpu per step; final |eps - dp| {difference:.1e}")  # fmt: skip
    del reference


def guard_table() -> None:
    print("\n3. Budget guard (max_epsilon 2.0 at delta 1e-5)")
    forget_shared_caches()
    accountant = PLDAccountant()
    accountant.step(**STEP, num_steps=500)
    with Timer() as planning:
        left = accountant.steps_left(2.0, DELTA, **STEP)
    print(f"   steps_left after 500 steps: {left} steps, {planning.wall:.2f} s wall, {planning.cpu:.2f} s cpu")
    budget = PrivacyBudget(2.0, DELTA)
    checks = 0
    with Timer() as guarded:
        try:
            while True:
                budget.check_release(accountant, **STEP)
                accountant.step(**STEP)
                checks += 1
        except PrivacyBudgetExceeded:
            pass
    print(f"   one optimizer, checked every step until refused: {checks} steps allowed (steps_left said "
          f"{left}), {1e3 * guarded.wall / (checks + 1):.2f} ms wall, {1e3 * guarded.cpu / (checks + 1):.2f} ms cpu "
          "per check (includes the plan and the refusal)")  # fmt: skip
    forget_shared_caches()
    accountant = PLDAccountant()
    accountant.step(**STEP, num_steps=500)
    accountant.step(**OTHER, num_steps=100, source="second")
    accountant.get_epsilon(DELTA)  # warm: the run so far composed
    budget = PrivacyBudget(2.0, DELTA)
    with Timer() as interleaved:
        for index in range(WINDOW):
            kwargs = STEP if index % 2 == 0 else {**OTHER, "source": "second"}
            budget.check_release(accountant, **kwargs)
            accountant.step(**kwargs)
            accountant.get_epsilon(DELTA)  # a progress bar: found in the cache
    print(f"   two optimizers interleaved (one composition per check, both entries growing): "
          f"{1e3 * interleaved.wall / WINDOW:.1f} ms wall, {1e3 * interleaved.cpu / WINDOW:.1f} ms cpu per step")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer points")
    parser.add_argument("--full", action="store_true", help="also the real 10,000-step run and 100-entry baseline")
    arguments = parser.parse_args()
    points = [1, 1000, 10_000] if arguments.quick else [1, 300, 1000, 3000, 6000, 10_000]
    print(f"PLD accountant, grid {pld_module.DEFAULT_VALUE_DISCRETIZATION_INTERVAL}, delta {DELTA}; "
          f"MAX_DRIFT {pld_module.MAX_DRIFT}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
    rows = every_step_table(points)
    estimate_run(rows)
    if arguments.full:
        full_run()
    alternating_table(arguments.full)
    guard_table()


if __name__ == "__main__":
    main()
