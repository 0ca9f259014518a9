"""Per-example weight-gradient norms: the Gram form against the direct form, and which one the cost model picks.

Fast clipping needs each example's squared weight-gradient norm ``||G_i^T A_i||^2`` (``A_i``: the
example's ``L x D`` inputs or patches, ``G_i``: its ``L x P`` output gradient). Two forms compute it:

=======  ============================================  ===========================================
form     computes                                      multiply-adds per example
=======  ============================================  ===========================================
gram     ``<A_i A_i^T, G_i G_i^T>``                    ``L^2 (D + P)`` (+ the patch copy, conv)
direct   ``G_i^T A_i`` formed, squared, summed         ``L D P``
=======  ============================================  ===========================================

This script times both on a grid of shapes (convolutions: channels, image size, kernel, batch;
linear layers: sequence length, width, batch), prints how the cost grows along each axis, which form
the FLOP rule picks (``grad_samplers.conv.gram_is_cheaper``, ``grad_samplers.linear.linear_weight_norm_form``)
and which one was measured faster, how much time a wrong pick costs and, for convolutions, the peak
memory each form needs (peak RSS growth of one call). ``--fit`` prints least-squares times per
multiply-add of each form (a linear cost model; the direct convolution's time per multiply-add varies
several-fold with the shape, so the fit is rough).

Times are the least of ``repeats`` interleaved calls, in the process's CPU time (1 thread by default: on a
shared machine CPU time is the work done, not the waiting, and the least is the least disturbed call).

Run:  python benchmarks/bench_norm_forms.py [--quick] [--threads 1] [--fit]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import numpy as np
import torch
from torch import nn
from workloads import MEMORY_CHILD_ENV, peak_memory_increase, run_python_json

from grad_samplers import conv as conv_module
from grad_samplers import linear as linear_module


def peak_mib(function: Callable[[], object]) -> float:
    """Peak resident memory (MiB) one call needs above what the process held before it (see
    ``workloads.peak_memory_increase``; this process runs with ``MEMORY_CHILD_ENV`` so freed blocks leave)."""
    return peak_memory_increase(function, steps=1, warmup=1) / 2**20


def cpu_ms(functions: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The least CPU time of each function over ``repeats`` interleaved calls (the least disturbed run:
    both forms are fixed computations, and on a shared machine every disturbance only adds time)."""
    samples: dict[str, list[float]] = {name: [] for name in functions}
    for function in functions.values():
        function()
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.process_time()
            function()
            samples[name].append(time.process_time() - start)
    return {name: 1000.0 * min(values) for name, values in samples.items()}


# ---------------------------------------------------------------------------------- convolutions
# (batch, in channels, out channels, kernel, stride, padding, image size): the CNN workload's two convs,
# then one axis at a time around them.
CONV_SHAPES = [
    (256, 1, 16, 8, 2, 3, 28),
    (256, 16, 32, 4, 2, 0, 13),
    *((256, 16, 32, 4, 2, 0, size) for size in (7, 9, 17, 25)),
    *((256, 16, out, 4, 2, 0, 13) for out in (8, 64, 128)),
    *((256, channels, 32, 4, 2, 0, 13) for channels in (4, 64)),
    *((256, 16, 32, kernel, 1, 0, 9) for kernel in (2, 3, 5)),
    *((batch, 16, 32, 4, 2, 0, 13) for batch in (32, 64)),
    (64, 64, 64, 3, 1, 1, 8),
    (64, 128, 128, 3, 1, 1, 4),
    (64, 32, 32, 3, 1, 1, 16),
]


def conv_memory(shape: tuple) -> dict[str, float]:
    """Peak memory of each form (run in a child process with ``MEMORY_CHILD_ENV``)."""
    functions = _conv_functions(shape)
    return {"gram_mib": peak_mib(functions["gram"]), "direct_mib": peak_mib(functions["direct"])}


def _conv_functions(shape: tuple) -> dict:
    batch, in_channels, out_channels, kernel, stride, padding, size = shape
    generator = torch.Generator().manual_seed(0)
    layer = nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=padding)
    inputs = torch.randn(batch, in_channels, size, size, generator=generator)
    with torch.no_grad():
        out_size = layer(inputs[:1]).shape[-1]
    grads = torch.randn(batch, out_channels, out_size, out_size, generator=generator)

    def gram() -> torch.Tensor:
        padded, _ = conv_module._padded_input(layer, inputs, explicit=True)
        return conv_module.windowed_gram_squared_norms(layer, padded, grads)

    def direct() -> torch.Tensor:
        return conv_module._per_sample_weight_grads(layer, inputs, grads).flatten(1).square_().sum(dim=1)

    return {"gram": gram, "direct": direct, "positions": out_size * out_size}


def conv_forms(shape: tuple, repeats: int) -> dict:
    batch, in_channels, out_channels, kernel, stride, _, size = shape
    functions = _conv_functions(shape)
    gram, direct, positions = functions["gram"], functions["direct"], functions["positions"]
    patch = in_channels * kernel * kernel
    times = cpu_ms({"gram": gram, "direct": direct}, repeats)
    return {
        "shape": f"B{batch} {in_channels}->{out_channels} k{kernel} s{stride} {size}x{size} (L={positions})",
        "batch": batch,
        "L": positions,
        "D": patch,
        "P": out_channels,
        "gram_ms": times["gram"],
        "direct_ms": times["direct"],
        "model": "gram" if conv_module.gram_is_cheaper(positions, patch, out_channels) else "direct",
    }


