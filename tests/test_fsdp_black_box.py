"""The black-box privacy test of the FSDP2 path: ``engine.make_private`` on a ``fully_shard`` model, the user's own
loop, noise off — removing one example from the dataset moves the released sum by at most the clip norm C.

The released sum of one step is (parameters before - after) x expected batch size / lr (SGD, lr 1, no noise). Each
case runs one step on a dataset D and one on D less example k, in one job of gloo ranks
(tests/fsdp_black_box_worker.py, hard time limit), from the same initial parameters. The sampling makes the other
examples' draws the same in both runs (q = 1 Poisson sampling: every example is in the batch; BandMF: the last
example removed, the runs' batches compared), so the difference of the two releases is the contribution of
example k alone, which the clipping must bound by C whichever rank's shard held it (and even though the examples
after k move to other ranks in D less k). Each case shows that it can fail: example k's own gradient is longer
than C (a float64 per-example loop on the unsharded model), and the full release is longer than 2C. The
difference must also be example k's clipped gradient itself (the same loop), so a release that loses part of an
example cannot pass either.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import run_rank_job
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import PrivacyEngine
from privacy_engine.engine import mechanism_choice
from privacy_engine.engine.mechanism_choice import noise_vector_bytes
from privacy_engine.engine.options import PrivacyOptions
from privacy_engine.engine.sharded import fsdp_options

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "fsdp_black_box_worker.py"
JOB_TIME_LIMIT_S = 300  # a hung job is killed: the tests always end
SLACK = 1e-6  # relative: float64 sums of a dozen examples (measured: within 7e-16 of C)

sys.path.insert(0, str(ROOT / "tests"))
import fsdp_black_box_worker as worker  # the cases' settings
import fsdp_worker  # the models and data, unsharded, for the float64 reference
from test_fsdp import clipped_sum, float64


def _run(world_size: int, out: Path, phase: str) -> dict[str, list[dict]]:
    """Run ``phase`` on ``world_size`` ranks; what every rank saw, by run name."""
    out.mkdir(parents=True)
    (out / "phase").write_text(phase)
    results, logs, _ = run_rank_job(WORKER, world_size, out, JOB_TIME_LIMIT_S)
    for rank, result in enumerate(results):
        assert "traceback" not in result, f"rank {rank}: {result['traceback']}\n{logs[rank][-3000:]}"
    return {name: [result[name] for result in results] for name in results[0] if name not in ("rank", "world_size")}


@pytest.fixture(scope="module")
def main_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    return _run(2, tmp_path_factory.mktemp("fsdp_black_box") / "main", "main")


def _reference(case: dict):
    """The unsharded float64 model, dataset and per-example losses of ``case`` (the ranks ran the same)."""
    build = {"mlp": fsdp_worker.mlp, "transformer": fsdp_worker.transformer, "lora": fsdp_worker.lora_decoder}
    losses = {"mlp": fsdp_worker.mlp_losses, "transformer": fsdp_worker.token_losses,
              "lora": fsdp_worker.decoder_losses}  # fmt: skip
    return build[case["model"]](), worker.data_of(case), losses[case["model"]]


def _release(ranks: list[dict]) -> list[torch.Tensor]:
    """The released sum: (before - after) x expected batch size / lr (lr 1), every rank holding the same."""
    first = ranks[0]
    for other in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other["after"], first["after"]))
    return [(before - after) * first["expected_batch_size"] for before, after in zip(first["before"], first["after"])]


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))


def check_neighbours(job: dict[str, list[dict]], name: str, removed: list[int]) -> None:
    case = worker.CASES[name]
    clip, size = case["max_grad_norm"], case["size"]
    full = job[f"{name}/full"]
    union = sorted(i for rank in full for i in rank["indices"])
    if "batch_size" in case:  # Poisson with q < 1: the examples drawn, and the batch size the user asked for
        want_batch_size = [case["batch_size"]] * 2
    else:  # q = 1: every example in the step; the expected batch is the dataset's size
        assert union == list(range(size))
        want_batch_size = [size, size - 1]
    assert full[0]["expected_batch_size"] == want_batch_size[0]
    released = _release(full)
    assert _norm(released) > 2 * clip, "the full release must be able to exceed C by far (else the test cannot fail)"
    with float64():
        model, dataset, losses_of = _reference(case)
        for theirs, ours in zip(full[0]["before"], model.parameters()):
            assert torch.equal(theirs, ours.detach())
        trainable = [position for position, p in enumerate(model.parameters()) if p.requires_grad]
        for k in removed:
            neighbour = job[f"{name}/without{k}"]
            assert all(rank["steps"] == 1 for rank in full + neighbour)
            assert k in union, f"example {k} must be in the full run's batch"
            # The other examples' draws are unchanged: the neighbour's batch is the full one less example k.
            assert sorted(i for rank in neighbour for i in rank["indices"]) == [i for i in union if i != k]
            assert neighbour[0]["expected_batch_size"] == want_batch_size[1]
            assert all(torch.equal(a, b) for a, b in zip(neighbour[0]["before"], full[0]["before"]))
            difference = [a - b for a, b in zip(released, _release(neighbour))]
            assert _norm(difference) <= clip * (1 + SLACK), (name, k, _norm(difference), clip)
            assert all(float(difference[p].abs().max()) == 0 for p in range(len(difference)) if p not in trainable)
            # Example k alone: its own gradient is longer than C, so the bound is the clipping's doing ...
            unclipped = clipped_sum(model, losses_of, dataset, [k], float("inf"))
            assert _norm(unclipped) > 1.5 * clip, (name, k, _norm(unclipped))
            # ... and the difference is exactly its clipped gradient (nothing of it lost, nothing else moved).
            for position, want in zip(trainable, clipped_sum(model, losses_of, dataset, [k], clip)):
                torch.testing.assert_close(difference[position], want, rtol=1e-6, atol=1e-9 * clip)


@pytest.mark.slow  # two processes importing torch: 8-16 s on 2 cores (the default run's budget is spent)
def test_removing_an_example_moves_the_mlp_release_by_at_most_the_clip_norm(tmp_path):
    """The quick case (2 ranks, one step each way): mean loss, the removed example on rank 0's shard."""
    job = _run(2, tmp_path / "quick", "quick")
    assert [i for i in job["mlp_mean/full"][0]["indices"]] == [0, 2, 4, 6, 8, 10]  # example 4: rank 0's shard
    check_neighbours(job, "mlp_mean", [4])


