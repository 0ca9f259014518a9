"""``engine.make_private`` on FSDP2 (``fully_shard``) models with the user's ordinary loop: 2 and 4 gloo ranks.

One "main" job per world size runs every scenario (tests/fsdp_make_private_worker.py, hard time limit), then a
fresh set of ranks resumes from the checkpoint the main job wrote. The tests compare what the ranks saw with
a float64 per-example loop over the union of their batches on the unsharded model, with dp-accounting's
epsilon of the single-process event, and with the uninterrupted run. The pieces that need no process group
(the per-example surrogate, the option checks, the metadata unpickler) are tested in process.
"""

from __future__ import annotations

import io
import pickle
import sys
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from conftest import run_rank_job
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.utils.data import DataLoader

from accountants import make_accountant
from privacy_engine import PrivacyEngine
from privacy_engine.engine.bands import strategy_coefficients
from privacy_engine.engine.checkpoint.sharded import _MetadataUnpickler
from privacy_engine.engine.mechanism_choice import blt_strategy
from privacy_engine.engine.options import PrivacyOptions
from privacy_engine.engine.sharded import fsdp_options
from privacy_engine.noise import BandMFNoise
from privacy_engine.training.fsdp import ShardNoise
from privacy_engine.training.fsdp_private import OutputCapture, per_example_surrogate

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "fsdp_make_private_worker.py"
JOB_TIME_LIMIT_S = 300  # a hung job is killed: the tests always end
PLD_GRID = 1e-3
DELTA = 1e-5

sys.path.insert(0, str(ROOT / "tests"))
import fsdp_make_private_worker as worker  # the correlated-noise settings the job ran
import fsdp_worker  # the worker's models, data and per-example losses, for the references
import test_fsdp_noise as correlated  # the replayed draws and the dense C^{-1} Z reference of the sharded mechanisms
from test_fsdp import clipped_sum, float64, replayed_noise, shard_rows


def _run(world_size: int, out: Path, phase: str) -> list[dict]:
    out.mkdir(parents=True)
    (out / "phase").write_text(phase)
    results, logs, _ = run_rank_job(WORKER, world_size, out, JOB_TIME_LIMIT_S)
    for rank, result in enumerate(results):
        if phase == "main" and rank == 1:  # rank 1 raises on purpose in the last scenario, and nowhere else
            assert "rank 1 failed on purpose" in result.get("traceback", ""), logs[1][-3000:]
        else:
            assert "traceback" not in result, result["traceback"]
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    """(main job, resumed job): what every rank saw, for 2 and for 4 ranks."""
    root = tmp_path_factory.mktemp(f"fsdp_make_private{request.param}")
    main = _run(request.param, root / "main", "main")
    return main, _run(request.param, root / "resume", "resume")


