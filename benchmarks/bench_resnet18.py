"""ResNet-18 (torchvision's architecture after ``fix_module``: BatchNorm -> GroupNorm) DP step against a
plain step, in each mode and in the default one (issue 21 item 7).

torchvision is not a dependency: the model is built here, the standard BasicBlock [2, 2, 2, 2] network
(7x7/2 stem, max-pool, 64-128-256-512 channels, 1x1/2 shortcuts) with ``GroupNorm(32, C)`` where
torchvision has BatchNorm, as ``privacy_engine.fix_module`` gives; 11.2M parameters, 10 classes.

==================  ==================================================================================
variant             step
==================  ==================================================================================
plain               the model alone, SGD (the reference of every ratio)
default             ``PrivacyEngine().make_private(...)`` with no ``grad_sample_mode`` (``"auto"``,
                    ``engine.mode_choice``), its optimizer and wrapper on the fixed batch
hooks               ``make_private(grad_sample_mode="hooks")``: materialised per-sample gradients
hooks-grouped       the same with every convolution's per-sample gradients from the grouped backward
                    (the batch folded into the groups): the conv path before issue 21 item 7
ghost               ``make_private(grad_sample_mode="ghost")``: fast clipping in the backward pass
ghost-grouped       the same with the grouped backward wherever a convolution's norms are materialised
==================  ==================================================================================

Every private variant: flat clipping C=1, sigma=1, Gaussian noise, make_private's accountant, the loader's
fixed-size batches (``poisson_sampling=False``: the same examples per step in every variant).
Times: ``workloads.time_interleaved`` (round-robin, each timed step after an untimed one of its own),
``--runs`` runs; median over runs of the per-run median ratios to plain. Besides wall time, the ratios
of CPU time (the process's, all threads: the work done, little disturbed by other jobs on a shared
machine) and of the calling thread's CPU time (the step's critical path when a spare core draws the
noise in the background).

``--layers``: per convolution of the model, the milliseconds of the plain weight backward, the grouped
per-sample backward and the patch form (``grad_samplers._convolution.patch_weight_grads``), and the form
``patches_are_small`` picks.

``--baseline TREE``: one more row, the default step with ``TREE``'s ``grad_samplers/_convolution.py`` and
``conv.py`` swapped in (the rest of this tree unchanged), interleaved with the others: a before/after of a
change to the convolution forms in one run.

Run:  python benchmarks/bench_resnet18.py [--batch 32] [--size 64] [--threads 1] [--runs 3] [--layers]
      [--baseline TREE]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import os
import statistics
import sys
import time
import warnings
from unittest import mock

# Opacus installs a top-level package named `benchmarks`: import the sibling modules directly.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from workloads import render_table, time_interleaved

import grad_samplers.conv as conv_module
import grad_samplers.registry
from grad_samplers._convolution import patches_are_small
from privacy_engine import PrivacyEngine

VARIANTS = ("plain", "default", "hooks", "hooks-grouped", "ghost", "ghost-grouped")
LEARNING_RATE = 0.05


class BasicBlock(nn.Module):
    """torchvision's BasicBlock with GroupNorm in place of BatchNorm."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.GroupNorm(min(32, out_channels), out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.GroupNorm(min(32, out_channels), out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.GroupNorm(min(32, out_channels), out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (BasicBlock x [2, 2, 2, 2]) after ``fix_module``."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.GroupNorm(32, 64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, in_channels = [], 64
        for out_channels, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages.append(
                nn.Sequential(BasicBlock(in_channels, out_channels, stride), BasicBlock(out_channels, out_channels, 1))
            )
            in_channels = out_channels
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _batch(batch_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 3, size, size, generator=generator), torch.randint(
        0, 10, (batch_size,), generator=generator
    )