@pytest.mark.slow  # one 2-rank job: 15 one-step runs and auto's calibration (about 40 s on 2 cores)
@pytest.mark.parametrize("name", ["mlp_mean", "mlp_sum"])
def test_removing_an_example_from_either_ranks_shard_moves_the_mlp_release_by_at_most_c(main_job, name):
    ranks_holding = [[rank for rank, seen in enumerate(main_job[f"{name}/full"]) if k in seen["indices"]]
                     for k in worker.CASES[name]["removed"]]  # fmt: skip
    assert ranks_holding == [[0], [1]]
    check_neighbours(main_job, name, worker.CASES[name]["removed"])


@pytest.mark.slow  # one 2-rank job: 15 one-step runs and auto's calibration (about 40 s on 2 cores)
@pytest.mark.parametrize("name", ["transformer", "lora"])
def test_removing_an_example_moves_a_transformers_release_by_at_most_c(main_job, name):
    check_neighbours(main_job, name, worker.CASES[name]["removed"])


@pytest.mark.slow  # one 2-rank job: 15 one-step runs and auto's calibration (about 40 s on 2 cores)
def test_removing_an_example_moves_a_virtual_steps_release_by_at_most_c(main_job):
    full = main_job["virtual/full"]
    assert all(rank["micro_batches"] == 3 for rank in full)  # the logical batch was cut into micro-batches
    check_neighbours(main_job, "virtual", [5])


@pytest.mark.slow  # one 2-rank job: 15 one-step runs and auto's calibration (about 40 s on 2 cores)
def test_removing_an_example_moves_a_bandmf_release_by_at_most_c(main_job):
    full = main_job["bandmf/full"]
    assert 19 in full[0]["indices"] and full[0]["sample_rate"] == pytest.approx(2 * 9 / 20)
    assert main_job["bandmf/without19"][0]["sample_rate"] == pytest.approx(2 * 9 / 19)
    check_neighbours(main_job, "bandmf", [19])


@pytest.mark.slow  # a 4-rank job of 2 runs (about 15 s on 2 cores)
def test_removing_an_example_moves_the_release_of_four_ranks_by_at_most_c(tmp_path):
    job = _run(4, tmp_path / "four", "four")
    assert 3 in job["four_ranks/full"][3]["indices"]  # rank 3's shard
    check_neighbours(job, "four_ranks", [3])


# ------------------------------------------------------------------------------ noise memory of "auto" per rank
@pytest.mark.slow  # one 2-rank job: 15 one-step runs and auto's calibration (about 40 s on 2 cores)
def test_the_noise_memory_of_a_sharded_model_counts_the_largest_ranks_shards(main_job):
    ranks = main_job["auto_memory"]
    local = ranks[0]["local_bytes"]  # what each rank holds of the trainable parameters
    assert local[0] > local[1], "the test needs uneven shards"
    assert {rank["counted"] for rank in ranks} == {max(local)}  # the same number on every rank
    assert ranks[0]["full_bytes"] == sum(local) > max(local)


