"""The cheaper per-step checks (issue 25, item 1) give the answers of the walks they replace.

``parameter_sync.has_foreign_trainable_parameter`` / ``parameter_ids`` walk ``_modules`` directly instead of
``named_parameters()``; ``HistoryEntry.with_more_steps`` copies an entry instead of re-validating it through
``dataclasses.replace``. Each is compared with the form it replaces on trees and entries built to hit the
cases that differ between the two walks (a module reached twice, a ``None`` child, a ``None`` parameter, a
parameter tied between modules, frozen parameters, parameters assigned after construction).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
import sys

import pytest
import torch
from torch import nn

from accountants import RDPAccountant
from accountants.history import HistoryEntry
from privacy_engine.clipping import PerSampleGradientClipper
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.training.parameter_sync import has_foreign_trainable_parameter, parameter_ids

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from workloads import ALL_WORKLOADS, skeleton_of  # the benchmarks folder is not a package


def _random_tree(rng: random.Random) -> nn.Module:
    pool: list[nn.Module] = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.random()
        if kind < 0.4 or not pool:
            module = nn.Linear(2, 2, bias=rng.random() < 0.5)  # bias=None: a None entry in _parameters
        elif kind < 0.7:
            module = nn.Sequential(*rng.sample(pool, rng.randint(1, min(3, len(pool)))))  # shared children
        else:
            module = nn.Module()
            module.register_module("empty", None)
            module.add_module("child", rng.choice(pool))
            module.extra = nn.Parameter(torch.zeros(1))  # assigned after construction
        pool.append(module)
    root = nn.ModuleList(rng.sample(pool, rng.randint(1, len(pool))))
    linears = [m for m in root.modules() if isinstance(m, nn.Linear)]
    if len(linears) >= 2 and rng.random() < 0.5:
        linears[0].weight = linears[1].weight  # tied
    for param in root.parameters():
        param.requires_grad_(rng.random() < 0.7)
    return root


@pytest.mark.parametrize("seed", range(40))
def test_the_direct_walk_finds_what_parameters_finds(seed: int) -> None:
    rng = random.Random(seed)
    root = _random_tree(rng)
    params = list(root.parameters())
    assert parameter_ids(root) == {id(p) for p in params}
    known = {id(p) for p in params if rng.random() < 0.6}
    expected = any(p.requires_grad and id(p) not in known for p in params)
    assert has_foreign_trainable_parameter(root, known) is expected
    assert has_foreign_trainable_parameter(root, {id(p) for p in params}) is False


@pytest.mark.parametrize(
    "fields",
    [
        {"noise_multiplier": 1.0, "sample_rate": 0.01},
        {"noise_multiplier": 0.7, "sample_rate": 0.2, "num_bands": 3, "source": "opt-1"},
        {"noise_multiplier": 2.0, "sample_rate": 0.05, "group_size": 1000, "max_batch_size": 80},
        {"noise_multiplier": 1.3, "sample_rate": 0.1, "batches_per_step": 2},
    ],
)
@pytest.mark.parametrize("extra", [0, 1, 7])
def test_with_more_steps_is_replace_without_revalidation(fields: dict, extra: int) -> None:
    entry = HistoryEntry(num_steps=3, **fields)
    merged = entry.with_more_steps(extra)
    expected = dataclasses.replace(entry, num_steps=3 + extra)
    assert merged == expected and hash(merged) == hash(expected)
    assert merged.__dict__ == expected.__dict__
    assert entry.num_steps == 3  # the original is unchanged (entries are frozen)


def test_merged_steps_give_the_epsilon_of_one_entry_of_all_steps() -> None:
    stepped, recorded = RDPAccountant(), RDPAccountant()
    for _ in range(25):
        stepped.step(noise_multiplier=1.1, sample_rate=0.02)
    recorded.step(noise_multiplier=1.1, sample_rate=0.02, num_steps=25)
    assert len(stepped.history) == 1 and stepped.history[0] == recorded.history[0]
    assert stepped.get_epsilon(delta=1e-5) == recorded.get_epsilon(delta=1e-5)


@pytest.mark.parametrize("name", sorted(ALL_WORKLOADS))
def test_a_skeleton_has_the_layers_of_its_workload(name: str) -> None:
    """bench_dp_step's "python overhead" is measured on the skeleton: it must run the same layers, in the
    same order, with the same parameter tensors, at the same batch size (only the widths differ)."""
    pytest.importorskip("transformers")
    workload = ALL_WORKLOADS[name]
    skeleton = skeleton_of(workload)
    full_model, small_model = workload.build_model(), skeleton.build_model()
    assert [type(m) for m in small_model.modules()] == [type(m) for m in full_model.modules()]
    assert [p.dim() for p in small_model.parameters()] == [p.dim() for p in full_model.parameters()]
    assert skeleton.batch_size == workload.batch_size
    inputs, targets = skeleton.make_batch(skeleton.batch_size, torch.Generator().manual_seed(0))
    loss = skeleton.loss(small_model(inputs), targets)
    assert loss.dim() == 0 and torch.isfinite(loss)


# ---------------------------------------------------------------------------------------------------------------
# Fast clipping keeps, from one backward pass to the next, the buffer a shared parameter's per-example gradients
# are summed into (``GhostPasses.buffers``): a fresh CPU tensor of that size costs its page faults every step.
# The buffer must give the bits of a pass without it, hold zeros between passes, and must not be reused when what
# it was built for changed.


class _ReusedLayer(nn.Module):
    """One Linear applied ``uses`` times: its weight and bias are shared by the uses (materialised, summed)."""

    def __init__(self, uses: int) -> None:
        super().__init__()
        self.layer = nn.Linear(5, 5)
        self.uses = uses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.uses):
            x = torch.tanh(self.layer(x))
        return x


def _ghost_sums(wrapped, clipper, x: torch.Tensor) -> list[torch.Tensor]:
    wrapped(x).square().sum().backward()
    clipper.pre_step()
    sums = [p.grad.clone() for p in clipper.params]
    for p in clipper.params:
        p.grad = None
    return sums


def _fresh_ghost_sums(twin: nn.Module, x: torch.Tensor, max_grad_norm: float) -> list[torch.Tensor]:
    """The same pass through a new wrapper of a copy of ``twin`` (no buffer kept from an earlier pass)."""
    model = copy.deepcopy(twin)
    clipper = PerSampleGradientClipper(list(model.parameters()), max_grad_norm=max_grad_norm)
    return _ghost_sums(GhostClippingModule(model, clipper=clipper, loss_reduction="sum"), clipper, x)


def _clipped_sum_by_loop(model: nn.Module, x: torch.Tensor, max_grad_norm: float) -> list[torch.Tensor]:
    """sum_i min(1, C / ||g_i||) g_i in float64, one example at a time."""
    from conftest import per_example_reference

    reference = copy.deepcopy(model).double()
    per_example = per_example_reference(reference, (x.double(),), lambda out, i: out.square().sum())
    flat = torch.cat([g.reshape(g.shape[0], -1) for g in per_example.values()], dim=1)
    factors = (max_grad_norm / flat.norm(dim=1)).clamp(max=1.0)
    return [torch.tensordot(factors, g, dims=1) for g in per_example.values()]


@pytest.mark.parametrize("uses", [2, 3])
def test_a_kept_buffer_gives_the_bits_of_a_fresh_pass(uses: int) -> None:
    torch.manual_seed(uses)
    model = _ReusedLayer(uses)
    twin = copy.deepcopy(model)  # unwrapped, for fresh passes
    clipper = PerSampleGradientClipper(list(model.parameters()), max_grad_norm=0.7)
    wrapped = GhostClippingModule(model, clipper=clipper, loss_reduction="sum")
    kept = []
    for step in range(3):
        x = torch.randn(6, 5)
        sums = _ghost_sums(wrapped, clipper, x)
        kept.append(wrapped._passes.buffers.get(model.layer.weight))
        # Per-example gradients never outlive their pass: the kept memory holds zeros between passes.
        assert all(not buffer.any() for buffer in wrapped._passes.buffers.values()), f"step {step}"
        for actual, fresh in zip(sums, _fresh_ghost_sums(twin, x, 0.7), strict=True):
            assert torch.equal(actual, fresh), f"step {step}"
        for actual, expected in zip(sums, _clipped_sum_by_loop(twin, x, 0.7), strict=True):
            torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-6)
    assert kept[0] is not None and kept[1] is kept[0] and kept[2] is kept[0]  # the cache is used


def test_a_kept_buffer_is_not_reused_when_its_inputs_changed() -> None:
    torch.manual_seed(0)
    model = _ReusedLayer(2)
    twin = copy.deepcopy(model)  # unwrapped, for fresh passes; changed as the model is
    clipper = PerSampleGradientClipper(list(model.parameters()), max_grad_norm=0.5)
    wrapped = GhostClippingModule(model, clipper=clipper, loss_reduction="sum")
    weight, bias = model.layer.weight, model.layer.bias

    def step_matches_a_fresh_pass(x: torch.Tensor) -> None:
        for actual, fresh in zip(_ghost_sums(wrapped, clipper, x), _fresh_ghost_sums(twin, x, 0.5), strict=True):
            assert torch.equal(actual, fresh)

    step_matches_a_fresh_pass(torch.randn(6, 5))
    first = wrapped._passes.buffers[weight]
    step_matches_a_fresh_pass(torch.randn(4, 5))  # another batch size: another shape
    assert wrapped._passes.buffers[weight] is not first and wrapped._passes.buffers[weight].shape[0] == 4
    model.double()  # the same parameters, now float64
    twin.double()
    step_matches_a_fresh_pass(torch.randn(4, 5, dtype=torch.float64))
    assert wrapped._passes.buffers[weight].dtype == torch.float64
    bias.requires_grad_(False)  # frozen between steps: no longer used by the pass, its buffer dropped
    twin.layer.bias.requires_grad_(False)
    step_matches_a_fresh_pass(torch.randn(4, 5, dtype=torch.float64))
    assert bias not in wrapped._passes.buffers and weight in wrapped._passes.buffers
    bias.requires_grad_(True)
    twin.layer.bias.requires_grad_(True)
    model.uses = twin.uses = 1  # no longer shared: nothing kept
    step_matches_a_fresh_pass(torch.randn(4, 5, dtype=torch.float64))
    assert not wrapped._passes.buffers
