"""The DP step and the noise on a CUDA GPU: ours against Opacus and a non-private step, one process.

Step table: the MLP, CNN and Transformer workloads of ``workloads.py`` and GPT-2 small (124M parameters,
sequence 128, batch 16), each variant of ``bench_dp_step.py`` (plain, ghost, ghost-bandmf4, hooks,
opacus-hooks, opacus-ghost) with model and batch on the GPU, timed round-robin in one process
(``workloads.time_interleaved``, device synchronised around each timed step). Columns: median ms per step,
ratio to plain, and the peak GPU memory a steady-state step allocates above what is held between steps
(``torch.cuda.max_memory_allocated`` growth, ``workloads.peak_memory_increase``) with its ratio to plain.
An Opacus variant that cannot run a model (Opacus 1.6 refuses GPT-2's tied embeddings in ghost mode and
its position embeddings in hooks mode) is left out with a notice.

Noise table: one step of Gaussian noise (``GaussianNoise.add_noise_`` over the parameter tensors, sigma
1) and of BandMF noise (4 and 16 bands) on the GPU against the floor of one ``torch.randn(out=...)`` of the
same size (Gaussian) or that draw plus the b - 1 multiply-adds of the history (BandMF), 10M to 100M
parameters, interleaved; ratio = median over rounds of (ours / floor).

Run:  python benchmarks/bench_gpu.py [--quick] [--workloads mlp cnn transformer gpt2-small] [--no-noise] [--no-steps]
      python benchmarks/bench_gpu.py --diagnose --workloads mlp transformer   # syncs, op and kernel counts
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch
from bench_dp_step import VARIANTS, build, opacus
from workloads import get_workload, gpt2_small, peak_memory_increase, render_table, synchronize, time_interleaved

from privacy_engine.noise import BandMFNoise, GaussianNoise
from privacy_engine.noise.strategy import optimize_banded_toeplitz

GPU_WORKLOADS = ("mlp", "cnn", "transformer", "gpt2-small")


def workload_named(name: str):
    return gpt2_small() if name == "gpt2-small" else get_workload(name)


def step_rows(name: str, device: torch.device, *, repeats: int, warmup: int) -> list[list[str]]:
    """One table row per variant of workload ``name``: ms, ratio, peak MiB, ratio."""
    workload = workload_named(name)
    steps = {}
    for variant in VARIANTS:
        if variant.startswith("opacus") and opacus is None:
            continue
        try:
            steps[variant] = build(workload, variant, device=device).step
            steps[variant]()
        except Exception as error:  # Opacus's refusals only
            if not variant.startswith("opacus"):
                raise
            print(f"  {variant} left out on {name}: {type(error).__name__}: {str(error)[:120]}", flush=True)
            steps.pop(variant, None)
            torch.cuda.empty_cache()
    timings = time_interleaved(steps, repeats=repeats, warmup=warmup, device=device)
    peaks = {variant: peak_memory_increase(step, steps=2, warmup=1, device=device) / 2**20 for variant, step in steps.items()}
    plain_ms, plain_mib = timings["plain"].median_ms, peaks["plain"]
    rows = []
    for variant, timing in timings.items():
        rows.append([
            workload.description if variant == "plain" else "", variant, f"{timing.median_ms:.2f}",
            f"{timing.median_ms / plain_ms:.2f}", f"{peaks[variant]:.0f}", f"{peaks[variant] / plain_mib:.2f}" if plain_mib > 0 else "-",
        ])  # fmt: skip
    del steps
    torch.cuda.empty_cache()
    return rows


def _paired_ms(steps: list, device: torch.device, repeats: int) -> list[list[float]]:
    """Per round, each step's seconds, the steps run one after another in every round."""
    for _ in range(3):
        for step in steps:
            step()
    rounds = []
    for _ in range(repeats):
        times = []
        for step in steps:
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            times.append(time.perf_counter() - start)
        rounds.append(times)
    return rounds