def check_updates(ranks: list[dict], build, dataset, losses_of, *, clip: float, lr: float) -> None:
    """Every step's update (from the gathered parameters) is lr / (q N) times the clipped sum of a float64
    per-example loop over the union of the ranks' batches, on a model holding the same parameters."""
    assert {rank["type"] for rank in ranks} == {"FSDPPrivateOptimizer"}
    assert {rank["expected_batch_size"] for rank in ranks} == {8.0}
    with float64():
        model = build()
        for theirs, ours in zip(ranks[0]["params"][0], model.parameters()):
            assert torch.equal(theirs, ours.detach())
        for step in range(len(ranks[0]["indices"])):
            union = [index for rank in ranks for index in rank["indices"][step]]
            assert len(union) == len(set(union)), "an example was on two ranks"
            with torch.no_grad():
                for param, value in zip(model.parameters(), ranks[0]["params"][step]):
                    param.copy_(value)
            expected = clipped_sum(model, losses_of, dataset, union, clip)
            scale = max(float(e.abs().max()) for e in expected)
            assert scale > 0
            trainable = [i for i, p in enumerate(model.parameters()) if p.requires_grad]
            for position, want in zip(trainable, expected):
                before, after = ranks[0]["params"][step][position], ranks[0]["params"][step + 1][position]
                released = (before - after) * 8.0 / lr
                torch.testing.assert_close(released, want, rtol=1e-6, atol=1e-10 * scale)
            for other in ranks[1:]:
                assert all(torch.equal(a, b) for a, b in zip(other["params"][step + 1], ranks[0]["params"][step + 1]))


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_an_mlp_through_make_private_releases_the_single_process_clipped_sum(jobs):
    with float64():
        dataset = fsdp_worker.IndexedData(40)
    for scenario, clip in (("mlp", 1.0), ("mlp_sum", 0.7)):  # loss_reduction "mean" and "sum"
        check_updates([rank[scenario] for rank in jobs[0]], fsdp_worker.mlp, dataset, fsdp_worker.mlp_losses,
                      clip=clip, lr=0.5)  # fmt: skip


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_a_transformer_with_the_default_mode_releases_the_single_process_clipped_sum(jobs):
    with float64():
        dataset = fsdp_worker.TokenData(32)
    check_updates([rank["transformer"] for rank in jobs[0]], fsdp_worker.transformer, dataset,
                  fsdp_worker.token_losses, clip=0.5, lr=0.5)  # fmt: skip


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_a_lora_hf_decoder_trains_only_its_adapters_with_the_single_process_clipped_sum(jobs):
    ranks = [rank["lora"] for rank in jobs[0]]
    with float64():
        dataset = fsdp_worker.TokenData(32)
        frozen = [not p.requires_grad for p in fsdp_worker.lora_decoder().parameters()]
    assert any(frozen) and not all(frozen)
    first, last = ranks[0]["params"][0], ranks[0]["params"][-1]
    assert all(torch.equal(a, b) for a, b, is_frozen in zip(first, last, frozen) if is_frozen)
    check_updates(ranks, fsdp_worker.lora_decoder, dataset, fsdp_worker.decoder_losses, clip=0.5, lr=0.5)


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_a_rank_with_an_empty_batch_takes_part_on_a_padding_row_that_adds_nothing(jobs):
    ranks = [rank["lora_empty"] for rank in jobs[0]]
    assert ranks[1]["indices"] == [[], []]
    assert any(ranks[0]["indices"]), "the test needs examples on rank 0"
    with float64():
        dataset = fsdp_worker.TokenData(32)
    check_updates(ranks, fsdp_worker.lora_decoder, dataset, fsdp_worker.decoder_losses, clip=0.5, lr=0.5)


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_each_shard_is_noised_once_from_the_stream_its_rank_derives_from_noise_seed(jobs):
    ranks = [rank["noise_only"] for rank in jobs[0]]  # zero losses: each update is the noise alone
    world_size, batch = len(ranks), ranks[0]["expected_batch_size"]
    replays = [ShardNoise(noise_multiplier=2.0, max_grad_norm=1.5, seed=14, rank=rank) for rank in range(world_size)]
    for step in range(3):
        for before, after in zip(ranks[0]["params"][step], ranks[0]["params"][step + 1]):
            released = (before - after) / 0.5 * batch
            torch.testing.assert_close(released, replayed_noise(released, replays), rtol=1e-9, atol=1e-9)


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_a_checkpoint_of_other_settings_is_refused_before_anything_changes(jobs):
    for rank in jobs[1]:
        result = rank["wrong_resume"]
        assert result["error"] is not None and result["error"].startswith("CheckpointError")
        assert "noise_multiplier=0.8" in result["error"] and result["unchanged"] and result["steps"] == 0


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_bfloat16_mixed_precision_releases_the_clipped_sum_up_to_bfloat16_rounding(jobs):
    ranks = [rank["bfloat16"] for rank in jobs[0]]
    with float64():
        model, dataset = fsdp_worker.mlp(), fsdp_worker.IndexedData(40)
        union = [index for rank in ranks for index in rank["indices"][0]]
        expected = clipped_sum(model, fsdp_worker.mlp_losses, dataset, union, 1.0)
    for before, after, want in zip(ranks[0]["params"][0], ranks[0]["params"][1], expected):
        released = (before - after) * 8.0 / 0.5
        # bfloat16 compute (8-bit mantissa): about 1 % measured; float32 runs agree to 1e-6.
        assert float((released - want).norm() / want.norm()) < 3e-2


