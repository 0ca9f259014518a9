"""The per-step bookkeeping made cheaper (issue 25, item 1) refuses and records exactly what it did before.

What changed, and what each test pins down:

* the foreign-parameter check (``ParameterSync``) keeps the set of the optimizer's parameter ids between steps and
  walks the model anew at every forward and step: a parameter or layer added to the model after the first step,
  written straight into ``_parameters``, or unfrozen between the backward and the step, is still refused; a copy of
  the optimizer builds its own set;
* ``DPOptimizer.step`` opens its profiler range only while a profiler records or a step hook is registered (the
  hooks still run, in torch's order);
* the accountant merges a repeated step without building and validating an entry: the ledger is the one the
  validating path gives, and invalid arguments still raise after entries exist;
* the noise mechanism compares the tensors with its layout column by column: any change still raises;
* a forward's input batch size is read without the pytree walk for plain tensor arguments: the same answer.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from accountants import PLDAccountant, RDPAccountant
from accountants.history import HistoryEntry
from privacy_engine import GradSampleModule, connect_private
from privacy_engine.capture.batch_size import input_batch_size
from privacy_engine.noise import GaussianNoise
from privacy_engine.training.optimizer import DPOptimizer

NOT_HELD = r"of the wrapped model is trainable but not held"


def _pair(frozen_first: bool = False) -> tuple[nn.Sequential, GradSampleModule, DPOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    if frozen_first:
        model[0].requires_grad_(False)
    wrapped = GradSampleModule(model)
    optimizer = DPOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                            noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4)  # fmt: skip
    connect_private(wrapped, optimizer)
    return model, wrapped, optimizer


def _step(wrapped: GradSampleModule, optimizer: DPOptimizer) -> None:
    x = torch.randn(4, 3)
    wrapped(x).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


# ------------------------------------------------------------------------------------- the foreign-parameter check
@pytest.mark.parametrize(
    "add",
    [
        lambda model: setattr(model[2], "extra", nn.Parameter(torch.zeros(2))),
        lambda model: model[2]._parameters.__setitem__("extra", nn.Parameter(torch.zeros(2))),  # no hook sees it
        lambda model: model.append(nn.Linear(2, 2)),
        lambda model: model[0].__setattr__("weight", nn.Parameter(model[0].weight.detach().clone())),
    ],
    ids=["setattr", "straight-into-_parameters", "new-layer", "replaced-weight"],
)
def test_a_parameter_added_after_steps_is_refused_at_the_next_forward(add) -> None:
    model, wrapped, optimizer = _pair()
    _step(wrapped, optimizer)
    _step(wrapped, optimizer)  # the optimizer's ids are kept from here on
    add(model)
    with pytest.raises(RuntimeError, match=NOT_HELD):
        wrapped(torch.randn(4, 3))


def test_a_parameter_unfrozen_between_backward_and_step_is_refused_at_the_step() -> None:
    model, wrapped, optimizer = _pair(frozen_first=True)
    _step(wrapped, optimizer)
    wrapped(torch.randn(4, 3)).square().sum().backward()  # passed the forward's check: still frozen then
    model[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"'0\.weight' " + NOT_HELD):
        optimizer.step()
    model[0].weight.requires_grad_(False)  # frozen again: the step goes on
    optimizer.step()
    assert optimizer.steps_taken == 2


def test_a_copied_optimizer_builds_the_ids_of_its_own_parameters() -> None:
    _, wrapped, optimizer = _pair()
    _step(wrapped, optimizer)
    original_ids = optimizer._own_parameter_ids()
    copied = copy.deepcopy(optimizer)
    assert copied._own_parameter_ids() == frozenset(map(id, copied._all_params))
    assert not copied._own_parameter_ids() & original_ids  # other objects: none of the original's ids


# ------------------------------------------------------------------------------------- the optimizer's profiler range
def _range_names(monkeypatch) -> list[str]:
    names: list[str] = []
    enter = torch.autograd.profiler.record_function.__enter__

    def counting_enter(self):
        names.append(self.name)
        return enter(self)

    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__", counting_enter)
    return names


def test_no_profiler_range_of_its_own_without_a_profiler_or_hooks(monkeypatch) -> None:
    _, wrapped, optimizer = _pair()
    _step(wrapped, optimizer)  # (the first forward's independence check watches the loss up to its step by a hook)
    wrapped(torch.randn(4, 3)).square().sum().backward()
    names = _range_names(monkeypatch)
    optimizer.step()
    assert names == ["Optimizer.step#SGD.step"]  # the wrapped optimizer's own range only
    assert optimizer.steps_taken == 2


def test_step_hooks_and_the_profiler_range_as_torch_runs_them(monkeypatch) -> None:
    _, wrapped, optimizer = _pair()
    _step(wrapped, optimizer)
    calls: list[str] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append(f"pre {opt.steps_taken}"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(f"post {opt.steps_taken}"))
    handle = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: calls.append(f"global {type(opt).__name__}")
    )
    try:
        wrapped(torch.randn(4, 3)).square().sum().backward()
        names = _range_names(monkeypatch)
        optimizer.step()
    finally:
        handle.remove()
    assert names[0] == "Optimizer.step#DPOptimizer.step"  # hooks registered: torch's own wrapper, range included
    assert calls[:2] == ["global DPOptimizer", "pre 1"] and calls[-1] == "post 2"
    with torch.profiler.profile() as profile:
        wrapped(torch.randn(4, 3)).square().sum().backward()
        optimizer.step()
    assert "Optimizer.step#DPOptimizer.step" in {event.name for event in profile.events()}


# ------------------------------------------------------------------------------------- the accountant's merged step
STEPS = [
    {"noise_multiplier": 1.1, "sample_rate": 0.02},
    {"noise_multiplier": 1.1, "sample_rate": 0.02, "num_steps": 3},
    {"noise_multiplier": np.float64(1.1), "sample_rate": 0.02},  # equal, another type: the validating path
    {"noise_multiplier": 1, "sample_rate": 0.02},  # an int
    {"noise_multiplier": 1.0, "sample_rate": 0.02},
    {"noise_multiplier": 1.0, "sample_rate": 0.02, "source": "second optimizer"},
    {"noise_multiplier": 1.0, "sample_rate": 0.02},
    {"noise_multiplier": 1.0, "sample_rate": 0.02, "num_steps": 0},
    {"noise_multiplier": 1.0, "sample_rate": 0.02, "num_bands": np.int64(1)},  # a numpy int: the validating path
    {"noise_multiplier": 1.0, "sample_rate": 0.02, "mechanism_parameters": {}},
    {"noise_multiplier": 1.0, "sample_rate": 0.02, "batches_per_step": 2},
    {"noise_multiplier": 1.0, "sample_rate": 0.02, "batches_per_step": 2},
    {"noise_multiplier": 1.0, "sample_rate": 0.02, "group_size": 500, "max_batch_size": 20},
    {"noise_multiplier": 1.0, "sample_rate": 0.02, "group_size": 500, "max_batch_size": 20},
    {"noise_multiplier": 1.0, "sample_rate": 0.02, "group_size": 500, "max_batch_size": 21},
]


def test_merged_steps_leave_the_ledger_the_validating_path_leaves(monkeypatch) -> None:
    fast = PLDAccountant()
    for kwargs in STEPS:
        fast.step(**kwargs)
    monkeypatch.setattr(HistoryEntry, "repeats", lambda self, **kwargs: False)
    validated = PLDAccountant()
    for kwargs in STEPS:
        validated.step(**kwargs)
    assert fast.history == validated.history
    assert [entry.__dict__ for entry in fast.history] == [entry.__dict__ for entry in validated.history]
    assert all(type(entry.noise_multiplier) is float for entry in fast.history)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"noise_multiplier": True}, TypeError),  # True == 1.0, but a bool is refused
        ({"noise_multiplier": math.nan}, ValueError),
        ({"sample_rate": 1.5}, ValueError),
        ({"num_steps": -1}, ValueError),
        ({"num_steps": True}, TypeError),
        ({"num_bands": True}, TypeError),
        ({"source": 1}, TypeError),
        ({"mechanism": "no such kind"}, ValueError),
        ({"group_size": 500}, ValueError),
    ],
)
def test_invalid_arguments_still_raise_after_entries_exist(kwargs, error) -> None:
    accountant = RDPAccountant()
    accountant.step(noise_multiplier=1.0, sample_rate=0.5)
    accountant.step(noise_multiplier=1.0, sample_rate=0.5)
    with pytest.raises(error):
        accountant.step(**{"noise_multiplier": 1.0, "sample_rate": 0.5, **kwargs})
    assert accountant.history == (HistoryEntry(noise_multiplier=1.0, sample_rate=0.5, num_steps=2),)


# ------------------------------------------------------------------------------------- the noise layout's signature
@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda ts: [ts[0], torch.zeros(5)], ValueError),  # a shape
        (lambda ts: [ts[0], ts[1].double()], ValueError),  # a dtype
        (lambda ts: [ts[1], ts[0]], ValueError),  # the order
        (lambda ts: ts[:1], ValueError),  # the count
        (lambda ts: [ts[0], ts[1].int()], ValueError),  # not floating point
        (lambda ts: [ts[0], ts[1].tolist()], TypeError),  # not a tensor
        (lambda ts: [ts[0], ts[1].reshape(2, 2)], ValueError),  # same numel, another shape
    ],
)
def test_a_changed_tensor_list_is_refused_after_the_layout(change, error) -> None:
    noise = GaussianNoise(seed=3)
    tensors = [torch.zeros(3, 2), torch.zeros(4)]
    noise.add_noise_(tensors, 1.0, 1.0)
    noise.add_noise_(tensors, 1.0, 1.0)  # the same tensors: accepted
    with pytest.raises(error):
        noise.add_noise_(change(tensors), 1.0, 1.0)
    assert noise.step == 2
    noise.add_noise_([torch.ones(3, 2), torch.ones(4)], 1.0, 1.0)  # other tensors of the same layout: accepted
    assert noise.step == 3


# ------------------------------------------------------------------------------------- the input batch size
@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((torch.zeros(5, 3),), {}),
        ((torch.zeros(5, 3), torch.zeros(5, 2, 2), torch.zeros(1, 4)), {}),
        ((torch.zeros(5, 3), torch.zeros(1, 4)), {}),  # a tie: undecided
        ((nn.Parameter(torch.zeros(5, 3)),), {}),  # a subclass: the pytree walk
        ((torch.zeros(5, 3), [torch.zeros(2, 3), torch.zeros(2, 3)]), {}),
        ((torch.zeros(5, 3),), {"mask": torch.zeros(2, 3), "other": torch.zeros(2, 7)}),
        ((torch.zeros(7),), {}),  # 1-D: no vote
        ((), {}),
    ],
)
def test_the_input_batch_size_is_the_pytree_walks(args, kwargs) -> None:
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    counts: dict[int, int] = {}
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2:
            counts[leaf.shape[0]] = counts.get(leaf.shape[0], 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    expected = None if not counts or (len(ranked) > 1 and ranked[0] == ranked[1]) else max(counts, key=counts.get)
    assert input_batch_size(args, kwargs, 0) == expected