# ---------------------------------------------------------------------------------- linear layers
# (batch, positions, in, out): the Transformer workload's projections, then one axis at a time.
LINEAR_SHAPES = [
    *((64, positions, 128, 384) for positions in (16, 32, 64, 128, 256)),
    *((64, 64, width, width) for width in (64, 256, 512)),
    *((batch, 64, 128, 384) for batch in (16, 256)),
    (16, 512, 768, 768),
    (16, 128, 768, 3072),
]


def linear_forms(shape: tuple, repeats: int) -> dict:
    batch, positions, in_features, out_features = shape
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch, positions, in_features, generator=generator)
    grads = torch.randn(batch, positions, out_features, generator=generator)
    original = linear_module.linear_weight_norm_form

    def norms_in(form: str) -> Callable[[], object]:
        def run() -> object:
            linear_module.linear_weight_norm_form = lambda *_: form
            try:
                return linear_module.linear_squared_norms(inputs, grads, bias=False)
            finally:
                linear_module.linear_weight_norm_form = original

        return run

    forms = cpu_ms({"gram": norms_in("gram"), "direct": norms_in("direct")}, repeats)
    return {
        "shape": f"B{batch} T{positions} {in_features}->{out_features}",
        "batch": batch,
        "L": positions,
        "D": in_features,
        "P": out_features,
        "gram_ms": forms["gram"],
        "direct_ms": forms["direct"],
        "model": linear_module.linear_weight_norm_form(positions, in_features, out_features),
    }


# ---------------------------------------------------------------------------------- report
def format_rows(rows: list[dict]) -> str:
    header = ["shape", "gram ms", "direct ms", "faster", "model picks", "lost by the pick", "gram MiB", "direct MiB"]
    lines = [header]
    for row in rows:
        faster = "gram" if row["gram_ms"] < row["direct_ms"] else "direct"
        picked = row["gram_ms"] if row["model"] == "gram" else row["direct_ms"]
        best = min(row["gram_ms"], row["direct_ms"])
        memory = [f"{row[key]:.1f}" if key in row else "-" for key in ("gram_mib", "direct_mib")]
        lines.append([row["shape"], f"{row['gram_ms']:.2f}", f"{row['direct_ms']:.2f}", faster, row["model"],
                      f"{100 * (picked / best - 1):.0f}%", *memory])  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    rendered = [" | ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in lines]
    rendered.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(rendered)


def fit(rows: list[dict], kind: str) -> str:
    """Least-squares times per multiply-add (gram: L^2 (D+P) and, for conv, the L*D patch copy; direct: L D P)."""
    batch = np.array([r["batch"] for r in rows], dtype=float)
    L, D, P = (np.array([r[k] for r in rows], dtype=float) for k in ("L", "D", "P"))
    gram_terms = [batch * L * L * (D + P)] + ([batch * L * D] if kind == "conv" else [])
    gram_coefficients, *_ = np.linalg.lstsq(np.stack(gram_terms, 1), np.array([r["gram_ms"] for r in rows]), rcond=None)
    direct_coefficients, *_ = np.linalg.lstsq(np.stack([batch * L * D * P], 1), np.array([r["direct_ms"] for r in rows]),
                                              rcond=None)  # fmt: skip
    per_mac = direct_coefficients[0]
    parts = [f"gram / direct time per multiply-add = {gram_coefficients[0] / per_mac:.2f}"]
    if kind == "conv":
        parts.append(f"patch copy per element = {gram_coefficients[1] / per_mac:.2f} direct multiply-adds")
    return f"{kind}: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fit", action="store_true", help="also print least-squares constants of the cost model")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps([conv_memory(shape) for shape in CONV_SHAPES]))
        return
    repeats = 3 if args.quick else 15
    print(f"torch {torch.__version__}, {args.threads} thread(s), least CPU ms of {repeats}; load average "
          + ", ".join(f"{load:.1f}" for load in os.getloadavg()), flush=True)  # fmt: skip
    conv_rows = [conv_forms(shape, repeats) for shape in CONV_SHAPES]
    memory = run_python_json([os.path.abspath(__file__), "--memory-child", f"--threads={args.threads}"],
                             env=MEMORY_CHILD_ENV)  # fmt: skip
    for row, peaks in zip(conv_rows, memory):
        row.update(peaks)
    print("\nConv2d weight: per-example squared norms of a batch\n" + format_rows(conv_rows), flush=True)
    linear_rows = [linear_forms(shape, repeats) for shape in LINEAR_SHAPES]
    print("\nLinear weight (sequence input): per-example squared norms of a batch\n" + format_rows(linear_rows))
    if args.fit:
        print("\n" + fit(conv_rows, "conv") + "\n" + fit(linear_rows, "linear"))
    lost = [
        (r["gram_ms"] if r["model"] == "gram" else r["direct_ms"]) / min(r["gram_ms"], r["direct_ms"])
        for r in conv_rows + linear_rows
    ]
    print(f"\nworst pick: {100 * (max(lost) - 1):.0f}% slower than the faster form; geometric mean "
          f"{100 * (math.exp(statistics.fmean(math.log(x) for x in lost)) - 1):.1f}%")  # fmt: skip


if __name__ == "__main__":
    main()