def _dp_accounting_epsilon(sigma: float, steps: int) -> float:
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_GRID)
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(8 / 40, dp_accounting.GaussianDpEvent(sigma)), steps))  # fmt: skip
    return accountant.get_epsilon(DELTA)


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_engine_epsilon_is_the_single_process_poisson_gaussian_event(jobs):
    ranks = [rank["noisy"] for rank in jobs[0]]
    assert {rank["steps"] for rank in ranks} == {4}
    assert ranks[0]["sample_rate"] == pytest.approx(8 / 40)
    assert ranks[0]["epsilon"] == pytest.approx(_dp_accounting_epsilon(1.3, 4), rel=1e-9)
    assert {rank["epsilon"] for rank in ranks} == {ranks[0]["epsilon"]}


# ------------------------------------------------------------------------------ BandMF / BLT through make_private
def check_correlated_release(ranks: list[dict], strategy, std_multiplier: float, settings: dict) -> None:
    """The released noise is row t of C^{-1} Z, Z assembled from each rank's replayed stream (seed noise_seed)."""
    released = correlated.released_noise(ranks, lr=0.5)
    shapes = [p.shape for p in ranks[0]["params"][0]]
    draws = correlated.replayed_draws(shapes, len(released), std_multiplier=std_multiplier,
                                      clip=settings["max_grad_norm"], seed=settings["noise_seed"],
                                      world_size=len(ranks))  # fmt: skip
    expected = correlated.correlated_reference(strategy, draws)
    for t, (got_step, want_step) in enumerate(zip(released, expected)):
        for got, want in zip(got_step, want_step):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=lambda m, t=t: f"step {t}: {m}")
    assert float(released[-1][0].abs().max()) > 0


