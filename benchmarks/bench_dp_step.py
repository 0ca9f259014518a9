"""The whole DP step (forward, backward, optimizer.step with noise) against a non-private step.

One training step per variant on the workloads of ``benchmarks/workloads.py`` (MLP and CNN batch 256,
Transformer batch 64, the small HF decoder ``hf-decoder``: GPT-2, 2 layers, hidden 64, batch 8; ``--batch-sizes``
runs each at other batch sizes), plain SGD underneath, ``zero_grad(set_to_none=True)`` at the end:

==============  ==================================================================================
variant         step
==============  ==================================================================================
plain           the model alone, no privacy (the reference of every ratio)
ghost           ``GhostClippingModule`` + ``DPOptimizer``: flat clipping C=1, Gaussian noise
                sigma=1, an RDP accountant recording every step: what ``make_private(...,
                grad_sample_mode="ghost")`` builds, minus the loader
ghost-bandmf4   the same with ``BandMFNoise`` of 4 bands (coefficients from ``optimize_banded_toeplitz``)
hooks           ``GradSampleModule`` (materialised per-sample gradients) + the same ``DPOptimizer``
opacus-hooks    Opacus 1.6 ``make_private(grad_sample_mode="hooks")`` (when Opacus is installed)
opacus-ghost    Opacus 1.6 ``make_private(grad_sample_mode="ghost")`` (criterion wrapper, two passes)
==============  ==================================================================================

Times: ``workloads.time_interleaved`` (all variants round-robin in ONE process, each timed step after
an untimed step of its own), repeated ``--runs`` times; each run gives a median per variant and its
ratio to ``plain``; the table shows the **median over runs** of those ratios and times (and the lowest
and highest run ratio of the wall times). Three clocks: wall time; the process's CPU time (user +
system, all threads: on a machine shared with other jobs it is the work done, not the waiting); and
the main thread's CPU time, which with 1 torch thread is the step's critical path even when a helper
thread (the background noise draw, ``privacy_engine.noise.prefetch``) works beside it on another core:
with a spare core and no other load, wall time tends to it.

Python overhead per step (the "python overhead ms" column, issue 25): the fixed cost a variant adds to a
step whatever the arithmetic, measured as the variant's main-thread CPU ms minus plain's on the workload's
*skeleton* (``workloads.skeleton_of``: the same layers in the same order, every width 4, vocabularies 16, the
same batch size and sequence length), timed in the same interleaved rounds as the full-size workload. What
it holds: the engine's Python (gates, bookkeeping, checks, accountant), the extra torch dispatches (per-layer
norms and sums on tiny tensors, the noise calls), and the hooks' autograd nodes; arithmetic is negligible
there. ``--overhead-depths 2 10 50`` adds the same difference on N x Linear(4, 4) at batch 8: the fixed cost
against depth (per layer and per step). Opacus rows get no overhead (and Opacus 1.6 cannot run the GPT-2
decoder: its tied embeddings in ghost mode, its position embeddings shared by the batch in hooks mode; those
rows are left out with a notice).

Peak memory: peak RSS growth of a steady-state step, one fresh process per variant
(``workloads.peak_memory_increase``).

Profile (``--profile``): for our variants, the median time per step spent in each phase (forward,
backward, per-layer norms, clip bookkeeping, weighted sums, noise draw, noise add, update, the step
contract's Python, ...), measured around the functions that do each phase (exclusive times: a phase's
time excludes the phases nested in it), on the main thread's CPU time with 1 torch thread and wall time
otherwise (``--profile-clock``). The instrumentation itself costs a few microseconds per wrapped call;
the "step total" row is the instrumented step.

Goals (issue 13, ratios to plain side by side): ghost <= 1.15x on the MLP and the Transformer,
<= 1.25x on the CNN, at 1 and 2 threads; peak memory <= 1.2x; ghost-bandmf4 <= 1.05x ghost;
hooks <= 0.25x opacus-hooks on the MLP, <= 1x on the others.

Run:  python benchmarks/bench_dp_step.py [--quick] [--threads 1 2] [--runs 3] [--profile] [--no-memory]
      [--workloads hf-decoder mlp] [--batch-sizes 8 64 256] [--overhead-depths 2 10 50] [--no-overhead]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

# Opacus installs a top-level package named `benchmarks`: import the sibling modules directly.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch
from workloads import (
    ALL_WORKLOADS,
    CPU,
    Workload,
    deep_mlp_skeleton,
    get_workload,
    peak_memory_increase,
    peak_mib_in_children,
    reference_matmul_ms,
    render_table,
    runnable_variants,
    skeleton_of,
    time_interleaved,
    training_step,
    versions,
)

import grad_samplers.registry as sampler_registry
import privacy_engine.clipping.ghost.attention as ghost_clipping_module
import privacy_engine.clipping.ghost.batched as ghost_batched
from accountants import RDPAccountant
from privacy_engine import GradSampleModule, connect_private
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.noise import BandMFNoise, GaussianNoise
from privacy_engine.noise.strategy import optimize_banded_toeplitz
from privacy_engine.training.optimizer import DPOptimizer

LEARNING_RATE = 0.05
NOISE_MULTIPLIER = 1.0
MAX_GRAD_NORM = 1.0
BANDMF_BANDS = 4
BANDMF_STEPS = 1000  # the horizon the BandMF coefficients are optimised for
SAMPLE_RATE = 0.01  # recorded with each step (the accountant's bookkeeping only)
VARIANTS = ("plain", "ghost", "ghost-bandmf4", "hooks", "opacus-hooks", "opacus-ghost")
OURS = ("ghost", "ghost-bandmf4", "hooks")

try:
    import opacus
except ImportError:  # our rows still run without Opacus
    opacus = None


@dataclass
class Built:
    """One variant's step and the objects the profiler instruments."""

    step: Callable[[], None]
    model: torch.nn.Module
    wrapped: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    parts: dict = field(default_factory=dict)