@pytest.mark.slow  # one 2-rank job: 15 one-step runs and auto's calibration (about 40 s on 2 cores)
def test_auto_under_fsdp_counts_one_ranks_noise_memory_against_max_noise_memory(main_job):
    ranks = main_job["auto_memory"]
    counted, budget = ranks[0]["counted"], ranks[0]["budget"]
    for rank in ranks:
        rows = {(c["mechanism"], c["num_bands"], c["num_buffers"]): c for c in rank["candidates"]}
        assert rows[("gaussian", 1, None)]["noise_memory_bytes"] == counted
        assert rows[("bandmf", 2, None)]["noise_memory_bytes"] == 2 * counted <= budget
        chosen = [c for c in rank["candidates"] if c["chosen"]]
        assert [(c["mechanism"], c["num_bands"]) for c in chosen] == [("bandmf", 2)]  # fits per rank only
        assert all(c["fits_memory"] == (c["noise_memory_bytes"] <= budget) for c in rank["candidates"])
        # What the rank's noise holds (its shard's draw and b - 1 history rows) is within what was counted.
        held = (rank["history_numel"] + rank["local_numel"]) * rank["element_size"]
        assert held <= chosen[0]["noise_memory_bytes"]
    assert (ranks[0]["history_numel"] + ranks[0]["local_numel"]) * ranks[0]["element_size"] == 2 * counted


class _Mesh:
    def __init__(self, *sizes: int) -> None:
        self.sizes = sizes

    def size(self, mesh_dim: int) -> int:
        return self.sizes[mesh_dim]


class _Sharded(torch.Tensor):
    """A plain tensor standing for a DTensor of this global shape: only what ``noise_vector_bytes`` reads."""

    @staticmethod
    def __new__(cls, shape, placements, mesh, dtype=torch.float64):
        tensor = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype))
        tensor.placements, tensor.device_mesh = placements, mesh
        return tensor


def test_noise_vector_bytes_counts_the_largest_local_shard_of_each_sharded_parameter():
    plain = [torch.zeros(7, 3), torch.zeros(5, dtype=torch.float64)]
    assert noise_vector_bytes(plain) == 7 * 3 * 4 + 5 * 8  # one process: every entry
    cases = [
        (_Sharded((7, 3), (Shard(0),), _Mesh(2)), 4 * 3 * 8),  # uneven: rank 0 holds ceil(7 / 2) rows
        (_Sharded((7, 3), (Shard(1),), _Mesh(2)), 7 * 2 * 8),  # another dimension sharded
        (_Sharded((2, 3), (Shard(0),), _Mesh(4)), 1 * 3 * 8),  # fewer rows than ranks: one row, others none
        (_Sharded((0, 3), (Shard(0),), _Mesh(2)), 0),
        (_Sharded((7, 3), (Replicate(),), _Mesh(2)), 7 * 3 * 8),  # every rank holds all of it
        (_Sharded((9, 3), (Replicate(), Shard(0)), _Mesh(2, 4)), 3 * 3 * 8),  # HSDP: sharded over 4 only
        (_Sharded((9, 5), (Shard(0), Shard(1)), _Mesh(2, 2), torch.float32), 5 * 3 * 4),
    ]  # fmt: skip
    for param, want in cases:
        assert noise_vector_bytes([param]) == want, (param.shape, param.placements)
    assert noise_vector_bytes([param for param, _ in cases]) == sum(want for _, want in cases)


def test_a_sharded_build_accepts_a_noise_memory_budget_for_auto():
    options = PrivacyOptions(max_grad_norm=1.0, noise_mechanism="auto", target_epsilon=3.0, target_delta=1e-5,
                             epochs=2, max_noise_memory=1000)  # fmt: skip
    assert fsdp_options(options, nn.Linear(2, 2)).max_noise_memory == 1000


@pytest.mark.slow  # one process, auto's calibrations (about 3 s each on 2 cores)
@pytest.mark.parametrize("winner, bands, buffers, batch_size, epochs, target_epsilon", [
    ("bandmf(b=2)", (1, 2), (), 8, 2, 3.0),
    ("blt(d=2, b=2)", (1,), (2,), 20, 10, 8.0),
])  # fmt: skip
def test_auto_within_a_memory_budget_that_admits_correlated_noise_builds_it(monkeypatch, winner, bands, buffers,
                                                                            batch_size, epochs, target_epsilon):  # fmt: skip
    """The winner is planned as if named, without ``max_noise_memory`` (options accept it with "auto" only: BandMF
    or BLT winning under a budget raised ValueError before). Settings where each wins over DP-SGD."""
    monkeypatch.setattr(mechanism_choice, "CANDIDATE_NUM_BANDS", bands)
    monkeypatch.setattr(mechanism_choice, "CANDIDATE_NUM_BUFFERS", buffers)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    data = TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
    vector_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = PrivacyEngine(accountant="pld")
    engine.make_private_with_epsilon(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                     data_loader=DataLoader(data, batch_size=batch_size), target_epsilon=target_epsilon,
                                     target_delta=1e-5, epochs=epochs, max_grad_norm=1.0, noise_mechanism="auto",
                                     max_noise_memory=3 * vector_bytes)  # fmt: skip
    table = engine.noise_plan.mechanism_candidates
    assert [c.label for c in table if c.chosen] == [winner]
    assert all(c.fits_memory for c in table) and engine.noise_plan.mechanism == winner.split("(")[0]
