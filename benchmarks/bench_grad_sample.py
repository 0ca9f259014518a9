"""Cost of per-sample gradients: one training step with them vs the same step without.

For each workload of ``benchmarks/workloads.py`` and each variant below, one training step is
forward + loss + backward + optimizer step (plain SGD, no momentum) + ``zero_grad``:

==============  ==========================================================================
variant         step
==============  ==========================================================================
plain           the model, no per-sample gradients (the reference of every ratio)
ours-psg        privacy_engine ``GradSampleModule``: per-sample gradients, then SGD on the
                ordinary gradient (no clipping, no noise)
ours-dp         ours-psg + per-example clipping + Gaussian noise (a full DP-SGD step)
opacus-psg      Opacus 1.6 ``GradSampleModule`` in hooks mode, then SGD (no clip, no noise)
opacus-dp       Opacus 1.6 ``GradSampleModule`` (hooks) + ``DPOptimizer``: a full DP-SGD step
==============  ==========================================================================

Times are medians over interleaved rounds, all in ONE process (``time_interleaved``); peak memory
is measured per variant in a fresh process (``peak_memory_increase``: peak RSS growth of a
steady-state step on CPU). Ratios are relative to ``plain``.

Run:  python benchmarks/bench_grad_sample.py [--quick]   (from any directory)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable

# Opacus installs a top-level package named `benchmarks`, so this folder is not imported as a
# package: its scripts import `workloads` as a sibling module, and the repository is put on the path.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch
from torch import nn
from workloads import (
    MEMORY_CHILD_ENV,
    WORKLOADS,
    Timing,
    Workload,
    get_workload,
    peak_memory_increase,
    run_python_json,
    time_interleaved,
    use_all_cores,
)

from privacy_engine import GradSampleModule
from privacy_engine.clip_factors import clip_factors
from privacy_engine.noise import GaussianNoise

LEARNING_RATE = 0.05
NOISE_MULTIPLIER = 1.0
MAX_GRAD_NORM = 1.0
VARIANTS = ("plain", "ours-psg", "ours-dp", "opacus-psg", "opacus-dp")

try:
    import opacus
    from opacus import GradSampleModule as OpacusGradSampleModule
    from opacus.optimizers import DPOptimizer as OpacusDPOptimizer
    from opacus.validators import ModuleValidator
except ImportError:  # the benchmark still runs our rows without Opacus
    opacus = None


def opacus_available() -> bool:
    return opacus is not None


# ---------------------------------------------------------------------------------- variants
def _ours_dp_update(model: nn.Module, noise: GaussianNoise, batch_size: int) -> None:
    """Clip each example's whole-model gradient to MAX_GRAD_NORM, sum, add noise, divide by the
    batch size; written by hand with ``clip_factors`` and ``GaussianNoise`` (the library's
    DP optimizer is not used here), the same arithmetic as Opacus's DPOptimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    per_sample = [p.grad_sample for p in params]
    squared_norms = torch.stack([g.reshape(g.shape[0], -1).pow(2).sum(1) for g in per_sample], dim=1)
    factors = clip_factors(squared_norms.sum(1).sqrt(), MAX_GRAD_NORM)
    clipped_sums = [torch.einsum("i,i...->...", factors, g) for g in per_sample]
    noise.add_noise_(clipped_sums, NOISE_MULTIPLIER, MAX_GRAD_NORM)
    for param, clipped_sum in zip(params, clipped_sums):
        param.grad = clipped_sum.div_(batch_size)


def make_step(workload: Workload, variant: str, *, seed: int = 0) -> Callable[[], None]:
    """A closure running one training step of ``variant`` on a fixed batch of ``workload``."""
    torch.manual_seed(seed)
    model = workload.build_model()
    inputs, targets = workload.make_batch(workload.batch_size, torch.Generator().manual_seed(seed))
    loss_fn = workload.loss

    if variant == "plain":
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)

        def step() -> None:
            loss_fn(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    if variant in ("ours-psg", "ours-dp"):
        wrapped = GradSampleModule(model, loss_reduction="mean")
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        noise = GaussianNoise(seed=seed)
        clip_and_noise = variant == "ours-dp"

        def step() -> None:
            loss_fn(wrapped(inputs), targets).backward()
            if clip_and_noise:
                _ours_dp_update(model, noise, workload.batch_size)
            optimizer.step()
            wrapped.zero_grad(set_to_none=True)

        return step

    if variant in ("opacus-psg", "opacus-dp"):
        if opacus is None:
            raise RuntimeError("opacus is not installed")
        if ModuleValidator.validate(model, strict=False):
            model = ModuleValidator.fix(model)  # nn.MultiheadAttention -> DPMultiheadAttention
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = OpacusGradSampleModule(model, batch_first=True, loss_reduction="mean")
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=LEARNING_RATE)
        if variant == "opacus-dp":
            optimizer = OpacusDPOptimizer(
                optimizer,
                noise_multiplier=NOISE_MULTIPLIER,
                max_grad_norm=MAX_GRAD_NORM,
                expected_batch_size=workload.batch_size,
                loss_reduction="mean",
            )

        def step() -> None:
            loss_fn(wrapped(inputs), targets).backward()
            optimizer.step()
            # DPOptimizer.zero_grad drops grad_sample too; for psg the module's zero_grad does.
            optimizer.zero_grad(set_to_none=True)
            wrapped.zero_grad(set_to_none=True)

        return step

    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


