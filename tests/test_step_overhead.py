"""The cheaper per-step checks (issue 25, item 1) give the answers of the walks they replace.

``parameter_sync.has_foreign_trainable_parameter`` / ``parameter_ids`` walk ``_modules`` directly instead of
``named_parameters()``; ``HistoryEntry.with_more_steps`` copies an entry instead of re-validating it through
``dataclasses.replace``. Each is compared with the form it replaces on trees and entries built to hit the
cases that differ between the two walks (a module reached twice, a ``None`` child, a ``None`` parameter, a
parameter tied between modules, frozen parameters, parameters assigned after construction).
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys

import pytest
import torch
from torch import nn

from accountants import RDPAccountant
from accountants.history import HistoryEntry
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