def build(
    workload: Workload, variant: str, *, seed: int = 0, loss_fn: Callable | None = None, device: torch.device = CPU
) -> Built:
    """``variant``'s training step on a fixed batch of ``workload`` (``loss_fn`` replaces the loss, for
    profiling), model and batch on ``device``."""
    torch.manual_seed(seed)
    model = workload.build_model().to(device)
    inputs, targets = (t.to(device) for t in workload.make_batch(workload.batch_size, torch.Generator().manual_seed(seed)))
    loss_fn = loss_fn or workload.loss
    sgd = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)

    if variant == "plain":
        return Built(step=training_step(model, sgd, loss_fn, (inputs,), targets), model=model, optimizer=sgd)

    if variant in OURS:
        if variant == "ghost-bandmf4":
            noise = BandMFNoise(optimize_banded_toeplitz(BANDMF_STEPS, BANDMF_BANDS), seed=seed)
        else:
            noise = GaussianNoise(seed=seed)
        optimizer = DPOptimizer(
            sgd,
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM,
            expected_batch_size=workload.batch_size,
            noise=noise,
            accountant=RDPAccountant(),
            sample_rate=SAMPLE_RATE,
        )
        if variant == "hooks":
            wrapped = GradSampleModule(model)
        else:
            wrapped = GhostClippingModule(model, clipper=optimizer.clipper)
        connect_private(wrapped, optimizer)
        step = training_step(wrapped, optimizer, loss_fn, (inputs,), targets)
        return Built(step=step, model=model, wrapped=wrapped, optimizer=optimizer)

    if variant in ("opacus-hooks", "opacus-ghost"):
        if opacus is None:
            raise RuntimeError("opacus is not installed")
        from bench_fast_clipping import make_step as opacus_step  # the same Opacus set-up as that benchmark

        return Built(step=opacus_step(workload, variant, seed=seed, device=device), model=model)

    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


