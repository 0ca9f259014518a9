"""Time and memory per noise step: BLTNoise (d buffers) against BandMFNoise (b bands) and GaussianNoise.

Each row adds one step's noise to float32 parameter tensors of the given total size (split over ten
tensors of mixed sizes, as a model's are). Time: median seconds per ``add_noise_`` call, the mechanisms
measured in alternation so that they see the same load. Memory: the bytes of noise state the mechanism
holds between steps (this step's draw, BandMF's ``b - 1`` past rows or BLT's ``d`` buffers, and the
prefetch buffer when prefetching), read from its tensors. Prefetch is off (the same work on every row).

    python benchmarks/bench_blt_noise.py [--quick] [--threads N]

CPU at 10M parameters by default (``--quick``: 1M); a GPU, when there is one, also at 100M.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_noise import interleaved_seconds, parameter_tensors  # the same tensors and timing as bench_noise.py

from privacy_engine.noise import BandMFNoise, BLTNoise, BLTStrategy, GaussianNoise

# A BLT of the shape the optimiser returns for a few thousand steps (decays near 1, small output scales).
BLT_PARAMETERS = {
    2: ((0.999, 0.9), (0.25, 0.25)),
    4: ((0.9997, 0.99, 0.95, 0.6), (0.07, 0.09, 0.17, 0.17)),
    6: ((0.9998, 0.998, 0.99, 0.95, 0.8, 0.4), (0.04, 0.05, 0.08, 0.1, 0.1, 0.1)),
}


def state_bytes(mechanism) -> int:
    total = 0
    for group in mechanism._groups:
        for tensor in (group.noise, group.history, group.next_noise, group.secure_scratch, group.next_scratch):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


def mechanisms(total_steps: int) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = [("gaussian", GaussianNoise(seed=0, prefetch=False))]
    for bands in (4, 16, 64):
        coefficients = [1.0] + [0.5 / lag for lag in range(1, bands)]
        rows.append((f"bandmf b={bands}", BandMFNoise(coefficients, seed=0, prefetch=False)))
    for buffers, (decay, scale) in BLT_PARAMETERS.items():
        strategy = BLTStrategy(buf_decay=decay, output_scale=scale)
        rows.append(
            (f"blt d={buffers}", BLTNoise(strategy, min_sep=1, total_steps=total_steps, seed=0, prefetch=False))
        )
    return rows


def measure(total: int, device: torch.device, repeats: int) -> None:
    named = mechanisms(total_steps=1000)
    tensors = [parameter_tensors(total, device) for _ in named]
    steps = [lambda m=m, t=t: m.add_noise_(t, 1.0, 1.0) for (_, m), t in zip(named, tensors)]
    times = interleaved_seconds(steps, device, repeats)  # two warm-up calls each lay the noise out
    baseline = statistics.median(times[0])
    for (name, mechanism), record in zip(named, times):
        median = statistics.median(record)
        print(f"{device.type:<6} {total / 1e6:>6.0f}M  {name:<13} {median * 1e3:>9.1f} {median / baseline:>7.2f} "
              f"{state_bytes(mechanism) / 2**20:>10.0f}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M parameters, fewer repeats")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {gpu}, load average {load}")
    header = f"{'device':<6} {'params':>7}  {'mechanism':<13} {'ms/step':>9} {'x gauss':>7} {'state MiB':>10}"
    print(header)
    print("-" * len(header))
    measure(1_000_000 if args.quick else 10_000_000, torch.device("cpu"), 5 if args.quick else 9)
    if torch.cuda.is_available():
        measure(100_000_000, torch.device("cuda"), 20)


if __name__ == "__main__":
    main()
