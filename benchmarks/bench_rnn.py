"""Cost of a DP-SGD step on a character-level LSTM: ours (the user's ``nn.LSTM``) against Opacus 1.6's
``DPLSTM`` and against the same step without DP.

Model: Embedding(128, 64) -> 2-layer LSTM (hidden 128, batch_first) -> Linear(128, 18) on the last
layer's final state; sequences of 50 characters, batch 32, mean cross-entropy.

==================  ==========================================================================
variant             step (forward + loss + backward + optimizer step + zero_grad)
==================  ==========================================================================
plain               ``nn.LSTM`` (torch's fused kernel), SGD, no DP: the reference of every ratio
ours-hooks          ``nn.LSTM`` + ``GradSampleModule`` + ``DPOptimizer`` (clip + Gaussian noise)
ours-ghost          ``nn.LSTM`` + ``GhostClippingModule`` + ``DPOptimizer`` (the LSTM's per-sample
                    gradients are materialised inside backward, the rest is fast clipping)
opacus-hooks        Opacus ``DPLSTM`` + Opacus ``make_private`` (hooks) + its ``DPOptimizer``
opacus-ghost        Opacus ``DPLSTM`` + Opacus ``make_private(grad_sample_mode="ghost")``
==================  ==========================================================================

With ``--packed`` the same batch is also run as a ``PackedSequence`` (lengths 1..50,
``enforce_sorted=False``) for plain and ours; Opacus is left out there (its DPLSTM assigns per-sample
gradients of packed batches to the wrong examples, so its time would describe a wrong result).

Times are medians over interleaved rounds in one process (``workloads.time_interleaved``); ratios
are to ``plain`` and, in the last column, to ``opacus-hooks``. A 1024^3 matmul timed before and after
shows whether the machine's speed changed during the run.

Run:  python benchmarks/bench_rnn.py [--quick] [--packed] [--threads N]   (from any directory)
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable

# Opacus installs a top-level package named `benchmarks`: import `workloads` as a sibling module.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from workloads import (
    opacus_step,
    reference_matmul_ms,
    render_table,
    runnable_variants,
    set_threads,
    time_interleaved,
    training_step,
    versions,
)

from privacy_engine import GhostClippingModule, GradSampleModule, connect_private
from privacy_engine.noise import GaussianNoise
from privacy_engine.training.optimizer import DPOptimizer

VOCABULARY, EMBEDDING, HIDDEN, LAYERS, CLASSES = 128, 64, 128, 2, 18
SEQUENCE_LENGTH, BATCH_SIZE = 50, 32
LEARNING_RATE, NOISE_MULTIPLIER, MAX_GRAD_NORM = 0.05, 1.0, 1.0
VARIANTS = ("plain", "ours-hooks", "ours-ghost", "opacus-hooks", "opacus-ghost")

try:
    import opacus
    from opacus.layers import DPLSTM as OpacusDPLSTM
except ImportError:  # our rows still run without Opacus
    opacus = None


class CharLSTM(nn.Module):
    def __init__(self, recurrent: nn.Module) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, EMBEDDING)
        self.recurrent = recurrent
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        embedded = self.embedding(tokens)
        if lengths is not None:
            embedded = pack_padded_sequence(embedded, lengths, batch_first=True, enforce_sorted=False)
        _, (h_n, _) = self.recurrent(embedded)
        return self.head(h_n[-1])


def make_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCABULARY, (BATCH_SIZE, SEQUENCE_LENGTH), generator=generator)
    lengths = torch.randint(1, SEQUENCE_LENGTH + 1, (BATCH_SIZE,), generator=generator)
    lengths[0] = SEQUENCE_LENGTH
    labels = torch.randint(0, CLASSES, (BATCH_SIZE,), generator=generator)
    return tokens, lengths, labels


def make_step(variant: str, *, packed: bool, seed: int = 0) -> Callable[[], None]:
    """A closure running one training step of ``variant`` on a fixed batch."""
    torch.manual_seed(seed)
    tokens, lengths, labels = make_batch(seed)
    call_lengths = lengths if packed else None
    if variant.startswith("opacus"):
        if opacus is None:
            raise RuntimeError("opacus is not installed")
        model = CharLSTM(OpacusDPLSTM(EMBEDDING, HIDDEN, num_layers=LAYERS, batch_first=True))
    else:
        model = CharLSTM(nn.LSTM(EMBEDDING, HIDDEN, num_layers=LAYERS, batch_first=True))
    sgd = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    inputs = (tokens, call_lengths)

    if variant == "plain":
        return training_step(model, sgd, F.cross_entropy, inputs, labels)

    if variant in ("ours-hooks", "ours-ghost"):
        optimizer = DPOptimizer(
            sgd, noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM, expected_batch_size=BATCH_SIZE,
            noise=GaussianNoise(seed=seed),
        )  # fmt: skip
        if variant == "ours-hooks":
            wrapped = GradSampleModule(model)
        else:
            wrapped = GhostClippingModule(model, clipper=optimizer.clipper)
        connect_private(wrapped, optimizer)
        return training_step(wrapped, optimizer, F.cross_entropy, inputs, labels)

    if variant in ("opacus-hooks", "opacus-ghost"):
        return opacus_step(
            model, sgd, inputs, labels, mode=variant.removeprefix("opacus-"), loss_fn=F.cross_entropy,
            batch_size=BATCH_SIZE, noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=MAX_GRAD_NORM,
        )  # fmt: skip

    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def format_table(rows: list[tuple[str, str, dict | None]]) -> str:
    header = ["input", "variant", "wall ms", "x plain", "x opacus-hooks", "CPU ms", "x plain"]
    lines = [header]
    for input_kind, variant, timing in rows:
        if timing is None:
            lines.append([input_kind, variant, "failed", "-", "-", "-", "-"])
            continue
        plain = next(t for kind, v, t in rows if kind == input_kind and v == "plain")
        opacus_hooks = next((t for kind, v, t in rows if kind == "padded" and v == "opacus-hooks" and t), None)
        lines.append([
            input_kind,
            variant,
            f"{timing['wall_ms']:.1f}",
            f"{timing['wall_ms'] / plain['wall_ms']:.2f}",
            "-" if opacus_hooks is None else f"{timing['wall_ms'] / opacus_hooks['wall_ms']:.2f}",
            f"{timing['cpu_ms']:.1f}",
            f"{timing['cpu_ms'] / plain['cpu_ms']:.2f}",
        ])  # fmt: skip
    return render_table(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (a smoke run; numbers are noisy)")
    parser.add_argument("--packed", action="store_true", help="also time PackedSequence input (plain and ours)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 15, quick 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    args = parser.parse_args(argv)
    cores = set_threads(args.threads)
    warnings.simplefilter("ignore")  # Opacus's notices (secure RNG, full backward hooks)
    repeats = args.repeats or (3 if args.quick else 15)
    warmup = 1 if args.quick else 3
    variants = runnable_variants(args.variants, opacus_installed=opacus is not None)
    before_ms = reference_matmul_ms()
    print(
        versions(opacus, threads=cores)
        + f"; median of {repeats} interleaved rounds after {warmup} warm-up rounds; 1024^3 matmul {before_ms:.1f} ms",
        flush=True,
    )
    rows: list[tuple[str, str, dict | None]] = []
    inputs = [("padded", False)] + ([("packed", True)] if args.packed else [])
    for input_kind, packed in inputs:
        kinds = [v for v in variants if not (packed and v.startswith("opacus"))]
        steps = {}
        for variant in kinds:
            try:
                steps[variant] = make_step(variant, packed=packed)
                steps[variant]()  # fails here, not in the timing loop, if the variant cannot run
            except Exception as error:  # noqa: BLE001  (a variant that cannot run is reported, not fatal)
                print(f"  {input_kind} {variant}: {type(error).__name__}: {error}", flush=True)
                steps.pop(variant, None)
        timings = time_interleaved(steps, repeats=repeats, warmup=warmup)
        for variant in kinds:
            timing = timings.get(variant)
            rows.append((input_kind, variant, None if timing is None else
                         {"wall_ms": timing.median_ms, "cpu_ms": timing.median_cpu_ms}))
        print(f"  done {input_kind}: " + ", ".join(f"{v} {t.median_ms:.1f} ms" for v, t in timings.items()), flush=True)
    after_ms = reference_matmul_ms()
    print()
    print(f"char-LSTM: embedding {EMBEDDING}, hidden {HIDDEN}, {LAYERS} layers, sequence {SEQUENCE_LENGTH}, "
          f"batch {BATCH_SIZE}; C={MAX_GRAD_NORM}, sigma={NOISE_MULTIPLIER}, SGD lr={LEARNING_RATE}")
    print(format_table(rows))
    print()
    note = " (speed changed during the run: treat the numbers with care)" if max(before_ms, after_ms) > 1.5 * min(
        before_ms, after_ms) else ""
    print(f"1024^3 matmul: {before_ms:.1f} ms before, {after_ms:.1f} ms after{note}")


if __name__ == "__main__":
    main()
