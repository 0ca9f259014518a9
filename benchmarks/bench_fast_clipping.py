"""Fast (ghost) clipping against the materialised path, Opacus 1.6 and a non-private step.

One training step per variant, on the workloads of ``benchmarks/workloads.py`` (MLP and CNN batch
256, Transformer batch 64), all with plain SGD underneath:

================  ==================================================================================
variant           step
================  ==================================================================================
plain             the model alone, no privacy (the reference of every ratio)
ghost-clip        ``GhostClippingModule``: per-example norms + clipped sum in one backward, written
                  into ``.grad`` by the clipper; no noise (the cost of clipping alone)
ghost-dp          ghost-clip + ``DPOptimizer`` (Gaussian noise, sigma=1): a full DP-SGD step
materialised-dp   ``GradSampleModule`` (per-sample gradients) + ``DPOptimizer``: a full DP-SGD step
opacus-hooks      Opacus 1.6 ``make_private(grad_sample_mode="hooks")``: a full DP-SGD step
opacus-ghost      Opacus 1.6 ``make_private(grad_sample_mode="ghost")`` (criterion wrapper, two
                  backward passes): a full DP-SGD step
================  ==================================================================================

Times: medians over interleaved rounds, all variants in ONE process (``workloads.time_interleaved``:
each variant's timed step follows an untimed step of its own): wall time, and the process's CPU time
per step (with ``--threads 1`` the CPU time is the work done, unaffected by waiting for a shared CPU). Peak
memory: peak RSS growth of a steady-state step, one fresh process per variant
(``peak_memory_increase``). Ratios are to ``plain``. Opacus needs ``ModuleValidator.fix`` for the
Transformer (nn.MultiheadAttention -> DPMultiheadAttention); ours wraps the model as it is.

Run:  python benchmarks/bench_fast_clipping.py [--quick] [--threads N] [--workloads mlp cnn transformer]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable

# Opacus installs a top-level package named `benchmarks`: import the sibling module directly.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch
from workloads import (
    CPU,
    WORKLOADS,
    Workload,
    get_workload,
    opacus_step,
    peak_memory_increase,
    peak_mib_in_children,
    render_table,
    runnable_variants,
    set_threads,
    time_interleaved,
    training_step,
    versions,
)

from privacy_engine import GradSampleModule, connect_private
from privacy_engine.clipping import PerSampleGradientClipper
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.noise import GaussianNoise
from privacy_engine.training.optimizer import DPOptimizer

LEARNING_RATE = 0.05
NOISE_MULTIPLIER = 1.0
MAX_GRAD_NORM = 1.0
VARIANTS = ("plain", "ghost-clip", "ghost-dp", "materialised-dp", "opacus-hooks", "opacus-ghost")

try:
    import opacus
    from opacus.validators import ModuleValidator
except ImportError:  # our rows still run without Opacus
    opacus = None


def make_step(workload: Workload, variant: str, *, seed: int = 0, device: torch.device = CPU) -> Callable[[], None]:
    """A closure running one training step of ``variant`` on a fixed batch of ``workload`` (on ``device``)."""
    torch.manual_seed(seed)
    model = workload.build_model().to(device)
    inputs, targets = (t.to(device) for t in workload.make_batch(workload.batch_size, torch.Generator().manual_seed(seed)))
    loss_fn = workload.loss
    sgd = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)

    if variant == "plain":
        return training_step(model, sgd, loss_fn, (inputs,), targets)

    if variant == "ghost-clip":
        clipper = PerSampleGradientClipper(list(model.parameters()), MAX_GRAD_NORM)
        wrapped = GhostClippingModule(model, clipper=clipper)

        def step() -> None:
            loss_fn(wrapped(inputs), targets).backward()
            clipper.pre_step()  # clipped sum -> .grad
            sgd.step()
            sgd.zero_grad(set_to_none=True)

        return step

    if variant in ("ghost-dp", "materialised-dp"):
        optimizer = DPOptimizer(
            sgd,
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM,
            expected_batch_size=workload.batch_size,
            noise=GaussianNoise(seed=seed),
        )
        if variant == "ghost-dp":
            wrapped = GhostClippingModule(model, clipper=optimizer.clipper)
        else:
            wrapped = GradSampleModule(model)
        connect_private(wrapped, optimizer)
        return training_step(wrapped, optimizer, loss_fn, (inputs,), targets)

    if variant in ("opacus-hooks", "opacus-ghost"):
        if opacus is None:
            raise RuntimeError("opacus is not installed")
        if ModuleValidator.validate(model, strict=False):
            model = ModuleValidator.fix(model)  # nn.MultiheadAttention -> DPMultiheadAttention
            sgd = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        return opacus_step(
            model, sgd, (inputs,), targets, mode=variant.removeprefix("opacus-"), loss_fn=loss_fn,
            batch_size=workload.batch_size, noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM,
        )  # fmt: skip

    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


# ---------------------------------------------------------------------------------- table
def format_table(rows: list[dict], variants: list[str]) -> str:
    header = ["workload", "variant", "wall ms", "x plain", "CPU ms", "x plain", "peak MiB", "x plain"]
    lines = [header]
    for row in rows:
        plain, plain_mib = row["times"]["plain"], row["mem_mib"].get("plain")
        for variant in variants:
            times, mib = row["times"].get(variant), row["mem_mib"].get(variant)
            cells = [row["workload"] if variant == variants[0] else "", variant]
            for key in ("wall_ms", "cpu_ms"):
                value = None if times is None else times[key]
                cells += ["-", "-"] if value is None else [f"{value:.1f}", f"{value / plain[key]:.2f}"]
            cells += ["-" if mib is None else f"{mib:.1f}", "-" if mib is None or not plain_mib else f"{mib / plain_mib:.2f}"]
            lines.append(cells)
    return render_table(lines)


def _memory_child(workload_name: str, variant: str, steps: int, threads: int | None) -> None:
    set_threads(threads)
    warnings.simplefilter("ignore")
    step = make_step(get_workload(workload_name), variant)
    print(json.dumps({"peak_bytes": peak_memory_increase(step, steps=steps, warmup=2)}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (a smoke run; numbers are noisy)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 21, quick 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-variant memory processes")
    parser.add_argument("--json", metavar="PATH", help="also write the raw numbers as JSON")
    parser.add_argument("--memory-child", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    memory_steps = 2 if args.quick else 3
    if args.memory_child:
        _memory_child(*args.memory_child, steps=memory_steps, threads=args.threads)
        return

    cores = set_threads(args.threads)
    warnings.simplefilter("ignore")  # Opacus's notices (secure RNG, full backward hooks)
    repeats = args.repeats or (5 if args.quick else 21)
    warmup = 2 if args.quick else 3
    variants = runnable_variants(args.variants, opacus_installed=opacus is not None)
    print(
        versions(opacus, threads=cores)
        + f"; median of {repeats} interleaved rounds after {warmup} warm-up rounds; load average "
        + ", ".join(f"{load:.1f}" for load in os.getloadavg()),
        flush=True,
    )
    rows = []
    for name in args.workloads:
        workload = get_workload(name)
        steps = {variant: make_step(workload, variant) for variant in variants}
        timings = {
            variant: {"wall_ms": timing.median_ms, "cpu_ms": timing.median_cpu_ms}
            for variant, timing in time_interleaved(steps, repeats=repeats, warmup=warmup).items()
        }
        del steps
        memory: dict[str, float] = {}
        if not args.no_memory:
            after = (["--quick"] if args.quick else []) + ([f"--threads={args.threads}"] if args.threads else [])
            memory = peak_mib_in_children(variants, [os.path.abspath(__file__), "--memory-child", name], after)
        rows.append({"workload": workload.description, "times": timings, "mem_mib": memory})
        print(f"  done {name}: " + ", ".join(f"{v} {t['wall_ms']:.1f} ms" for v, t in timings.items()), flush=True)
    print()
    print(format_table(rows, variants))
    print()
    print(
        f"C={MAX_GRAD_NORM}, sigma={NOISE_MULTIPLIER}, SGD lr={LEARNING_RATE}. -dp rows include drawing the Gaussian "
        f"noise (one normal per parameter), ghost-clip does not. Peak MiB = peak RSS growth of a steady-state step "
        f"in a fresh process."
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)


if __name__ == "__main__":
    main()
