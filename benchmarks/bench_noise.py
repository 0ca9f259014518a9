"""Time per noise step: BandMFNoise against the cheapest possible streaming baseline.

Baseline per step: one ``torch.randn`` over all parameters plus ``b - 1`` multiply-adds of the
stored history into it (what any streaming BandMF must at least do). BandMFNoise additionally
writes the ring-buffer slot and adds the noise into the parameter tensors. Target: ratio <= 1.2.

    python benchmarks/bench_noise.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from privacy_engine.noise import BandMFNoise

# A model's parameters are many tensors of mixed sizes; split the total the same way.
TENSOR_FRACTIONS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01, 0.005, 0.003, 0.002]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_seconds(steps, device: torch.device, repeats: int, warmup: int = 2) -> list[list[float]]:
    """Seconds per call of each step function, measured in alternation so that both see the
    same load on a shared machine."""
    for step in steps:
        for _ in range(warmup):
            step()
    synchronize(device)
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for step, record in zip(steps, times):
            start = time.perf_counter()
            step()
            synchronize(device)
            record.append(time.perf_counter() - start)
    return times


def parameter_tensors(total: int, device: torch.device) -> list[torch.Tensor]:
    sizes = [int(total * fraction) for fraction in TENSOR_FRACTIONS]
    sizes[0] += total - sum(sizes)
    return [torch.zeros(size, device=device) for size in sizes]


def bandmf_step(total: int, bands: int, device: torch.device):
    coefficients = [1.0] + [0.5 / lag for lag in range(1, bands)]
    mechanism = BandMFNoise(coefficients, seed=0)
    tensors = parameter_tensors(total, device)
    return lambda: mechanism.add_noise_(tensors, 1.0, 1.0)


def baseline_step(total: int, bands: int, device: torch.device):
    generator = torch.Generator(device=device).manual_seed(0)
    history = [torch.randn(total, device=device) for _ in range(bands - 1)]
    weights = [0.5 / lag for lag in range(1, bands)]

    def step() -> None:
        noise = torch.randn(total, generator=generator, device=device)
        for weight, past in zip(weights, history):
            noise.add_(past, alpha=-weight)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M parameters only, fewer repeats")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = [1_000_000] if args.quick else [1_000_000, 10_000_000]
    band_counts = [1, 4, 16, 64]
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    gpu = f"GPU: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no GPU"
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {gpu}, load average {load}")
    # ratio: median over repeats of (BandMF time / baseline time measured right after it).
    header = (
        f"{'device':<7} {'params':>8} {'bands':>5} {'BandMF ms':>10} {'baseline ms':>12} "
        f"{'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for device in devices:
        for total in sizes:
            repeats = 7 if args.quick or total >= 10_000_000 else 21
            if device.type == "cuda":
                repeats *= 4
            for bands in band_counts:
                ours, baseline = interleaved_seconds(
                    [bandmf_step(total, bands, device), baseline_step(total, bands, device)],
                    device,
                    repeats,
                )
                ratio = statistics.median(a / b for a, b in zip(ours, baseline))
                print(
                    f"{device.type:<7} {total / 1e6:>7.0f}M {bands:>5} "
                    f"{statistics.median(ours) * 1e3:>10.2f} "
                    f"{statistics.median(baseline) * 1e3:>12.2f} {ratio:>6.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
