"""The wrapper's per-forward bookkeeping made cheaper (issue 25, round 3) gives the answers it gave before.

* the foreign-parameter walk keeps no set of the modules seen (a module reached twice is looked at twice): a
  cycle in ``_modules`` still ends, with the answer of the walk that dedupes;
* the resolve path lists a forward's tensors without the generators' walk for plain tensor arguments: the same
  tensors, in the same order, as ``iter_tensors``;
* the independence guard reads the train/eval structure from a flat list of its modules: a submodule turned to
  eval still re-arms the checks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from privacy_engine.batches.tickets import forward_tensors, iter_tensors
from privacy_engine.capture.independence import IndependenceGuard
from privacy_engine.training import parameter_sync
from privacy_engine.training.parameter_sync import has_foreign_trainable_parameter


def test_a_cycle_in_modules_ends_with_the_deduplicating_walks_answer(monkeypatch) -> None:
    monkeypatch.setattr(parameter_sync, "_WALK_LIMIT", 64)  # the cycle is found fast
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    model.add_module("again", model)  # reached from itself
    known = {id(p) for p in model.parameters()}
    assert has_foreign_trainable_parameter(model, known) is False
    model[1]._parameters["extra"] = nn.Parameter(torch.zeros(1))  # straight into the dict
    assert has_foreign_trainable_parameter(model, known) is True
    model[1].extra.requires_grad_(False)
    assert has_foreign_trainable_parameter(model, known) is False


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((torch.zeros(3, 2),), {}),
        ((torch.zeros(3, 2), torch.zeros(3)), {}),
        ((nn.Parameter(torch.zeros(3, 2)),), {}),  # a subclass: the walk
        ((torch.zeros(3, 2), [torch.zeros(1), (torch.zeros(2),)]), {}),
        ((torch.zeros(3, 2),), {"mask": torch.zeros(3), "n": 4}),
        ((4, torch.zeros(1)), {}),
        ((), {}),
    ],
)
def test_the_forward_tensors_are_iter_tensors_answer(args, kwargs) -> None:
    listed = forward_tensors(args, kwargs)
    expected = list(iter_tensors([args, kwargs]))
    assert len(listed) == len(expected) and all(a is b for a, b in zip(listed, expected))


def test_the_structure_is_read_from_the_guards_modules() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    guard = IndependenceGuard(model, batch_dim=0, strict=True)
    guard.verified = True
    guard.before_training_forward()
    assert guard.verified  # nothing changed
    model[1].eval()
    guard.before_training_forward()
    assert not guard.verified  # re-armed
    assert guard.structure == (True, True, False)