def _cycling_step(module: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader):
    """One step on the loader's next batch (the engine releases only batches its private loader drew)."""
    batches = iter(())

    def step() -> None:
        nonlocal batches
        batch = next(batches, None)
        if batch is None:
            batches = iter(loader)
            batch = next(batches)
        inputs, targets = batch
        F.cross_entropy(module(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def build_step(variant: str, batch_size: int, size: int):
    """``variant``'s step, each on the next batch of a 4-batch dataset of fixed-size batches (loader order,
    no Poisson sampling, so every step has ``batch_size`` examples), and the wrapper the engine built."""
    torch.manual_seed(0)
    model = ResNet18()
    inputs, targets = _batch(4 * batch_size, size)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=batch_size)
    sgd = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    if variant == "plain":
        return _cycling_step(model, sgd, loader), None
    mode = {"default": None, "hooks": "hooks", "ghost": "ghost"}[variant.removesuffix("-grouped")]
    settings = {} if mode is None else {"grad_sample_mode": mode}
    module, optimizer, private_loader = PrivacyEngine().make_private(
        module=model, optimizer=sgd, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling=False, **settings,
    )  # fmt: skip
    step = _cycling_step(module, optimizer, private_loader)
    if variant.endswith("-grouped"):
        inner = step

        def step() -> None:
            with mock.patch.object(conv_module, "patches_are_small", lambda *args: False):
                inner()

    return step, type(module).__name__


def baseline_forms(tree: str):
    """The convolution sampler forms (``grad_samplers.conv._FORMS``) of another checkout ``tree``: its
    ``grad_samplers/_convolution.py`` and ``conv.py`` loaded under other names, for a before/after run in
    one process (``--baseline``)."""

    def load(name: str, file: str):
        spec = importlib.util.spec_from_file_location(name, os.path.join(tree, "grad_samplers", file))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
        return module

    convolution = load("baseline_convolution", "_convolution.py")
    # Loading conv.py registers its samplers for the convolution types: the registry is put back after, so
    # that only the variant that swaps the forms in (``_FORMS``, read at each call) runs the baseline's.
    with (
        mock.patch.dict(sys.modules, {"grad_samplers._convolution": convolution}),
        mock.patch.dict(grad_samplers.registry._SAMPLERS),
    ):
        return load("baseline_conv", "conv.py")._FORMS


def measure(
    batch_size: int, size: int, variants: list[str], *, runs: int, repeats: int, baseline: str | None = None
) -> list[list[str]]:
    built = {variant: build_step(variant, batch_size, size) for variant in variants}
    if baseline is not None:
        # The default step with another tree's convolution forms: this tree's other code, interleaved.
        step, wrapper = build_step("default", batch_size, size)
        forms = baseline_forms(baseline)

        def baseline_step(step=step) -> None:
            with mock.patch.object(conv_module, "_FORMS", forms):
                step()

        built["default, --baseline conv"] = (baseline_step, wrapper)
        variants = [*variants, "default, --baseline conv"]
    steps = {variant: step for variant, (step, _) in built.items()}
    per_run, warmup = [], 2
    for _ in range(runs):
        timings = time_interleaved(steps, repeats=repeats, warmup=warmup)
        per_run.append({
            variant: (timing.median_ms, timing.median_cpu_ms, timing.median_thread_cpu_ms)
            for variant, timing in timings.items()
        })  # fmt: skip
        warmup = 1

    def median_ratio(variant: str, column: int) -> float:
        return statistics.median(run[variant][column] / run["plain"][column] for run in per_run)

    lines = [["variant", "wrapper", "wall ms", "x plain", "(runs min-max)", "x plain, CPU", "x plain, thread CPU"]]
    for variant in variants:
        ratios = [run[variant][0] / run["plain"][0] for run in per_run]
        lines.append([
            variant, built[variant][1] or "-", f"{statistics.median(run[variant][0] for run in per_run):.1f}",
            f"{statistics.median(ratios):.2f}", f"{min(ratios):.2f}-{max(ratios):.2f}",
            f"{median_ratio(variant, 1):.2f}", f"{median_ratio(variant, 2):.2f}",
        ])  # fmt: skip
    return lines


def _median_ms(function, repeats: int = 3) -> float:
    function()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return 1000 * statistics.median(samples)


def layer_table(batch_size: int, size: int) -> list[list[str]]:
    """Per convolution: plain weight backward, grouped per-sample backward, patch form (ms), the pick."""
    model = ResNet18()
    seen: list[tuple[nn.Conv2d, torch.Tensor, torch.Size]] = []
    hooks = [
        layer.register_forward_hook(lambda layer, args, out: seen.append((layer, args[0].detach(), out.shape)))
        for layer in model.modules() if isinstance(layer, nn.Conv2d)
    ]  # fmt: skip
    with torch.no_grad():
        model(_batch(batch_size, size)[0])
    for hook in hooks:
        hook.remove()
    lines = [["input", "kernel/stride", "L", "D", "P", "plain ms", "grouped ms", "patches ms", "picked"]]
    for layer, inputs, out_shape in seen:
        grads = torch.randn(out_shape)
        plain = _median_ms(functools.partial(conv_module._weight_backward, layer, inputs, grads, layer.groups,
                                             layer.weight.shape))  # fmt: skip
        forms = {}
        for name, rule in (("grouped", False), ("patches", True)):
            with mock.patch.object(conv_module, "patches_are_small", lambda *args, rule=rule: rule):
                forms[name] = _median_ms(functools.partial(conv_module._per_sample_weight_grads, layer, inputs, grads))
        positions = math.prod(out_shape[2:])
        picked = "patches" if patches_are_small(positions, layer.out_channels // layer.groups) else "grouped"
        lines.append([
            "x".join(map(str, inputs.shape[1:])), f"{layer.kernel_size[0]}/{layer.stride[0]}", str(positions),
            str(layer.weight[0].numel()), str(layer.out_channels), f"{plain:.1f}", f"{forms['grouped']:.1f}",
            f"{forms['patches']:.1f}", picked,
        ])  # fmt: skip
    totals = [sum(float(line[col]) for line in lines[1:]) for col in (5, 6, 7)]
    lines.append(["total", "", "", "", "", *(f"{total:.1f}" for total in totals), ""])
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=64, help="image side (inputs 3 x size x size)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per run")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--layers", action="store_true", help="also the per-convolution table")
    parser.add_argument("--baseline", metavar="TREE", help="also the default step with the convolution forms of "
                        "another checkout (e.g. `git worktree add /tmp/before HEAD`): before/after in one run")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    variants = ["plain", *(v for v in args.variants if v != "plain")]
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"torch {torch.__version__}, {args.threads} thread(s), resnet18 (GroupNorm) {args.size}x{args.size}, batch "
          f"{args.batch}; load average {load}", flush=True)  # fmt: skip
    if args.layers:
        print(render_table(layer_table(args.batch, args.size)), flush=True)
        print()
    table = measure(args.batch, args.size, variants, runs=args.runs, repeats=args.repeats, baseline=args.baseline)
    print(render_table(table))
    print(f"\nload average at the end {', '.join(f'{value:.1f}' for value in os.getloadavg())}")


if __name__ == "__main__":
    main()
