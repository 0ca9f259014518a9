"""Private training of FSDP2 (``fully_shard``) models: privacy_engine.training.fsdp, 2 and 4 ranks on gloo (CPU).

One job of 2 and one of 4 processes (tests/fsdp_worker.py, each spawned once per module, hard time limit) runs every scenario;
the tests compare what the ranks saw against independent references: a float64 per-example loop over the
union of the ranks' batches on the unsharded model, the shard noise replayed from its seeds, and
dp-accounting's epsilon of the single-process event. The noise streams and the argument checks are also
tested in process, without communication.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import dp_accounting
import pytest
import torch
from conftest import run_rank_job
from torch import nn

from privacy_engine.training.fsdp import FSDPGhostClipping, FSDPPrivateStep, ShardNoise, fsdp_problem

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "fsdp_worker.py"
JOB_TIME_LIMIT_S = 240  # a hung job is killed: the tests always end
PLD_GRID = 1e-3
DELTA = 1e-5

sys.path.insert(0, str(ROOT / "tests"))
import fsdp_worker  # the worker's models and data, for the references


@contextlib.contextmanager
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# ------------------------------------------------------------------------------ the job
@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What every rank saw (a list indexed by rank), for a job of 2 and of 4 ranks."""
    world_size = request.param
    out = tmp_path_factory.mktemp(f"fsdp{world_size}")
    results, logs, _ = run_rank_job(WORKER, world_size, out, JOB_TIME_LIMIT_S)
    for rank, result in enumerate(results):
        # Rank 1 raises on purpose in the last scenario, and nowhere else.
        if rank == 1:
            assert "rank 1 failed on purpose" in result.get("traceback", ""), logs[1][-3000:]
        else:
            assert "traceback" not in result, result["traceback"]
    return results


