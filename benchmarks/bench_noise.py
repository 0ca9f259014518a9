"""Time per noise step: BandMFNoise against the cheapest possible streaming baseline, and (``--streams``)
Gaussian noise on the serial and the counter-keyed stream against ``torch.randn(out=...)``.

Baseline per step: one ``torch.randn`` over all parameters plus ``b - 1`` multiply-adds of the
stored history into it (what any streaming BandMF must at least do). BandMFNoise additionally
writes the ring-buffer slot and adds the noise into the parameter tensors. Target: ratio <= 1.2.

``--streams``: one ``GaussianNoise.add_noise_(..., divide_by=B)`` step (draw, add into the parameter tensors
and divide by the expected batch size, as ``DPOptimizer`` does; no prefetch) on the serial stream
(``"mt19937"``) and on the counter stream (``"counter-v1"``), against ``torch.randn(out=...)`` of the same
size (the floor: torch's own serial draw), at 1M, 10M and 100M parameters (``--quick``: 1M, 10M), at 1 and
2 torch threads, all interleaved in each round (the thread count switched within the round); ratios are
medians over rounds of (time / 1-thread randn of the same round). The ``draw`` column is the counter
stream's draw alone (no add): the counter step's excess over it is the add into the tensors. ``ser/255``: the
serial step dividing by 255 instead of 256 (at one thread a power of two is divided by as a multiplication by
its exact reciprocal, the same bits; 255 shows the step for any other batch size). ``r+add``:
``torch.randn(out=)`` then one ``add_`` of it into a tensor of the same size. ``r+pass``: ``torch.randn(out=)``
then one pass of ``add_`` over a tensor of the same size from a small buffer that stays in cache (chunks of
``PASS_CHUNK_NUMEL``): the physical floor of a serial step built from torch ops on one thread, which must draw
(as ``randn`` does) and then read and write the gradients once (the division not counted); 1 thread only (``-``
at more: pieces over torch's grain size would time OpenMP teams, not memory).

    python benchmarks/bench_noise.py [--quick] [--streams]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from privacy_engine.noise import BandMFNoise, GaussianNoise
from privacy_engine.noise.counter_stream import STREAM_COUNTER, STREAM_MT, draw_counter_noise, stream_key

# A model's parameters are many tensors of mixed sizes; split the total the same way.
TENSOR_FRACTIONS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01, 0.005, 0.003, 0.002]
EXPECTED_BATCH_SIZE = 256.0  # --streams: the step divides by it, as DPOptimizer does (add_noise_'s divide_by)
ODD_BATCH_SIZE = 255.0  # --streams, ser/255: a divisor that is not a power of two
PASS_CHUNK_NUMEL = 1 << 18  # --streams, r+pass: the in-cache buffer's entries (2^14-2^18 measured: 2^18 least)
SETTLE_SECONDS = 0.03  # --streams: pause before each timed step (see stream_table)


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


def stream_steps(total: int) -> dict:
    """The ``--streams`` table's step functions for ``total`` parameters (CPU, float32): ``draw`` is the counter
    stream's draw alone (``draw_counter_noise`` into a buffer, no add), so ``counter - draw`` is what adding costs."""
    floor_out, floor_target = torch.empty(total), torch.zeros(total)
    floor_generator = torch.Generator().manual_seed(0)
    tensors = parameter_tensors(total, torch.device("cpu"))
    serial = GaussianNoise(seed=0, prefetch=False, noise_stream=STREAM_MT)
    serial_odd = GaussianNoise(seed=0, prefetch=False, noise_stream=STREAM_MT)
    pass_buffer = torch.randn(PASS_CHUNK_NUMEL)
    pass_slices = [(piece, pass_buffer[: piece.numel()]) for piece in floor_target.split(PASS_CHUNK_NUMEL)]
    counter = GaussianNoise(seed=0, prefetch=False, noise_stream=STREAM_COUNTER)
    draw_out, key = torch.empty(total), stream_key(0, 0)

    def floor_and_add() -> None:
        torch.randn(total, out=floor_out, generator=floor_generator)
        floor_target.add_(floor_out)

    def floor_and_pass() -> None:
        torch.randn(total, out=floor_out, generator=floor_generator)
        for piece, buffer in pass_slices:
            piece.add_(buffer)

    return {
        "randn": lambda: torch.randn(total, out=floor_out, generator=floor_generator),
        "serial": lambda: serial.add_noise_(tensors, 1.0, 1.0, divide_by=EXPECTED_BATCH_SIZE),
        "ser/255": lambda: serial_odd.add_noise_(tensors, 1.0, 1.0, divide_by=ODD_BATCH_SIZE),
        "counter": lambda: counter.add_noise_(tensors, 1.0, 1.0, divide_by=EXPECTED_BATCH_SIZE),
        "draw": lambda: draw_counter_noise(draw_out, None, [key], 0, 1.0),
        "r+add": floor_and_add,
        "r+pass": floor_and_pass,
    }


