"""User-level DP under DDP (``make_private(privacy_unit="user")`` on a DDP model, issue 23 part 3).

A 2-rank gloo job (``tests/user_level_ddp_worker.py``, hooks and ghost) with noise off: every release equals a
float64 loop over the users both ranks drew (each example alone, a user's rows summed, the sum clipped once,
summed over users), each user's rows are on one rank (``u mod 2``), and the rates are the single-process
ones (rate ``q`` over users, the global expected batch size), so the accounting is the single-process event.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import per_example_reference, run_rank_job
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "user_level_ddp_worker.py"
WORLD_SIZE = 2
JOB_TIME_LIMIT_S = 180  # a hung job is killed: the test always ends

sys.path.insert(0, str(ROOT / "tests"))
import user_level_ddp_worker as worker


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("user_ddp")
    results, _, _ = run_rank_job(WORKER, WORLD_SIZE, out, JOB_TIME_LIMIT_S)
    for result in results:
        assert "traceback" not in result, result["traceback"]
    return results


def reference_release(rows_per_rank: list[list[int]]) -> torch.Tensor:
    """Float64 loop over the users of every rank: each user's k consecutive rows' per-example gradients summed,
    clipped to 1 once, summed over users ("sum" reduction: not divided)."""
    dataset, user_ids = worker.data()
    model = worker.mlp().double()
    total = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    for rows in rows_per_rank:
        if not rows:
            continue
        x, y, _ = dataset[torch.tensor(rows)]
        grads = per_example_reference(model, (x,), lambda out, i, y=y: nn.functional.cross_entropy(out, y[i : i + 1], reduction="sum"))
        flat = torch.cat([g.reshape(len(rows), -1) for g in grads.values()], dim=1)
        for start in range(0, len(rows), worker.K):
            assert len({user_ids[i] for i in rows[start : start + worker.K]}) == 1  # one user's k rows
            user_sum = flat[start : start + worker.K].sum(dim=0)
            norm = float(user_sum.norm())
            total += user_sum * (min(1.0, 1.0 / norm) if norm > 0 else 0.0)
    return total


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_each_rank_clips_its_users_and_the_release_is_the_single_process_per_user_sum(job, mode):
    _, user_ids = worker.data()
    ranks = [result[mode] for result in job]
    both_ranks_drew = 0
    for step in range(worker.STEPS):
        rows_per_rank = [rank["indices"][step] for rank in ranks]
        for rank, rows in enumerate(rows_per_rank):
            assert all(user_ids[i] % WORLD_SIZE == rank for i in rows)  # user u on rank u mod 2 only
        both_ranks_drew += all(rows_per_rank)
        expected = reference_release(rows_per_rank)
        for rank in ranks:
            torch.testing.assert_close(rank["released"][step], expected, rtol=1e-9, atol=1e-12)
    assert both_ranks_drew >= 1
    for rank in ranks:
        assert rank["sample_rate"] == worker.EXPECTED_USERS / worker.NUM_USERS
        assert math.isclose(rank["expected_batch_size"], worker.EXPECTED_USERS)