# ---------------------------------------------------------------------------------- table
def _ratio_cell(value: float | None, reference: float, unit_format: str) -> str:
    if value is None:
        return "-"
    return f"{unit_format.format(value)} ({value / reference:.2f}x)"


def format_table(rows: list[dict], variants: list[str]) -> str:
    private = [v for v in variants if v != "plain"]
    header = ["workload", "plain ms"] + [f"{v} ms (x plain)" for v in private] + ["peak mem (x plain): " + " / ".join(private)]
    lines = [header]
    for row in rows:
        plain_ms = row["ms"]["plain"]
        cells = [row["workload"], f"{plain_ms:.1f}"]
        cells += [_ratio_cell(row["ms"].get(v), plain_ms, "{:.1f}") for v in private]
        plain_mem = row["mem_mib"].get("plain")
        if plain_mem:
            cells.append(" / ".join(f"{row['mem_mib'][v] / plain_mem:.2f}" if v in row["mem_mib"] else "-" for v in private))
        else:
            cells.append("-")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    rendered = [" | ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in lines]
    rendered.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(rendered)


# ---------------------------------------------------------------------------------- main
def _memory_child(workload_name: str, variant: str, steps: int) -> None:
    use_all_cores()
    warnings.simplefilter("ignore")
    step = make_step(get_workload(workload_name), variant)
    peak = peak_memory_increase(step, steps=steps, warmup=2)
    print(json.dumps({"peak_bytes": peak}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (a smoke run; numbers are noisy)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 20, quick 5)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-variant memory processes")
    parser.add_argument("--json", metavar="PATH", help="also write the raw numbers as JSON")
    parser.add_argument("--memory-child", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    memory_steps = 2 if args.quick else 3
    if args.memory_child:
        _memory_child(*args.memory_child, steps=memory_steps)
        return

    cores = use_all_cores()
    warnings.simplefilter("ignore")  # Opacus's full-backward-hook notice and similar
    repeats = args.repeats or (5 if args.quick else 20)
    warmup = 2 if args.quick else 3
    variants = [v for v in VARIANTS if opacus_available() or not v.startswith("opacus")]
    print(
        f"torch {torch.__version__}, {cores} threads"
        + (f", opacus {opacus.__version__}" if opacus_available() else ", opacus not installed")
        + f"; median of {repeats} interleaved rounds after {warmup} warm-up rounds"
    )
    rows = []
    for name in args.workloads:
        workload = get_workload(name)
        steps = {variant: make_step(workload, variant) for variant in variants}
        timings: dict[str, Timing] = time_interleaved(steps, repeats=repeats, warmup=warmup)
        del steps
        memory: dict[str, float] = {}
        if not args.no_memory:
            for variant in variants:
                result = run_python_json(
                    [os.path.abspath(__file__), "--memory-child", name, variant]
                    + (["--quick"] if args.quick else []),
                    env=MEMORY_CHILD_ENV,
                )
                memory[variant] = result["peak_bytes"] / 2**20
        rows.append(
            {
                "workload": workload.description,
                "ms": {v: t.median_ms for v, t in timings.items()},
                "spread": {v: t.spread for v, t in timings.items()},
                "mem_mib": memory,
            }
        )
        print(f"  done {name}: " + ", ".join(f"{v} {t.median_ms:.1f} ms" for v, t in timings.items()), flush=True)
    print()
    print(format_table(rows, variants))
    print()
    print(
        "psg = per-sample gradients + SGD step (no clipping, no noise); dp = per-sample gradients + "
        "per-example clipping (C=1) + Gaussian noise (sigma=1) + SGD step. ours-dp clips by hand with "
        "privacy_engine.clip_factors and adds privacy_engine.noise.GaussianNoise; opacus-dp is Opacus's "
        "DPOptimizer. Peak mem = peak RSS growth of a steady-state step, one fresh process per variant."
    )
    if not args.no_memory:
        print("peak memory MiB: " + "; ".join(
            f"{row['workload'].split(',')[0]}: " + ", ".join(f"{v} {m:.0f}" for v, m in row["mem_mib"].items())
            for row in rows
        ))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)


if __name__ == "__main__":
    main()