# ------------------------------------------------------------------------------ references
def clipped_sum(model: nn.Module, losses_of, dataset, indices: list[int], clip: float) -> list[torch.Tensor]:
    """sum_i min(1, C / ||g_i||) g_i over the trainable parameters by its definition: each example's own
    backward, one at a time."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for index in indices:
        model.zero_grad()
        batch = [torch.as_tensor(part).unsqueeze(0) for part in dataset[index]]
        losses_of(model, batch).sum().backward()
        grads = [p.grad.clone() for p in params]
        factor = min(1.0, clip / float(torch.sqrt(sum((g**2).sum() for g in grads))))
        for t, g in zip(total, grads):
            t.add_(g, alpha=factor)
    return total


def check_against_one_process(job, scenario: str, build, dataset, losses_of, *, clip: float, lr: float) -> None:
    ranks = [result[scenario] for result in job]
    assert {rank["expected_batch_size"] for rank in ranks} == {8.0}
    with float64():
        model = build()
        for theirs, ours in zip(ranks[0]["params"][0], model.parameters()):
            torch.testing.assert_close(theirs, ours.detach(), rtol=0, atol=0)
        for step in range(len(ranks[0]["clipped_sums"])):
            union = [index for rank in ranks for index in rank["indices"][step]]
            assert len(union) == len(set(union)), "an example was on two ranks"
            expected = clipped_sum(model, losses_of, dataset, union, clip)
            scale = max(float(e.abs().max()) for e in expected)
            assert scale > 0
            # Absolute slack relative to the whole vector: some entries are exactly zero in exact arithmetic (a
            # key bias shifts every attention score of a query alike) and rounding-sized here.
            for position, want in enumerate(expected):
                got = ranks[0]["clipped_sums"][step][position]
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-12 * scale)
                for other in ranks[1:]:
                    torch.testing.assert_close(other["clipped_sums"][step][position], got, rtol=0, atol=0)
            with torch.no_grad():
                for param, want in zip([p for p in model.parameters() if p.requires_grad], expected):
                    param.sub_(lr * want / 8.0)
            for position, want in enumerate(model.parameters()):
                got = ranks[0]["params"][step + 1][position]
                torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-12)
                for other in ranks[1:]:
                    torch.testing.assert_close(other["params"][step + 1][position], got, rtol=0, atol=0)


@pytest.mark.slow  # the 2- and 4-process jobs this module spawns (about 15 s and 35 s on 2 cores)
def test_two_sharded_ranks_release_the_single_process_clipped_sum_of_an_mlp(job):
    with float64():
        dataset = fsdp_worker.IndexedData(40)
    check_against_one_process(job, "mlp", fsdp_worker.mlp, dataset, fsdp_worker.mlp_losses, clip=1.0, lr=0.5)


@pytest.mark.slow  # the 2- and 4-process jobs this module spawns (about 15 s and 35 s on 2 cores)
def test_blocks_sharded_separately_give_the_same_clipped_sum(job):
    with float64():
        dataset = fsdp_worker.IndexedData(40)
    check_against_one_process(job, "mlp_blocks", fsdp_worker.mlp, dataset, fsdp_worker.mlp_losses, clip=0.7, lr=0.5)


@pytest.mark.slow  # the 2- and 4-process jobs this module spawns (about 15 s and 35 s on 2 cores)
def test_a_lora_hf_decoder_trains_only_its_adapters_with_the_single_process_clipped_sum(job):
    with float64():
        dataset = fsdp_worker.TokenData(32)
        frozen = [not p.requires_grad for p in fsdp_worker.lora_decoder().parameters()]
    assert any(frozen) and not all(frozen)
    first, last = job[0]["lora"]["params"][0], job[0]["lora"]["params"][-1]
    assert all(torch.equal(a, b) for a, b, is_frozen in zip(first, last, frozen) if is_frozen)
    check_against_one_process(job, "lora", fsdp_worker.lora_decoder, dataset, fsdp_worker.decoder_losses,
                              clip=0.5, lr=0.5)  # fmt: skip


@pytest.mark.slow  # the 2- and 4-process jobs this module spawns (about 15 s and 35 s on 2 cores)
def test_a_rank_with_an_empty_local_batch_takes_part_and_adds_nothing(job):
    assert job[1]["empty"]["indices"] == [[], []]
    assert job[0]["empty"]["indices"][0], "the test needs examples on rank 0"
    with float64():
        dataset = fsdp_worker.IndexedData(40)
    check_against_one_process(job, "empty", fsdp_worker.mlp, dataset, fsdp_worker.mlp_losses, clip=1.0, lr=0.5)


@pytest.mark.slow  # the 2- and 4-process jobs this module spawns (about 15 s and 35 s on 2 cores)
def test_a_sharded_transformer_releases_the_single_process_clipped_sum(job):
    with float64():
        dataset = fsdp_worker.TokenData(32)
    check_against_one_process(job, "transformer", fsdp_worker.transformer, dataset, fsdp_worker.token_losses,
                              clip=0.5, lr=0.5)  # fmt: skip


def shard_rows(length: int, rank: int, world_size: int) -> slice:
    """FSDP2's dim-0 chunk of ``length`` rows held by ``rank`` (torch.chunk over the world size)."""
    chunk = -(-length // world_size)
    return slice(min(rank * chunk, length), min((rank + 1) * chunk, length))


def replayed_noise(like: torch.Tensor, replays: list[ShardNoise]) -> torch.Tensor:
    """The next noise of a parameter shaped ``like``, each rank's dim-0 shard from its own replayed stream."""
    expected = torch.zeros_like(like)
    for rank, replay in enumerate(replays):
        rows = shard_rows(like.shape[0], rank, len(replays))
        local = torch.zeros_like(expected[rows])
        local.grad = torch.zeros_like(local)
        replay.add_([local])
        expected[rows] = local.grad
    return expected


@pytest.mark.slow  # the 2- and 4-process jobs this module spawns (about 15 s and 35 s on 2 cores)
def test_each_shard_is_noised_once_from_its_ranks_own_stream(job):
    ranks = [result["noisy"] for result in job]
    world_size = len(ranks)
    sigma, clip, lr, batch = 2.0, 1.5, 1.0, ranks[0]["expected_batch_size"]
    replays = [ShardNoise(noise_multiplier=sigma, max_grad_norm=clip, seed=14, rank=rank) for rank in range(world_size)]
    noise_rows = []
    for step in range(4):
        for rank in ranks:  # zero losses: the release is the noise alone
            assert all(float(s.abs().max()) == 0 for s in rank["clipped_sums"][step])
        before, after = ranks[0]["params"][step], ranks[0]["params"][step + 1]
        for position, (param_before, param_after) in enumerate(zip(before, after)):
            for other in ranks[1:]:
                assert torch.equal(other["params"][step + 1][position], param_after)
            released = (param_before - param_after) / lr * batch
            torch.testing.assert_close(released, replayed_noise(released, replays), rtol=1e-9, atol=1e-9)
            noise_rows.append(released.reshape(-1) / batch)
    noise = torch.cat(noise_rows)
    # Per-coordinate std of the released update: sigma C / B (about 700 coordinates: 5 standard errors).
    relative_error = abs(float(noise.std()) / (sigma * clip / batch) - 1)
    assert relative_error < 5 / (2 * noise.numel()) ** 0.5


@pytest.mark.slow  # the 2- and 4-process jobs this module spawns (about 15 s and 35 s on 2 cores)
def test_epsilon_is_the_single_process_poisson_gaussian_event(job):
    ranks = [result["noisy"] for result in job]
    rank0 = ranks[0]
    assert {rank["steps"] for rank in ranks} == {4}
    assert rank0["sample_rate"] == pytest.approx(8 / 40)
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_GRID)
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(8 / 40, dp_accounting.GaussianDpEvent(2.0)), 4))  # fmt: skip
    assert rank0["epsilon"] == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-9)
    assert {rank["epsilon"] for rank in ranks} == {rank0["epsilon"]}


