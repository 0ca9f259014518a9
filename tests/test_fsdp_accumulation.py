"""Virtual steps (gradient accumulation) through ``engine.make_private`` on FSDP2 (``fully_shard``) models, and a
stalled rank: 2 gloo ranks (tests/fsdp_accumulation_worker.py, hard time limit).

A logical Poisson batch cut into micro-batches by ``VirtualSteps`` must release what the whole batch releases
in one step (the float64 per-example clipped sum of the union of the ranks' logical batches), with one noise
draw per logical step and one accounted step per logical batch; a loop left between micro-batches releases
nothing. A rank that stalls (alive, not crashed) makes the others raise ``DistributedStepError`` at the
engine's agreement point, bounded by the process group's timeout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import run_rank_job

from privacy_engine.training.fsdp import ShardNoise

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "fsdp_accumulation_worker.py"
JOB_TIME_LIMIT_S = 300  # a hung job is killed: the tests always end

sys.path.insert(0, str(ROOT / "tests"))
import fsdp_accumulation_worker as worker  # the stall phase's timeout
import fsdp_worker  # the worker's models, data and per-example losses, for the references
from test_fsdp import float64, replayed_noise
from test_fsdp_make_private import _dp_accounting_epsilon, check_updates


def _run(out: Path, phase: str) -> list[dict]:
    out.mkdir(parents=True)
    (out / "phase").write_text(phase)
    results, logs, _ = run_rank_job(WORKER, 2, out, JOB_TIME_LIMIT_S)
    for rank, result in enumerate(results):
        assert "traceback" not in result, f"rank {rank}: {result['traceback']}\n{logs[rank][-3000:]}"
    return results


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What each of the 2 ranks saw in the virtual-step scenarios."""
    return _run(tmp_path_factory.mktemp("fsdp_accumulation") / "job", "accumulate")


def check_micro_batches(ranks: list[dict]) -> None:
    """Both ranks ran the same number of micro-batches per logical step, and at least one step had several."""
    counts = [rank["micro_batches"] for rank in ranks]
    assert all(c == counts[0] for c in counts), counts
    assert max(counts[0]) >= 2, "the test needs a logical batch cut into several micro-batches"


@pytest.mark.slow  # a 2-rank job (about 20 s on 2 cores)
def test_micro_batches_of_an_mlp_release_the_clipped_sum_of_the_whole_logical_batch(accumulated):
    ranks = [rank["mlp"] for rank in accumulated]
    check_micro_batches(ranks)
    # Local batches of different sizes: a rank ran empty micro-batches to match the other's count.
    assert any(len(r["indices"][s]) < r["micro_batches"][s] for r in ranks for s in range(len(r["indices"])))
    with float64():
        dataset = fsdp_worker.IndexedData(40)
    check_updates(ranks, fsdp_worker.mlp, dataset, fsdp_worker.mlp_losses, clip=1.0, lr=0.5)


@pytest.mark.slow  # a 2-rank job (about 20 s on 2 cores)
def test_micro_batches_of_a_transformer_release_the_clipped_sum_of_the_whole_logical_batch(accumulated):
    ranks = [rank["transformer"] for rank in accumulated]
    check_micro_batches(ranks)
    with float64():
        dataset = fsdp_worker.TokenData(32)
    check_updates(ranks, fsdp_worker.transformer, dataset, fsdp_worker.token_losses, clip=0.5, lr=0.5)


@pytest.mark.slow  # a 2-rank job (about 20 s on 2 cores)
def test_virtual_steps_draw_the_noise_once_per_logical_step(accumulated):
    ranks = [rank["noise_only"] for rank in accumulated]  # zero losses: each update is the noise alone
    check_micro_batches(ranks)
    batch = ranks[0]["expected_batch_size"]
    replays = [ShardNoise(noise_multiplier=2.0, max_grad_norm=1.5, seed=14, rank=rank) for rank in range(2)]
    for step in range(3):
        for before, after in zip(ranks[0]["params"][step], ranks[0]["params"][step + 1]):
            released = (before - after) / 0.5 * batch
            torch.testing.assert_close(released, replayed_noise(released, replays), rtol=1e-9, atol=1e-9)


@pytest.mark.slow  # a 2-rank job (about 20 s on 2 cores)
def test_virtual_steps_spend_one_poisson_gaussian_step_per_logical_batch(accumulated):
    ranks = [rank["noise_only"] for rank in accumulated]
    assert sum(ranks[0]["micro_batches"]) > 3
    assert {rank["steps"] for rank in ranks} == {3}
    assert ranks[0]["sample_rate"] == pytest.approx(8 / 40)
    assert ranks[0]["epsilon"] == pytest.approx(_dp_accounting_epsilon(2.0, 3), rel=1e-9)
    assert {rank["epsilon"] for rank in ranks} == {ranks[0]["epsilon"]}


@pytest.mark.slow  # a 2-rank job (about 20 s on 2 cores)
def test_a_loop_left_between_micro_batches_releases_and_records_nothing_of_that_batch(accumulated):
    ranks = [rank["left_mid_batch"] for rank in accumulated]
    for rank in ranks:
        assert rank["open_after_first"] == 1, "the test needs the first logical batch cut into several micro-batches"
        assert "between micro-batches" in (rank["state_dict_mid_batch"] or ""), rank["state_dict_mid_batch"]
        assert any("partial clipped sum is discarded" in message for message in rank["warnings"]), rank["warnings"]
        assert rank["unchanged"] and rank["steps_after_leaving"] == 0 and rank["steps"] == 1
    # The next logical step releases its own batch's clipped sum only (nothing of the discarded part).
    with float64():
        dataset = fsdp_worker.IndexedData(40)
    check_updates(ranks, fsdp_worker.mlp, dataset, fsdp_worker.mlp_losses, clip=1.0, lr=0.5)


@pytest.mark.slow  # a 2-rank job; the live rank waits the process group's timeout (about 15 s on 2 cores)
@pytest.mark.parametrize("where, point", [("forward", "the training forward of private step 1"),
                                          ("step", "private step 1 (before the clipping passes)")])  # fmt: skip
def test_a_stalled_rank_makes_the_others_raise_a_distributed_step_error_naming_the_stall(tmp_path, where, point):
    ranks = _run(tmp_path / "job", f"stall_{where}")
    live, stalled = ranks[0]["stall"], ranks[1]["stall"]
    error = live["error"]
    assert error is not None and error.startswith("DistributedStepError"), error
    assert "stalled" in error and point in error and f"timeout {worker.STALL_TIMEOUT_S:g} s" in error, error
    # Rank 0 raised while rank 1 was still asleep (it sleeps until rank 0 has raised, or a cap it did not reach).
    assert stalled["woken_by_rank0"]