def check_cyclic_groups(ranks: list[dict], bands: int) -> None:
    """Every rank holds the same b global groups, a partition of the dataset; step t samples only group t mod b."""
    groups = ranks[0]["groups"]
    assert len(groups) == bands and all(rank["groups"] == groups for rank in ranks)
    assert sorted(i for group in groups for i in group) == list(range(40))
    for step in range(len(ranks[0]["indices"])):
        union = [index for rank in ranks for index in rank["indices"][step]]
        assert set(union) <= set(groups[step % bands]), step


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_bandmf_through_make_private_releases_the_float64_clipped_sum_with_noise_off(jobs):
    ranks = [rank["bandmf_clean"] for rank in jobs[0]]
    assert {(rank["noise_type"], rank["mechanism"], rank["num_bands"]) for rank in ranks} == {
        ("ShardMechanismNoise", "bandmf", 2)}  # fmt: skip
    check_cyclic_groups(ranks, 2)
    with float64():
        dataset = fsdp_worker.IndexedData(40)
    check_updates(ranks, fsdp_worker.mlp, dataset, fsdp_worker.mlp_losses, clip=1.0, lr=0.5)


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_bandmf_through_make_private_releases_the_single_process_strategy_noise_from_the_ranks_streams(jobs):
    ranks = [rank["bandmf_noise"] for rank in jobs[0]]
    settings = worker.BANDMF_NOISE
    bands = settings["num_bands"]
    coefficients = strategy_coefficients(settings["total_steps"], bands)  # what a single process would build
    assert all(rank["noise_settings"]["coefficients"] == list(coefficients) for rank in ranks)
    check_cyclic_groups(ranks, bands)
    strategy = correlated.banded_toeplitz(coefficients, len(ranks[0]["indices"]))
    check_correlated_release(ranks, strategy, settings["noise_multiplier"] * float(np.linalg.norm(coefficients)),
                             settings)  # fmt: skip


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_bandmf_through_make_private_spends_the_single_process_cyclic_poisson_epsilon(jobs):
    ranks = [rank["bandmf_noise"] for rank in jobs[0]]
    settings = worker.BANDMF_NOISE
    bands, steps = settings["num_bands"], len(ranks[0]["indices"])
    rate = worker.BATCH * bands / 40
    assert {rank["steps"] for rank in ranks} == {steps} and ranks[0]["sample_rate"] == pytest.approx(rate)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(settings["noise_multiplier"])),
        -(-steps // bands),  # each example takes part at most once in every b consecutive steps
    )  # fmt: skip
    assert ranks[0]["epsilon"] == pytest.approx(correlated.pld_epsilon(event), rel=1e-9)
    assert {rank["epsilon"] for rank in ranks} == {ranks[0]["epsilon"]}


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_secure_mode_bandmf_noises_every_shard_at_the_strategy_std_from_each_ranks_os_stream(jobs):
    ranks = [rank["secure_bandmf"] for rank in jobs[0]]
    settings = worker.SECURE_BANDMF
    assert {rank["noise_type"] for rank in ranks} == {"ShardMechanismNoise"}
    coefficients = strategy_coefficients(settings["total_steps"], settings["num_bands"])
    # Step 0 releases z_0 / c_0, z_0 of std sigma ||c|| C (the strategy's column norm).
    sigma, clip = settings["noise_multiplier"], settings["max_grad_norm"]
    std = sigma * clip * float(np.linalg.norm(coefficients)) / coefficients[0]
    noise = torch.cat([entry.flatten() for entry in correlated.released_noise(ranks, lr=0.5)[0]])
    assert 0.75 * std < float(noise.std()) < 1.25 * std  # 171 draws: 25 % is more than 4 standard errors
    # No two ranks draw the same numbers: the first rows of two ranks' shards of the first weight differ.
    weight = correlated.released_noise(ranks, lr=0.5)[0][0]
    second = shard_rows(weight.shape[0], 1, len(ranks)).start
    assert not torch.equal(weight[:1], weight[second : second + 1])