@pytest.mark.slow  # the 2- and 4-process jobs this module spawns (about 15 s and 35 s on 2 cores)
def test_a_crashed_rank_makes_the_others_raise_instead_of_hanging(job):
    for rank, result in enumerate(job):
        if rank != 1:
            error = result["crashed"]["error"]
            assert error is not None and "RuntimeError" in error, f"rank {rank}: {error}"


@pytest.mark.slow  # the 2- and 4-process jobs this module spawns (about 15 s and 35 s on 2 cores)
def test_make_private_refuses_hooks_mode_and_fsdp1_naming_what_to_do(job):
    refusals = job[0]["refusals"]
    assert "FSDP2" in refusals["hooks"] and "grad_sample_mode='ghost'" in refusals["hooks"]
    # Ghost and the default mode are built by make_private now (tests/test_fsdp_make_private.py).
    assert refusals["ghost"] is None and refusals["auto"] is None
    if "unavailable" in refusals["fsdp1"]:
        pytest.skip(f"FSDP1 on CPU unavailable here: {refusals['fsdp1']['unavailable']}")
    assert "FullyShardedDataParallel (FSDP1)" in refusals["fsdp1"]["error"]
    assert "fully_shard" in refusals["fsdp1"]["error"]


@pytest.mark.slow  # the 2- and 4-process jobs this module spawns (about 15 s and 35 s on 2 cores)
def test_float16_mixed_precision_is_refused_before_any_gradient(job):
    for result in job:
        assert "mixed precision" in result["mixed_precision"]["error"]
        assert all(result["mixed_precision"]["grads"])


@pytest.mark.slow  # the 2- and 4-process jobs this module spawns (about 15 s and 35 s on 2 cores)
def test_ranks_with_different_noise_settings_are_refused_on_every_rank(job):
    for result in job:
        error = result["mismatch"]["error"]
        assert error is not None and "noise_multiplier" in error and "rank 1: 1.5" in error


@pytest.mark.slow  # the 2- and 4-process jobs this module spawns (about 15 s and 35 s on 2 cores)
def test_a_layer_output_modified_in_place_is_refused_before_any_gradient(job):
    for result in job:
        assert "modified in place" in result["in_place"]["error"] and "'0'" in result["in_place"]["error"]
        assert all(result["in_place"]["grads"])


# ------------------------------------------------------------------------------ in process
def test_shard_noise_streams_are_distinct_per_rank_reproducible_and_uncorrelated():
    def draws(rank: int, seed: int = 3) -> torch.Tensor:
        grad = torch.zeros(20000)
        holder = torch.zeros(20000)
        holder.grad = grad
        ShardNoise(noise_multiplier=1.0, max_grad_norm=1.0, seed=seed, rank=rank).add_([holder])
        return grad

    first, again, second = draws(0), draws(0), draws(1)
    assert torch.equal(first, again)
    correlation = float(torch.corrcoef(torch.stack([first, second]))[0, 1])
    assert abs(correlation) < 4 / 20000**0.5
    assert abs(float(first.std()) - 1) < 4 / (2 * 20000) ** 0.5
    assert not torch.equal(draws(0, seed=4), first)


def test_secure_shard_noise_has_the_stated_std_and_refuses_a_seed():
    holder = torch.zeros(20000)
    holder.grad = torch.zeros(20000)
    ShardNoise(noise_multiplier=0.5, max_grad_norm=2.0, secure_mode=True, rank=0).add_([holder])
    assert abs(float(holder.grad.std()) - 1.0) < 4 / (2 * 20000) ** 0.5
    with pytest.raises(ValueError, match="seed must be None in secure_mode"):
        ShardNoise(noise_multiplier=1.0, max_grad_norm=1.0, seed=1, secure_mode=True)


def test_zero_noise_adds_nothing_and_bad_sigma_is_refused():
    holder = torch.zeros(5)
    holder.grad = torch.ones(5)
    ShardNoise(noise_multiplier=0.0, max_grad_norm=1.0, seed=0, rank=0).add_([holder])
    assert torch.equal(holder.grad, torch.ones(5))
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="noise_multiplier"):
            ShardNoise(noise_multiplier=bad, max_grad_norm=1.0, seed=0, rank=0)


def test_unsharded_models_and_plain_loaders_are_refused():
    model = nn.Linear(3, 2)
    assert fsdp_problem(model, "hooks") is None
    with pytest.raises(TypeError, match="fully_shard"):
        FSDPGhostClipping(model, max_grad_norm=1.0)
    noise = ShardNoise(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, rank=0)
    with pytest.raises(TypeError, match="distributed_data_loader"):
        FSDPPrivateStep(torch.optim.SGD(model.parameters(), lr=0.1), noise,
                        torch.utils.data.DataLoader(list(range(4)), batch_size=2))  # fmt: skip