# ---------------------------------------------------------------------------------- profile
class PhaseTimer:
    """Exclusive time per phase: each timed call's duration minus the timed calls nested in it.

    ``clock``: ``time.process_time`` (CPU time of the whole process, every thread: on a machine shared
    with other jobs it counts the work done, not the waiting; the default) or ``time.perf_counter``.
    """

    def __init__(self, clock: Callable[[], float] = time.process_time) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self._stack: list[list] = []  # [phase, start, time of nested timed calls]

    def wrap(self, phase: str, function: Callable) -> Callable:
        @functools.wraps(function)
        def timed(*args, **kwargs):
            frame = [phase, self.clock(), 0.0]
            self._stack.append(frame)
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = self.clock() - frame[1]
                self._stack.pop()
                self.seconds[phase] += elapsed - frame[2]
                if self._stack:
                    self._stack[-1][2] += elapsed

        return timed

    def patch(self, owner: object, name: str, phase: str) -> None:
        """Replace ``owner.name`` (looked up now, bound if a method) by its timed version."""
        setattr(owner, name, self.wrap(phase, getattr(owner, name)))


# Phases in the order a step runs them; the profile table prints them in this order.
PHASES = (
    "forward (model)",
    "step contract: forward",
    "loss",
    "backward (autograd)",
    "per-sample grads",
    "per-layer norms",
    "gate bookkeeping (per layer)",
    "clip factors + bookkeeping",
    "weighted sums",
    "clip (materialised)",
    "step contract: pre_step checks",
    "write .grad (clipper.pre_step)",
    "noise: validation + state",
    "noise: draw (or take the prefetched one)",
    "noise: BandMF form",
    "noise: add",
    "divide by batch size",
    "accountant",
    "optimizer update",
    "zero_grad",
    "other (unattributed)",
)


def profile_variant(
    workload: Workload, variant: str, *, steps: int, warmup: int, clock: Callable[[], float] = time.process_time
) -> dict[str, float]:
    """Median milliseconds per step in each phase of ``variant`` (see ``PHASES``), on ``clock``."""
    timer = PhaseTimer(clock)
    tables = (
        (sampler_registry.GRAD_SAMPLERS, "per-sample grads"),
        (sampler_registry.NORM_SAMPLERS, "per-layer norms"),
        (sampler_registry.WEIGHTED_SUM_SAMPLERS, "weighted sums"),
    )
    sampler_registry.load_plugins()
    saved_tables = [dict(table) for table, _ in tables]
    saved_linear = (ghost_clipping_module.linear_squared_norms, ghost_clipping_module.linear_weighted_sums)
    try:
        # Samplers are looked up when the wrapper is built: patch the tables first.
        for table, phase in tables:
            for layer_type, function in list(table.items()):
                table[layer_type] = timer.wrap(phase, function)
        ghost_clipping_module.linear_squared_norms = timer.wrap("per-layer norms", saved_linear[0])
        ghost_clipping_module.linear_weighted_sums = timer.wrap("weighted sums", saved_linear[1])
        built = build(workload, variant, loss_fn=timer.wrap("loss", workload.loss))
        # Fast clipping looks a layer's norm and weighted-sum samplers up at its first training forward
        # (``GatedLayers._gate_samplers``): take one step while the tables hold the timed samplers, or their
        # time would land in "gate bookkeeping" and "clip factors".
        built.step()
    finally:
        for (table, _), saved in zip(tables, saved_tables):
            table.clear()
            table.update(saved)
        ghost_clipping_module.linear_squared_norms, ghost_clipping_module.linear_weighted_sums = saved_linear

    original_backward = torch.Tensor.backward
    timed_backward = timer.wrap("backward (autograd)", original_backward)
    if built.wrapped is not None:
        wrapped, optimizer = built.wrapped, built.optimizer
        timer.patch(wrapped, "forward", "forward (model)")
        timer.patch(wrapped, "_before_bound_forward", "step contract: forward")
        timer.patch(wrapped, "_after_bound_forward", "step contract: forward")
        if isinstance(wrapped, GhostClippingModule):
            timer.patch(wrapped, "_on_output_grad", "gate bookkeeping (per layer)")
            timer.patch(wrapped, "_finish_pass", "clip factors + bookkeeping")
        clipper = optimizer.clipper
        timer.patch(clipper, "clip_and_accumulate", "clip (materialised)")
        timer.patch(clipper, "pre_step", "write .grad (clipper.pre_step)")
        noise = optimizer.noise
        timer.patch(noise, "add_noise_", "noise: validation + state")
        timer.patch(noise, "_fill_standard_noise", "noise: draw (or take the prefetched one)")
        timer.patch(noise, "_form_noise", "noise: BandMF form")
        timer.patch(noise, "_add_to_tensors", "noise: add")
        timer.patch(optimizer, "pre_step", "step contract: pre_step checks")
        timer.patch(optimizer.accountant, "step", "accountant")
        timer.patch(optimizer.original_optimizer, "step", "optimizer update")
        timer.patch(optimizer, "zero_grad", "zero_grad")
    else:
        model, optimizer = built.model, built.optimizer
        timer.patch(model, "forward", "forward (model)")
        timer.patch(optimizer, "step", "optimizer update")
        timer.patch(optimizer, "zero_grad", "zero_grad")
    original_foreach_div = torch._foreach_div_
    # Rank-one linear calls are done at the end of the pass, across layers (clipping.ghost.batched).
    stack_forms = (ghost_batched._Stack.squared_norms, ghost_batched._Stack.weighted_sums)
    total = timer.wrap("other (unattributed)", built.step)
    try:
        torch.Tensor.backward = timed_backward
        torch._foreach_div_ = timer.wrap("divide by batch size", original_foreach_div)
        ghost_batched._Stack.squared_norms = timer.wrap("per-layer norms", stack_forms[0])
        ghost_batched._Stack.weighted_sums = timer.wrap("weighted sums", stack_forms[1])
        for _ in range(warmup):
            total()
        per_step: list[dict[str, float]] = []
        for _ in range(steps):
            timer.seconds.clear()
            start = clock()
            total()
            per_step.append({**timer.seconds, "step total": clock() - start})
    finally:
        torch.Tensor.backward = original_backward
        torch._foreach_div_ = original_foreach_div
        ghost_batched._Stack.squared_norms, ghost_batched._Stack.weighted_sums = stack_forms
    # Medians per phase: robust to the bursts of load a shared machine puts on single steps.
    return {
        phase: 1000.0 * statistics.median(step.get(phase, 0.0) for step in per_step)
        for phase in (*PHASES, "step total")
    }