def _blt_sensitivity(strategy, min_sep: int, steps: int) -> float:
    matrix = correlated.blt_toeplitz(strategy.buf_decay, strategy.output_scale, steps)
    return correlated.brute_force_sensitivity(matrix, min_sep)


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_blt_through_make_private_releases_its_noise_and_spends_the_single_process_epsilon(jobs):
    ranks = [rank["blt_noise"] for rank in jobs[0]]
    settings = worker.BLT_NOISE
    min_sep, total, steps = settings["num_bands"], settings["total_steps"], len(ranks[0]["indices"])
    strategy = blt_strategy(total, settings["num_buffers"], min_sep)  # what a single process would build
    for rank in ranks:
        assert rank["noise_type"] == "ShardMechanismNoise" and rank["mechanism"] == "blt"
        assert rank["noise_settings"]["buf_decay"] == list(strategy.buf_decay)
        assert rank["noise_settings"]["output_scale"] == list(strategy.output_scale)
        assert rank["noise_settings"]["min_sep"] == min_sep
    check_cyclic_groups(ranks, min_sep)
    sigma = settings["noise_multiplier"]
    check_correlated_release(ranks, correlated.blt_toeplitz(strategy.buf_decay, strategy.output_scale, steps),
                             sigma * _blt_sensitivity(strategy, min_sep, total), settings)  # fmt: skip
    # Draws at the sensitivity of total_steps, released over the steps run: Gaussian sigma * S_total / S_steps.
    multiplier = sigma * _blt_sensitivity(strategy, min_sep, total) / _blt_sensitivity(strategy, min_sep, steps)
    assert ranks[0]["epsilon"] == pytest.approx(correlated.pld_epsilon(dp_accounting.GaussianDpEvent(multiplier)),
                                                rel=1e-6)  # fmt: skip
    assert {rank["epsilon"] for rank in ranks} == {ranks[0]["epsilon"]}


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_auto_noise_calibrates_and_picks_what_a_single_process_picks_and_spends_its_epsilon(jobs):
    ranks = [rank["auto"] for rank in jobs[0]]
    with float64():
        engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=PLD_GRID))
        model = fsdp_worker.mlp()
        model, optimizer, loader = engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(fsdp_worker.IndexedData(40), batch_size=worker.BATCH), grad_sample_mode="ghost",
            noise_mechanism="auto", target_epsilon=3.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0)  # fmt: skip
        batches = iter(loader)
        for _ in range(3):  # the steps the sharded run took
            features, labels, _ = next(batches)
            nn.functional.cross_entropy(model(features), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert engine.noise_plan.mechanism != "gaussian"  # here "auto" picks correlated noise (BandMF, b = 2)
    for rank in ranks:
        assert rank["noise_type"] == "ShardMechanismNoise"
        assert (rank["mechanism"], rank["num_bands"]) == (engine.noise_plan.mechanism, engine.noise_plan.num_bands)
        assert rank["noise_multiplier"] == pytest.approx(engine.noise_plan.noise_multiplier, rel=1e-12)
        assert rank["epsilon"] == pytest.approx(engine.get_epsilon(DELTA), rel=1e-9)


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_make_private_with_epsilon_calibrates_for_the_global_loader_and_keeps_the_budget(jobs):
    ranks = [rank["calibrated"] for rank in jobs[0]]
    assert len({rank["noise_multiplier"] for rank in ranks}) == 1
    result = ranks[0]
    assert result["steps_per_epoch"] == 5 and result["steps"] == 3
    sigma = result["noise_multiplier"]
    assert _dp_accounting_epsilon(sigma, 10) <= 3.0 + 1e-9  # 2 epochs of 5 global steps stay within the target
    assert _dp_accounting_epsilon(sigma * 0.99, 10) > 3.0  # and sigma is not much larger than needed
    assert result["epsilon"] == pytest.approx(_dp_accounting_epsilon(sigma, 3), rel=1e-9)
    assert result["steps_left"] == 7


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_settings_fsdp_cannot_honour_are_refused_before_anything_changes(jobs):
    refusals = jobs[0][0]["refusals"]
    expected = {"hooks": "grad_sample_mode='ghost'", "functorch": "grad_sample_mode='ghost'",
                "mechanism_object": "noise_mechanism=BandMFNoise(...)", "per_layer": "clipping='per_layer'",
                "no_poisson": "poisson_sampling=False", "user_level": "privacy_unit='user'"}  # fmt: skip
    for name, words in expected.items():
        assert refusals[name]["error"] is not None and words in refusals[name]["error"], (name, refusals[name])
        assert refusals[name]["unchanged"], name


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_a_loop_that_breaks_the_step_contract_gets_a_clear_error_and_releases_nothing(jobs):
    for rank in jobs[0]:
        result = rank["loop_errors"]
        assert "before loss.backward()" in result["step_before_backward"]
        assert "second training forward" in result["second_forward"]
        assert result["unchanged"] and result["steps"] == 0 and result["steps_after"] == 1


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_ranks_with_different_settings_are_refused_on_every_rank(jobs):
    for rank in jobs[0]:
        error = rank["mismatch"]["error"]
        assert error is not None and "noise_multiplier" in error and "rank 1: 1.5" in error


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
@pytest.mark.parametrize("scenario", ["resumable", "resumable_bandmf"])
def test_a_fresh_set_of_ranks_resumes_bit_identically_from_a_sharded_checkpoint(jobs, scenario):
    main, resumed = jobs
    for before, after in zip(main, resumed):
        uninterrupted, again = before[scenario], after[scenario]
        if scenario == "resumable_bandmf":  # the correlated noise's history is part of what resumes
            assert uninterrupted["history_numel"] > 0 and again["history_numel"] == uninterrupted["history_numel"]
        assert again["indices"] == uninterrupted["indices"][2:]
        assert all(torch.equal(a, b) for a, b in zip(again["params"], uninterrupted["params"]))
        assert not all(torch.equal(a, b) for a, b in zip(again["params"], uninterrupted["params_at_checkpoint"]))
        assert again["steps"] == uninterrupted["steps"] == 4
        assert again["epsilon"] == uninterrupted["epsilon"]


@pytest.mark.slow  # the 2- and 4-rank jobs (about 30 s and 60 s on 2 cores)
def test_a_crashed_rank_makes_the_others_raise_instead_of_hanging(jobs):
    for rank, result in enumerate(jobs[0]):
        if rank != 1:
            error = result["crashed"]["error"]
            # The engine's agreement before the next forward's all-gathers: a clear error, not the backend's.
            assert error is not None and error.startswith("DistributedStepError"), f"rank {rank}: {error}"
            assert "training forward" in error and "died or stalled" in error, error


@pytest.mark.slow  # two ranks run tutorials/fsdp_lora.py --quick (about 30 s on 2 cores)
def test_the_fsdp_lora_tutorial_runs_on_two_ranks_and_spends_its_epsilon(tmp_path):
    out = tmp_path / "tutorial"
    out.mkdir()
    (out / "phase").write_text("tutorial")
    results, logs, codes = run_rank_job(WORKER, 2, out, JOB_TIME_LIMIT_S)
    assert codes == [0, 0], logs[0][-3000:]
    (_, public_accuracy, none), (name, private_accuracy, epsilon) = results[0]["rows"]
    assert none is None and "FSDP2 x2" in name
    assert 0.9 * 3.0 <= epsilon <= 3.0  # calibrated to the target over the run's epochs
    assert private_accuracy > public_accuracy + 0.1  # the adapters learnt the digits 5-9 the public model never saw
    assert "DP LoRA, FSDP2 x2" in logs[0]


# ------------------------------------------------------------------------------ in process
class _Two(nn.Module):
    """Two outputs (a tuple), both batch-first, only the first reaching the loss in one test."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.head(h), self.aux(h)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_surrogate_gradient_of_each_example_is_its_own_gradient(reduction):
    with float64():
        torch.manual_seed(0)
        model, x, y = _Two(), torch.randn(5, 4), torch.randint(0, 3, (5,))
        capture = OutputCapture(model)
        logits, aux = model(x)
        loss = nn.functional.cross_entropy(logits, y, reduction=reduction) + (aux**2).sum(1).mean() * (
            5 if reduction == "sum" else 1)  # fmt: skip
        loss.backward()
        surrogate = per_example_surrogate(capture.take(), loss_reduction=reduction)
        capture.remove()  # the reference below runs the plain model
        for i in range(5):
            ours = torch.autograd.grad(surrogate[i], list(model.parameters()), retain_graph=True)
            logits_i, aux_i = model(x[i : i + 1])
            own = nn.functional.cross_entropy(logits_i, y[i : i + 1]) + (aux_i**2).sum()
            want = torch.autograd.grad(own, list(model.parameters()))
            for a, b in zip(ours, want):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_the_surrogate_refuses_a_step_before_backward_and_allows_an_empty_batch():
    model = _Two()
    capture = OutputCapture(model)
    model(torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="before loss.backward"):
        per_example_surrogate(capture.take(), loss_reduction="mean")
    logits, _ = model(torch.randn(0, 4))
    assert logits.shape == (0, 3) and capture.last_padded  # the model ran on one padding row
    surrogate = per_example_surrogate(capture.take(), loss_reduction="mean")
    assert surrogate.shape == (1,) and float(surrogate.abs().sum()) == 0 and surrogate.grad_fn is not None
    with pytest.raises(RuntimeError, match="no training forward"):
        capture.take()
    model.eval()
    out = model(torch.randn(2, 4))
    assert out[0].grad_fn is not None  # eval mode: outputs pass unchanged
    capture.remove()


@pytest.mark.parametrize("setting, words", [
    ({"noise_mechanism": BandMFNoise((1.0, 0.5))}, "noise_mechanism=BandMFNoise(...)"),
    ({"max_batch_size": 10}, "max_batch_size=10"),
    ({"clipping": "adaptive", "target_unclipped_quantile": 0.5, "clipbound_learning_rate": 0.2, "max_clipbound": 5.0,
      "min_clipbound": 0.1, "unclipped_num_std": 1.0}, "clipping='adaptive'"),
    ({"batch_first": False}, "batch_first=False"),
    ({"grad_sample_mode": "no_op"}, "grad_sample_mode='ghost'"),
])  # fmt: skip
def test_options_a_sharded_run_cannot_honour_are_refused_by_name(setting, words):
    options = PrivacyOptions(noise_multiplier=1.0, max_grad_norm=1.0, **setting)
    with pytest.raises(NotImplementedError, match=words.replace("(", r"\(").replace(")", r"\)")):
        fsdp_options(options, nn.Linear(2, 2))


def test_the_default_mode_becomes_ghost_and_accepted_settings_pass():
    options = PrivacyOptions(noise_multiplier=1.0, max_grad_norm=2.0, noise_seed=3, loss_reduction="sum",
                             max_epsilon=5.0, target_delta=1e-5)  # fmt: skip
    assert fsdp_options(options, nn.Linear(2, 2)).grad_sample_mode == "ghost"


@pytest.mark.parametrize("setting", [
    {"noise_mechanism": "bandmf", "num_bands": 2, "total_steps": 4},
    {"noise_mechanism": "bandmf", "bandmf_coefficients": (1.0, 0.5)},
    {"noise_mechanism": "blt", "total_steps": 4, "num_buffers": 2},
    {"noise_mechanism": "auto", "target_epsilon": 3.0, "target_delta": 1e-5, "epochs": 2},
])  # fmt: skip
def test_correlated_noise_settings_pass_to_the_sharded_build(setting):
    sigma = {} if "target_epsilon" in setting else {"noise_multiplier": 1.0}  # "auto" compares at one epsilon
    options = PrivacyOptions(max_grad_norm=1.0, **sigma, **setting)
    assert fsdp_options(options, nn.Linear(2, 2)).noise_mechanism == setting["noise_mechanism"]


def test_the_metadata_unpickler_builds_dcp_metadata_and_refuses_any_other_global():
    class Payload:
        def __reduce__(self):
            return (print, ("ran code",))

    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(Payload()))).load()
    metadata = Metadata(state_dict_metadata={"w": TensorStorageMetadata(
        TensorProperties(dtype=torch.float64), torch.Size([4]), [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))])})  # fmt: skip
    loaded = _MetadataUnpickler(io.BytesIO(pickle.dumps(metadata))).load()
    assert loaded.state_dict_metadata["w"].size == torch.Size([4])
    assert loaded.state_dict_metadata["w"].properties.dtype == torch.float64


def test_dcp_non_tensor_items_are_read_as_plain_data_only():
    """DCP loads a checkpoint's non-tensor items (the optimizer's hyperparameters) with
    ``torch.load(weights_only=False)``; the planner the sharded load uses refuses a pickle naming any other
    global before DCP unpickles it, and hands plain data to DCP unchanged."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from privacy_engine.engine.checkpoint.file import CheckpointError
    from privacy_engine.engine.checkpoint.sharded import _SafeLoadPlanner

    class Payload:
        def __reduce__(self):
            return (print, ("ran code",))

    def item(name):
        index = MetadataIndex(name)
        return ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size([0]),
                        storage_index=index, storage_offsets=torch.Size([0]), lengths=torch.Size([0]))  # fmt: skip

    def saved(value):
        stream = io.BytesIO()
        torch.save(value, stream)
        stream.seek(0)
        return stream

    planner = _SafeLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {"lr": 0.0}
    with pytest.raises(CheckpointError, match="'payload' is not plain data"):
        planner.load_bytes(item("payload"), saved(Payload()))
    planner.load_bytes(item("lr"), saved({"lr": 0.25, "betas": (0.9, 0.99)}))
    assert planner.state_dict["lr"] == {"lr": 0.25, "betas": (0.9, 0.99)}
