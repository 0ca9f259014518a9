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

Times are medians over interleaved rounds, all in ONE process (``time_interleaved``: per round, each
variant runs one untimed step, then its timed step); peak memory is measured per variant in a fresh
process (``peak_memory_increase``: peak RSS growth of a steady-state step on CPU). Ratios are relative
to ``plain``. A matmul timed before and after the runs shows whether the machine's speed changed.

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
from workloads import (
    WORKLOADS,
    Timing,
    Workload,
    get_workload,
    peak_memory_increase,
    peak_mib_in_children,
    reference_matmul_ms,
    runnable_variants,
    time_interleaved,
    training_step,
    use_all_cores,
    versions,
)

from privacy_engine import GradSampleModule, connect_private
from privacy_engine.training.optimizer import DPOptimizer

LEARNING_RATE = 0.05
NOISE_MULTIPLIER = 1.0
MAX_GRAD_NORM = 1.0
VARIANTS = ("plain", "ours-psg", "opacus-psg", "ours-dp", "opacus-dp")

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
def _step_then_clear(
    wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, inputs: torch.Tensor,
    targets: torch.Tensor,
) -> Callable[[], None]:  # fmt: skip
    """A training step of a per-sample-gradient module that ends with the module's own zero_grad: a
    DPOptimizer's zero_grad drops grad_sample too, but in the psg rows nothing consumed them."""

    def step() -> None:
        loss_fn(wrapped(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        wrapped.zero_grad(set_to_none=True)

    return step


def make_step(workload: Workload, variant: str, *, seed: int = 0) -> Callable[[], None]:
    """A closure running one training step of ``variant`` on a fixed batch of ``workload``."""
    torch.manual_seed(seed)
    model = workload.build_model()
    inputs, targets = workload.make_batch(workload.batch_size, torch.Generator().manual_seed(seed))
    loss_fn = workload.loss

    if variant == "plain":
        return training_step(model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE), loss_fn, (inputs,), targets)

    if variant in ("ours-psg", "ours-dp"):
        wrapped = GradSampleModule(model, loss_reduction="mean")
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        if variant == "ours-dp":
            optimizer = DPOptimizer(
                optimizer,
                noise_multiplier=NOISE_MULTIPLIER,
                max_grad_norm=MAX_GRAD_NORM,
                expected_batch_size=workload.batch_size,
                loss_reduction="mean",
                noise_seed=seed,
            )
            connect_private(wrapped, optimizer)
        return _step_then_clear(wrapped, optimizer, loss_fn, inputs, targets)

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
        return _step_then_clear(wrapped, optimizer, loss_fn, inputs, targets)

    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


# ---------------------------------------------------------------------------------- table
SHORT_NAMES = {"mlp": "MLP", "cnn": "CNN", "transformer": "Transformer"}


def _render(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    rendered = [" | ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]
    rendered.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(rendered)


def format_table(rows: list[dict], variants: list[str], *, key: str = "ms") -> str:
    """One line per workload: times (ratio to plain), ours/opacus, and peak-memory ratios."""
    private = [v for v in variants if v != "plain"]
    pairs = [kind for kind in ("psg", "dp") if f"ours-{kind}" in variants and f"opacus-{kind}" in variants]
    header = ["workload", "plain ms"] + [f"{v} ms (x plain)" for v in private]
    header += [f"ours/opacus {kind}" for kind in pairs]
    header += ["peak mem x plain: " + " / ".join(private)]
    lines = [header]
    for row in rows:
        times = row[key]
        cells = [row["name"], f"{times['plain']:.1f}"]
        cells += [f"{times[v]:.1f} ({times[v] / times['plain']:.2f}x)" for v in private]
        cells += [f"{times[f'ours-{kind}'] / times[f'opacus-{kind}']:.2f}" for kind in pairs]
        memory = row["mem_mib"]
        if memory.get("plain"):
            cells.append(" / ".join(f"{memory[v] / memory['plain']:.1f}" for v in private))
        else:
            cells.append("-")
        lines.append(cells)
    return _render(lines)


LEGEND = """\
plain       : the model alone (forward, backward, SGD step)
ours-psg    : privacy_engine GradSampleModule (per-sample gradients) + SGD step; no clipping, no noise
ours-dp     : ours-psg + privacy_engine DPOptimizer: per-example clipping (flat, C=1), Gaussian noise
              (sigma=1), SGD step: a full DP-SGD step
opacus-psg  : Opacus GradSampleModule, hooks mode (the default) + SGD step; no clipping, no noise
opacus-dp   : Opacus GradSampleModule (hooks) + Opacus DPOptimizer (clip C=1, noise sigma=1): what
              make_private gives; Opacus always clips and noises in its optimizer
ratios x plain use the same row's plain step; ours/opacus compares like with like (psg with psg,
dp with dp). Peak mem x plain: peak RSS growth during a steady-state step (above what is held
between steps: parameters, optimizer state), each variant in a fresh process, over plain's."""


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
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
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
    variants = runnable_variants([v for v in VARIANTS if v in args.variants], opacus_installed=opacus_available())
    print(
        versions(opacus, threads=cores, missing="not installed (its columns left out)")
        + f"; median of {repeats} interleaved rounds after {warmup} warm-up rounds",
        flush=True,
    )
    speed_before = reference_matmul_ms()
    print(f"machine check: 1024^3 float32 matmul {speed_before:.1f} ms", flush=True)
    rows = []
    for name in args.workloads:
        workload = get_workload(name)
        steps = {variant: make_step(workload, variant) for variant in variants}
        timings: dict[str, Timing] = time_interleaved(steps, repeats=repeats, warmup=warmup)
        del steps
        memory: dict[str, float] = {}
        if not args.no_memory:
            after = ["--quick"] if args.quick else []
            memory = peak_mib_in_children(variants, [os.path.abspath(__file__), "--memory-child", name], after)
        rows.append(
            {
                "name": SHORT_NAMES[name],
                "workload": workload.description,
                "ms": {v: t.median_ms for v, t in timings.items()},
                "cpu_ms": {v: t.median_cpu_ms for v, t in timings.items()},
                "spread": {v: t.spread for v, t in timings.items()},
                "mem_mib": memory,
            }
        )
        print(
            f"  {name}: "
            + ", ".join(f"{v} {t.median_ms:.1f} ms (IQR/median {t.spread:.2f})" for v, t in timings.items()),
            flush=True,
        )
    speed_after = reference_matmul_ms()
    print(
        f"machine check: 1024^3 float32 matmul {speed_after:.1f} ms after the runs ({speed_before:.1f} ms before)"
        + (
            "  <- the machine's speed changed during the run: numbers are suspect"
            if max(speed_before, speed_after) > 1.5 * min(speed_before, speed_after)
            else ""
        )
    )
    print()
    print("Median wall time per training step")
    print(format_table(rows, variants))
    print()
    print("Median CPU time (user + system, all threads) per step: less disturbed by other processes")
    print(format_table(rows, variants, key="cpu_ms"))
    print()
    print(LEGEND)
    if not args.no_memory:
        print("Peak memory growth, MiB:")
        for row in rows:
            print(f"  {row['name']}: " + ", ".join(f"{v} {m:.0f}" for v, m in row["mem_mib"].items()))
    print("Workloads: " + "; ".join(f"{SHORT_NAMES[n]} = {get_workload(n).description}" for n in args.workloads))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)


if __name__ == "__main__":
    main()