def op_profile(workload: Workload, variant: str, *, steps: int, rows: int) -> str:
    """torch.profiler's table of the ops taking the most CPU time (self time) in ``variant``'s step."""
    built = build(workload, variant)
    for _ in range(3):
        built.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            built.step()
    return profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


# ---------------------------------------------------------------------------------- tables
def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_time_table(rows: list[dict], variants: list[str]) -> str:
    header = ["workload", "threads", "variant", "wall ms", "x plain", "(runs min-max)", "CPU ms", "x plain",
              "main-thread CPU ms", "x plain", "python overhead ms", "peak MiB", "x plain"]  # fmt: skip
    lines = [header]
    for row in rows:
        plain_mib = row["mem_mib"].get("plain")
        for variant in variants:
            times = row["times"].get(variant)
            if times is None:
                continue
            mib = row["mem_mib"].get(variant)
            lines.append([
                row["workload"] if variant == variants[0] else "",
                str(row["threads"]) if variant == variants[0] else "",
                variant,
                _cell(times["wall_ms"], 1),
                _cell(times["wall_ratio"]),
                f"{times['wall_ratio_min']:.2f}-{times['wall_ratio_max']:.2f}",
                _cell(times["cpu_ms"], 1),
                _cell(times["cpu_ratio"]),
                _cell(times["thread_ms"], 1),
                _cell(times["thread_ratio"]),
                _cell(times.get("overhead_ms")),
                _cell(mib, 1),
                "-" if mib is None or not plain_mib else f"{mib / plain_mib:.2f}",
            ])  # fmt: skip
    return render_table(lines)


def format_profile_table(profiles: dict[str, dict[str, float]], plain_ms: float) -> str:
    names = list(profiles)
    lines = [["phase", *(f"{name} ms" for name in names), *(f"{name} % plain" for name in names)]]
    for phase in (*PHASES, "step total"):
        values = [profiles[name].get(phase, 0.0) for name in names]
        if phase != "step total" and all(v < 0.005 for v in values):
            continue
        lines.append([phase, *(f"{v:.2f}" for v in values), *(f"{100 * v / plain_ms:.1f}" for v in values)])
    return render_table(lines)