def noise_rows(device: torch.device, sizes: list[int], *, repeats: int) -> list[list[str]]:
    """Gaussian and BandMF noise per step against two floors: ``torch.randn(out=)`` alone, and that draw
    added into a gradient-sized tensor (the least any mechanism must do); BandMF's floors add the b - 1
    multiply-adds of its history."""
    rows = []
    for total in sizes:
        tensors = [torch.zeros(total // 2, device=device), torch.zeros(total - total // 2, device=device)]
        floor_out, target = torch.empty(total, device=device), torch.zeros(total, device=device)
        generator = torch.Generator(device=device).manual_seed(0)
        gaussian = GaussianNoise(seed=0)
        variants = {"gaussian": (lambda: gaussian.add_noise_(tensors, 1.0, 1.0), 1)}
        for bands in (4, 16):
            mechanism = BandMFNoise(optimize_banded_toeplitz(1000, bands), seed=0)
            variants[f"bandmf b={bands}"] = (lambda mechanism=mechanism: mechanism.add_noise_(tensors, 1.0, 1.0), bands)
        for label, (ours, bands) in variants.items():
            history = [torch.randn(total, device=device) for _ in range(bands - 1)]

            def draw(history=history) -> None:
                torch.randn(total, out=floor_out, generator=generator)
                for row in history:
                    floor_out.add_(row, alpha=0.5)

            def draw_and_add() -> None:
                draw()
                target.add_(floor_out)

            rounds = _paired_ms([ours, draw, draw_and_add], device, repeats)
            ms = [1e3 * statistics.median(r[k] for r in rounds) for k in range(3)]
            ratios = [statistics.median(r[0] / r[k] for r in rounds) for k in (1, 2)]
            rows.append([f"{total / 1e6:.0f}M", label, *(f"{v:.3f}" for v in ms), *(f"{v:.2f}" for v in ratios)])
            del history
        del tensors, floor_out, target
        torch.cuda.empty_cache()
    return rows


def diagnose(name: str, device: torch.device, variants=("plain", "ghost", "hooks")) -> None:
    """For one step of each variant: the host-device synchronisations (file:line, from
    ``torch.cuda.set_sync_debug_mode("warn")``), the number of top-level aten ops and of CUDA kernels, and
    the ops taking the most CPU time (the launch-bound part of a small model's step)."""
    workload = workload_named(name)
    for variant in variants:
        step = build(workload, variant, device=device).step
        for _ in range(3):
            step()
        synchronize(device)
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            synchronize(device)
        torch.cuda.set_sync_debug_mode("default")
        syncs: dict[str, int] = {}
        for warning in caught:
            if "synchroniz" in str(warning.message):
                where = f"{os.path.relpath(warning.filename)}:{warning.lineno}"
                syncs[where] = syncs.get(where, 0) + 1
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profiler:
            step()
            synchronize(device)
        events = list(profiler.events())
        aten = [e for e in events if e.name.startswith("aten::")]
        top = [e for e in aten if not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"{name} {variant}: {len(top)} top-level aten ops, {len(kernels)} CUDA kernels/copies, "
              f"{sum(syncs.values())} syncs {syncs}", flush=True)  # fmt: skip
        if variant != "plain":
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
        del step
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="*", default=list(GPU_WORKLOADS), choices=list(GPU_WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="fewer repeats, noise at 10M only")
    parser.add_argument("--no-noise", action="store_true", help="leave the noise table out")
    parser.add_argument("--no-steps", action="store_true", help="leave the step table out")
    parser.add_argument(
        "--diagnose", action="store_true",
        help="instead: per variant, the host-device syncs, op and kernel counts and the costliest ops of one step",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device (torch.cuda.is_available() is False)")
    warnings.simplefilter("ignore")
    device = torch.device("cuda")
    properties = torch.cuda.get_device_properties(device)
    opacus_text = f"opacus {opacus.__version__}" if opacus is not None else "opacus not installed"
    print(f"{properties.name}, {properties.total_memory / 2**30:.0f} GiB; torch {torch.__version__}; {opacus_text}")
    if args.diagnose:
        for name in args.workloads:
            diagnose(name, device)
        return
    repeats, warmup = (5, 2) if args.quick else (15, 3)
    if not args.no_steps:
        rows = [["workload", "variant", "ms/step", "x plain", "peak MiB", "x plain"]]
        for name in args.workloads:
            rows += step_rows(name, device, repeats=repeats, warmup=warmup)
            print(f"  {name} done", flush=True)
        print(render_table(rows), flush=True)
    if not args.no_noise:
        sizes = [10_000_000] if args.quick else [10_000_000, 30_000_000, 100_000_000]
        noise = [["params", "noise", "ours ms", "randn ms", "randn+add ms", "x randn", "x randn+add"]]
        noise += noise_rows(device, sizes, repeats=repeats * 2)
        print("floors: torch.randn(out=) of the same size; the same plus one add into a gradient-sized tensor")
        print("(BandMF's floors also do the b - 1 multiply-adds of its history)")
        print(render_table(noise), flush=True)


if __name__ == "__main__":
    main()