def stream_table(
    sizes: list[int], repeats: int, thread_counts: tuple[int, ...] = (1, 2), clock=time.perf_counter
) -> None:
    """Print the ``--streams`` table (see the module docstring). ``clock``: ``time.process_time`` counts the
    CPU time of all the process's threads (less sensitive to other jobs on a shared machine; at 2 threads
    it is the total work, not the wall time)."""
    widths = (9, 10, 10, 11, 8, 9, 10)  # randn, serial, ser/255, counter, draw, r+add, r+pass
    header = (
        f"{'params':>7} {'threads':>7} {'randn ms':>9} {'serial ms':>10} {'s/255 ms':>10} {'counter ms':>11} "
        f"{'draw ms':>8} {'r+add ms':>9} {'r+pass ms':>10} {'randn/r1':>9} {'serial/r1':>10} {'s/255/r1':>10} "
        f"{'counter/r1':>11} {'draw/r1':>8} {'r+add/r1':>9} {'r+pass/r1':>10} {'ctr/ser1':>9}"
    )
    print(header)
    print("-" * len(header))
    saved_threads = torch.get_num_threads()
    for total in sizes:
        steps = stream_steps(total)
        times = {(name, threads): [] for threads in thread_counts for name in steps}
        for round_index in range(repeats + 1):  # round 0 warms up
            for threads in thread_counts:
                torch.set_num_threads(threads)
                for name, step in steps.items():
                    # A step at 2 threads that opened torch's OpenMP team leaves its worker spinning for a few ms
                    # (libgomp's default wait policy): without the pause that spin is charged to the next step
                    # (its CPU time, or a core taken from it), e.g. to the 1-thread randn of the next round.
                    if name == "r+pass" and threads > 1:
                        continue  # a one-thread floor (see the module docstring)
                    time.sleep(SETTLE_SECONDS)
                    start = clock()
                    step()
                    if round_index:
                        times[name, threads].append(clock() - start)
        torch.set_num_threads(saved_threads)
        floor_1 = times["randn", thread_counts[0]]
        serial_1 = times["serial", thread_counts[0]]
        for threads in thread_counts:
            row = [times[name, threads] for name in steps]
            ratios = [
                statistics.median(a / b for a, b in zip(values, floor_1)) if values else math.nan for values in row
            ]
            # ctr/ser1: the counter step against the serial step at the first thread count, same round.
            ratios.append(statistics.median(a / b for a, b in zip(times["counter", threads], serial_1)))
            print(
                f"{total / 1e6:>6.0f}M {threads:>7} "
                + " ".join(f"{statistics.median(v) * 1e3 if v else math.nan:>{w}.2f}" for v, w in zip(row, widths))
                + " "
                + " ".join(f"{r:>{w}.3f}" for r, w in zip(ratios, (*widths, 9))),
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M parameters only, fewer repeats")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--streams", action="store_true",
        help="the serial/counter stream table against torch.randn(out=) at 1 and 2 threads instead",
    )  # fmt: skip
    parser.add_argument(
        "--cpu-time", action="store_true",
        help="with --streams: time by the process's CPU time, all threads (for a machine shared with other jobs)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.streams:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
        print(f"torch {torch.__version__}, CPU, load average {load} (before)")
        sizes = [1_000_000, 10_000_000] if args.quick else [1_000_000, 10_000_000, 100_000_000]
        if args.cpu_time:
            print("clock: CPU time of the process (all threads): at 2 threads the total work, not the wall time")
        stream_table(
            sizes, repeats=5 if args.quick else 7, clock=time.process_time if args.cpu_time else time.perf_counter
        )
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
        print(f"load average {load} (after)")
        return
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
    header = f"{'device':<7} {'params':>8} {'bands':>5} {'BandMF ms':>10} {'baseline ms':>12} {'ratio':>6}"
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