# ---------------------------------------------------------------------------------- main
def _memory_child(workload_key: str, variant: str, steps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")
    name, batch_size = workload_key.split("@")
    built = build(get_workload(name, int(batch_size)), variant)
    print(json.dumps({"peak_bytes": peak_memory_increase(built.step, steps=steps, warmup=2)}))


def _buildable_steps(workload: Workload, variants: list[str]) -> dict[str, Callable[[], None]]:
    """Each variant's step; an Opacus variant that cannot build or run ``workload`` is left out with a
    notice (Opacus 1.6 refuses GPT-2's tied embeddings in ghost mode and its position embeddings, shared by
    the batch, in hooks mode)."""
    steps = {}
    for variant in variants:
        try:
            steps[variant] = build(workload, variant).step
            if variant.startswith("opacus"):
                steps[variant]()
        except Exception as error:  # only Opacus's refusals are tolerated (re-raised otherwise)
            if not variant.startswith("opacus"):
                raise
            print(f"  {variant} left out on {workload.name}: {type(error).__name__}: {str(error)[:120]}", flush=True)
            steps.pop(variant, None)
    return steps


#: Variants timed on each workload's skeleton for the "python overhead" column (ours, against plain).
OVERHEAD_SUFFIX = "@skeleton"


def measure_times(
    workload: Workload, variants: list[str], *, runs: int, repeats: int, warmup: int, overhead: bool = True
) -> dict:
    """Medians over ``runs`` interleaved runs of each variant's times and ratios to plain; with
    ``overhead``, also each of our variants' *python overhead per step*: on the workload's skeleton (the
    same layers, widths 4: ``workloads.skeleton_of``), the variant's main-thread CPU ms minus plain's,
    timed in the same interleaved rounds (the fixed per-step cost the engine adds, arithmetic negligible)."""
    steps = _buildable_steps(workload, variants)
    if overhead:
        skeleton = skeleton_of(workload)
        for variant in ["plain", *(v for v in steps if v in OURS)]:
            steps[variant + OVERHEAD_SUFFIX] = build(skeleton, variant).step
    per_run = []
    for _ in range(runs):
        timings = time_interleaved(steps, repeats=repeats, warmup=warmup)
        per_run.append({v: (t.median_ms, t.median_cpu_ms, t.median_thread_cpu_ms) for v, t in timings.items()})
        warmup = 1  # later runs continue a warm process
    result = {}
    for variant in (v for v in variants if v in steps):
        wall = [run[variant][0] for run in per_run]
        cpu = [run[variant][1] for run in per_run]
        wall_ratios = [run[variant][0] / run["plain"][0] for run in per_run]
        cpu_ratios = [run[variant][1] / run["plain"][1] for run in per_run]
        thread = [run[variant][2] for run in per_run]
        thread_ratios = [run[variant][2] / run["plain"][2] for run in per_run]
        result[variant] = {
            "wall_ms": statistics.median(wall),
            "cpu_ms": statistics.median(cpu),
            "wall_ratio": statistics.median(wall_ratios),
            "wall_ratio_min": min(wall_ratios),
            "wall_ratio_max": max(wall_ratios),
            "cpu_ratio": statistics.median(cpu_ratios),
            "thread_ms": statistics.median(thread),
            "thread_ratio": statistics.median(thread_ratios),
            "per_run_wall_ms": wall,
            "overhead_ms": None,
        }
        skeleton_variant = variant + OVERHEAD_SUFFIX
        if overhead and skeleton_variant in steps and variant != "plain":
            plain_skeleton = "plain" + OVERHEAD_SUFFIX
            result[variant]["overhead_ms"] = statistics.median(
                run[skeleton_variant][2] - run[plain_skeleton][2] for run in per_run
            )
            result[variant]["skeleton_ms"] = statistics.median(run[skeleton_variant][2] for run in per_run)
    return result


def measure_overhead_by_depth(depths: list[int], batch_size: int, *, runs: int, repeats: int, warmup: int) -> list:
    """Per depth: the median over runs of (variant - plain) main-thread CPU ms per step on
    ``depth`` x Linear(4, 4) (``workloads.deep_mlp_skeleton``), our variants interleaved with plain."""
    rows = []
    for depth in depths:
        workload = deep_mlp_skeleton(depth, batch_size)
        steps = {variant: build(workload, variant).step for variant in ("plain", *OURS)}
        per_run = []
        for _ in range(runs):
            timings = time_interleaved(steps, repeats=repeats, warmup=warmup)
            per_run.append({v: t.median_thread_cpu_ms for v, t in timings.items()})
        row = {"depth": depth, "batch": batch_size, "plain_ms": statistics.median(r["plain"] for r in per_run)}
        for variant in OURS:
            row[variant] = statistics.median(r[variant] - r["plain"] for r in per_run)
        rows.append(row)
        print(f"  done depth {depth}: " + ", ".join(f"{v} +{row[v]:.2f} ms" for v in OURS), flush=True)
    return rows


def format_depth_table(rows: list[dict]) -> str:
    lines = [["layers", "batch", "plain ms", *(f"{v} - plain ms" for v in OURS), *(f"{v} per layer ms" for v in OURS)]]
    for row in rows:
        lines.append([str(row["depth"]), str(row["batch"]), _cell(row["plain_ms"]),
                      *(_cell(row[v]) for v in OURS), *(_cell(row[v] / row["depth"], 3) for v in OURS)])  # fmt: skip
    return render_table(lines)


def print_profile(
    workload: Workload, variants: list[str], *, threads: int, clock_name: str, quick: bool
) -> dict[str, dict[str, float]]:
    """Profile plain and our variants among ``variants`` (``profile_variant``), print the table and
    return the profiles. ``clock_name`` "auto": the main thread's CPU time with 1 thread, else wall."""
    profile_steps = 15 if quick else 40
    ours = ["plain", *(v for v in variants if v in OURS)]
    if clock_name == "auto":
        clock_name = "thread" if threads == 1 else "wall"
    clock = {"thread": time.thread_time, "process": time.process_time, "wall": time.perf_counter}[clock_name]
    profiles = {v: profile_variant(workload, v, steps=profile_steps, warmup=3, clock=clock) for v in ours}
    print(f"\nprofile: {workload.description}, {threads} thread(s), median {clock_name} ms per step "
          f"over {profile_steps} steps (exclusive times; the medians need not add up to the total)")  # fmt: skip
    print(format_profile_table(profiles, profiles["plain"]["step total"]), flush=True)
    return profiles


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (a smoke run; numbers are noisy)")
    parser.add_argument("--workloads", nargs="+", default=list(ALL_WORKLOADS), choices=list(ALL_WORKLOADS))
    parser.add_argument(
        "--batch-sizes",
        nargs="+",
        type=int,
        default=None,
        metavar="B",
        help="run each workload at these batch sizes (default: its own; e.g. 8 64 256)",
    )
    parser.add_argument(
        "--no-overhead", action="store_true", help="skip the skeleton steps behind the 'python overhead ms' column"
    )
    parser.add_argument(
        "--overhead-depths",
        nargs="*",
        type=int,
        default=None,
        metavar="LAYERS",
        help="also the fixed cost against depth: N x Linear(4, 4) at batch 8 (e.g. 2 10 50)",
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="torch thread counts (default 1 2)")
    parser.add_argument("--runs", type=int, default=None, help="independent interleaved runs (default 3, quick 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per run (default 15, quick 5)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-variant memory processes")
    parser.add_argument("--profile", action="store_true", help="also print the per-phase profile of our variants")
    parser.add_argument("--profile-only", action="store_true", help="only the profile (no timing runs, no memory)")
    parser.add_argument("--profile-clock", choices=("auto", "thread", "process", "wall"), default="auto",
                        help="profile on the main thread's CPU time, the process's CPU time or wall time "
                             "(auto: thread with 1 torch thread, else wall)")  # fmt: skip
    parser.add_argument("--op-profile", type=int, default=0, metavar="ROWS",
                        help="also print torch.profiler's top ROWS ops of plain and ghost")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="also write the raw numbers as JSON")
    parser.add_argument("--memory-child", nargs=3, metavar=("WORKLOAD", "VARIANT", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    memory_steps = 2 if args.quick else 3
    if args.memory_child:
        name, variant, threads = args.memory_child
        _memory_child(name, variant, memory_steps, int(threads))
        return

    warnings.simplefilter("ignore")  # Opacus's notices (secure RNG, full backward hooks)
    runs = args.runs or (1 if args.quick else 3)
    repeats = args.repeats or (5 if args.quick else 15)
    warmup = 2 if args.quick else 3
    variants = runnable_variants(args.variants, opacus_installed=opacus is not None)
    print(
        versions(opacus)
        + f"; {runs} run(s) x {repeats} interleaved rounds (medians over runs of per-run medians); load average "
        + ", ".join(f"{load:.1f}" for load in os.getloadavg())
        + f"; 1024^3 matmul {reference_matmul_ms():.1f} ms",
        flush=True,
    )
    rows, profiles_out = [], {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, batch_size in ((n, b) for n in args.workloads for b in (args.batch_sizes or [None])):
            workload = get_workload(name, batch_size)
            if args.profile_only:
                args.profile, args.no_memory = True, True
            else:
                times = measure_times(
                    workload, variants, runs=runs, repeats=repeats, warmup=warmup, overhead=not args.no_overhead
                )
            memory: dict[str, float] = {}
            if not args.no_memory:
                after = [str(threads)] + (["--quick"] if args.quick else [])
                child = [os.path.abspath(__file__), "--memory-child", f"{name}@{workload.batch_size}"]
                memory = peak_mib_in_children([v for v in variants if v in times], child, after)
            if not args.profile_only:
                rows.append({"workload": workload.description, "threads": threads, "times": times, "mem_mib": memory})
                print(f"  done {name} @ {threads} thread(s): "
                      + ", ".join(f"{v} {t['wall_ms']:.1f} ms ({t['wall_ratio']:.2f}x)" for v, t in times.items()),
                      flush=True)  # fmt: skip
            if args.profile:
                profiles_out[f"{name}@{threads}"] = print_profile(
                    workload, variants, threads=threads, clock_name=args.profile_clock, quick=args.quick
                )
            if args.op_profile:
                for variant in ("plain", "ghost"):
                    print(f"\ntorch.profiler, {name}, {variant}, {threads} thread(s):")
                    print(op_profile(workload, variant, steps=10, rows=args.op_profile), flush=True)
    depth_rows = []
    if args.overhead_depths:
        for threads in args.threads:
            torch.set_num_threads(threads)
            print(f"\nfixed cost against depth, {threads} thread(s)", flush=True)
            by_depth = measure_overhead_by_depth(args.overhead_depths, 8, runs=runs, repeats=repeats, warmup=warmup)
            depth_rows += [{**row, "threads": threads} for row in by_depth]
            print(format_depth_table(by_depth))
            print("main-thread CPU ms per step, variant minus plain, median over runs of per-run medians")
    if rows:
        print()
        print(format_time_table(rows, variants))
        print()
        print(
            f"C={MAX_GRAD_NORM}, sigma={NOISE_MULTIPLIER}, SGD lr={LEARNING_RATE}, BandMF b={BANDMF_BANDS}. Every "
            f"private row draws and adds its noise. Ratios: median over runs of each run's median / plain's median in "
            f"that run (min-max over runs). Python overhead: on the workload's skeleton (same layers, widths 4, "
            f"same batch), the variant's main-thread CPU ms per step minus plain's, in the same interleaved rounds. "
            f"Peak MiB: peak RSS growth of a steady-state step in a fresh process."
        )
    # The machine check of bench_grad_sample.py: the same matmul after the runs (and the load): if it moved
    # much from the first reading, the machine's speed changed during the run and its numbers are suspect.
    print(f"machine check after the runs: 1024^3 matmul {reference_matmul_ms():.1f} ms; load average "
          + ", ".join(f"{load:.1f}" for load in os.getloadavg()), flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "profiles": profiles_out, "depth_rows": depth_rows}, out, indent=2)


if __name__ == "__main__":
    main()
