"""Distributed private training (privacy_engine.training.distributed): 2 ranks on gloo, loopback only.

One 2-process job (tests/distributed_worker.py, spawned once per module, hard time limit) runs every
scenario; the tests below check what each rank saw against independent references: a float64
per-example loop replaying the union of the ranks' batches, the noise mechanisms replayed from the
same seed, and dp-accounting's own epsilon for the same event. The samplers are also checked in
process, without communication, over many steps.
"""

from __future__ import annotations

import math
from pathlib import Path

import dp_accounting
import pytest
import torch
from conftest import run_rank_job
from torch import nn

from privacy_engine.noise import BandMFNoise, BLTNoise, BLTStrategy, GaussianNoise
from privacy_engine.training.distributed import (
    DistributedCyclicPoissonBatchSampler,
    DistributedPoissonBatchSampler,
    RankZeroNoise,
)

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "distributed_worker.py"
WORLD_SIZE = 2
JOB_TIME_LIMIT_S = 240  # a hung job is killed: the tests always end
PLD_GRID = 1e-3  # the worker's accountant grid
DELTA = 1e-5


# ------------------------------------------------------------------------------ the job
@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, list[int]]:
    out = tmp_path_factory.mktemp("ddp")
    results, logs, returncodes = run_rank_job(WORKER, WORLD_SIZE, out, JOB_TIME_LIMIT_S)
    rank0, rank1 = results
    assert "traceback" not in rank0, rank0["traceback"]
    # Rank 1 raises on purpose in the last scenario, and nowhere else.
    assert "rank 1 failed on purpose" in rank1.get("traceback", ""), logs[1][-3000:]
    assert "stalled" in rank1, rank1["traceback"]
    return rank0, rank1, returncodes


def both(job, scenario: str) -> tuple[dict, dict]:
    return job[0][scenario], job[1][scenario]


# ------------------------------------------------------------------------------ references
def mlp(num_features: int = 5) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(num_features, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def indexed_data(num_examples: int, num_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The worker's IndexedData (float64 default dtype there).
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(num_examples, num_features, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (num_examples,), generator=generator)
    return features, labels


def set_flat(model: nn.Module, values: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(values[offset : offset + param.numel()].view_as(param))
            offset += param.numel()


def clipped_sgd_step(model, features, labels, indices, *, max_grad_norm, expected_batch_size, lr) -> None:
    """One DP-SGD step without noise by its definition: each example's own gradient (a forward and
    backward on it alone), clipped to norm <= C, summed, divided by the expected batch size."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for index in indices:
        model.zero_grad()
        nn.functional.cross_entropy(model(features[index : index + 1]), labels[index : index + 1]).backward()
        grads = [p.grad.clone() for p in params]
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        factor = min(1.0, max_grad_norm / float(norm))
        for t, g in zip(total, grads):
            t.add_(g, alpha=factor)
    with torch.no_grad():
        for p, t in zip(params, total):
            p.sub_(lr * t / expected_batch_size)


def dp_accounting_epsilon(event: dp_accounting.DpEvent) -> float:
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_GRID)
    accountant.compose(event)
    return accountant.get_epsilon(DELTA)


def replay_noise(mechanism, shapes, sigma, clip, steps) -> list[torch.Tensor]:
    """The flat noise of ``steps`` steps of a noise mechanism added to zero sums."""
    rows = []
    for _ in range(steps):
        tensors = [torch.zeros(shape, dtype=torch.float64) for shape in shapes]
        mechanism.add_noise_(tensors, sigma, clip)
        rows.append(torch.cat([t.reshape(-1) for t in tensors]))
    return rows


# ------------------------------------------------------------------------------ one global step
@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
def test_two_ranks_equal_one_process_on_the_union_batch_without_noise(job, mode):
    rank0, rank1 = both(job, f"equivalence_{mode}")
    features, labels = indexed_data(40, 5)
    model = mlp()
    set_flat(model, rank0["initial"])
    assert torch.equal(rank0["initial"], rank1["initial"])
    assert rank0["expected_batch_size"] == 4.0  # the global one: batch_size of the loader
    assert len(rank0["params"]) == 6
    for step in range(6):
        union = rank0["indices"][step] + rank1["indices"][step]
        clipped_sgd_step(model, features, labels, union, max_grad_norm=0.3, expected_batch_size=4.0, lr=0.5)
        expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(rank0["params"][step], expected, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(rank1["params"][step], expected, rtol=1e-9, atol=1e-12)


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_virtual_steps_under_ddp_equal_one_process_on_the_union_batch(job):
    rank0, rank1 = both(job, "virtual")
    reference = both(job, "equivalence_hooks")
    # Same seed as the hooks run: the same batches, now cut into single-example micro-batches.
    assert [sorted(i) for i in rank0["indices"]] == [sorted(i) for i in reference[0]["indices"]]
    assert [sorted(i) for i in rank1["indices"]] == [sorted(i) for i in reference[1]["indices"]]
    for mine, theirs in zip(rank0["params"] + rank1["params"], reference[0]["params"] + reference[1]["params"]):
        torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-12)


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_audit_canaries_are_added_once_per_global_release_and_scored_alike_on_every_rank(job):
    # make_private(audit=...): only rank 0 adds the canaries before the all-reduce, so the release holds each
    # taking-part canary once (not once per rank), and every rank scores the same release.
    rank0, rank1 = both(job, "audited")
    expected = rank0["expected"].double()  # the canaries' directions are float32; the worker's model float64
    for ranks in (rank0, rank1):
        difference = ranks["with"] - ranks["without"]
        assert torch.allclose(difference, expected, atol=1e-6), (difference - expected).abs().max()
    assert rank0["expected"].abs().sum() > 0
    assert torch.equal(rank0["scores"], rank1["scores"])


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_opacus_distributed_optimizer_and_loader_names_run_global_steps(job):
    rank0, rank1 = both(job, "opacus_names")
    assert rank0["expected_batch_size"] == 8.0  # Opacus passes each rank's: 4 x 2 ranks
    assert rank0["sample_rate"] == pytest.approx(8 / 40)
    for draw0, draw1 in zip(rank0["indices"], rank1["indices"]):
        assert not set(draw0) & set(draw1)
    for params0, params1 in zip(rank0["params"], rank1["params"]):
        assert torch.equal(params0, params1)


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_a_rank_with_an_empty_local_batch_still_takes_part(job):
    rank0, rank1 = both(job, "equivalence_hooks")
    local_sizes = [len(i) for i in rank0["indices"] + rank1["indices"]]
    # The seeded run holds empty local batches (the equivalence test above covers those steps).
    assert 0 in local_sizes
    assert any(size > 0 for size in local_sizes)


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_parameters_are_bit_identical_across_ranks_with_noise(job):
    for scenario in ("noisy", "bandmf", "truncated", "checkpoint"):
        rank0, rank1 = both(job, scenario)
        record0 = rank0 if scenario != "checkpoint" else rank0["first"]
        record1 = rank1 if scenario != "checkpoint" else rank1["first"]
        assert len(record0["params"]) >= 3
        for params0, params1 in zip(record0["params"], record1["params"]):
            assert torch.equal(params0, params1), scenario


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_gaussian_noise_is_one_draw_of_std_sigma_c_over_the_global_batch(job):
    rank0, rank1 = both(job, "noisy")
    sigma, clip, global_batch, lr = 2.0, 1.5, 16.0, 1.0
    previous = rank0["initial"]
    deltas = []
    for params in rank0["params"]:
        deltas.append(previous - params)  # = lr * noise / B: the gradients are zero
        previous = params
    noise = torch.stack(deltas) * global_batch / lr
    # Statistical: std sigma * C per coordinate (once; two draws would give sqrt(2) times more, a
    # division by the local batch twice as much). 4 steps x 2040 coordinates: the estimate's
    # relative error is ~0.8 %, so 5 % is more than 6 standard errors.
    assert noise.numel() == 4 * 2040
    assert noise.std().item() == pytest.approx(sigma * clip, rel=0.05)
    assert abs(noise.mean().item()) < 4 * sigma * clip / math.sqrt(noise.numel())
    # Exact: rank 0's mechanism (seed 5) drew it, and the same values reached rank 1.
    expected = replay_noise(GaussianNoise(seed=5), [(40, 50), (40,)], sigma, clip, 4)
    torch.testing.assert_close(noise, torch.stack(expected), rtol=0, atol=1e-10)
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"]))


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_bandmf_noise_under_ddp_is_rank_zeros_correlated_sequence(job):
    rank0, rank1 = both(job, "bandmf")
    coefficients = rank0["coefficients"]
    assert len(coefficients) == 2
    previous = rank0["initial"]
    deltas = []
    for params in rank0["params"]:
        deltas.append((previous - params) * 8.0)  # lr 1, global expected batch 8
        previous = params
    expected = replay_noise(BandMFNoise(coefficients, seed=9), [(4, 6), (4,)], 1.0, 1.0, 6)
    torch.testing.assert_close(torch.stack(deltas), torch.stack(expected), rtol=0, atol=1e-10)
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"]))


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_blt_noise_under_ddp_is_rank_zeros_streamed_sequence_drawn_once(job):
    rank0, rank1 = both(job, "blt")
    strategy = BLTStrategy(buf_decay=rank0["buf_decay"], output_scale=rank0["output_scale"])
    previous = rank0["initial"]
    deltas = []
    for params in rank0["params"]:
        deltas.append((previous - params) * 8.0)  # lr 1, global expected batch 8
        previous = params
    expected = replay_noise(BLTNoise(strategy, min_sep=2, total_steps=6, seed=9), [(4, 6), (4,)], 1.0, 1.0, 6)
    torch.testing.assert_close(torch.stack(deltas), torch.stack(expected), rtol=0, atol=1e-10)
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"]))
    assert rank0["steps"] == rank1["steps"] == 6 and rank0["epsilon"] == rank1["epsilon"]


# ------------------------------------------------------------------------------ sampling (engine)
@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_the_engines_loader_gives_each_example_to_one_rank_at_the_global_rate(job):
    rank0, rank1 = both(job, "sampling")
    q = rank0["sample_rate"]
    assert q == pytest.approx(6 / 30)
    assert sorted(rank0["shard"] + rank1["shard"]) == list(range(30))
    counts = torch.zeros(30)
    for draw0, draw1 in zip(rank0["indices"], rank1["indices"]):
        assert not set(draw0) & set(draw1)  # never on two ranks at once
        assert set(draw0) <= set(rank0["shard"]) and set(draw1) <= set(rank1["shard"])
        counts[draw0 + draw1] += 1
    steps = len(rank0["indices"])
    # Each count is Binomial(300, 0.2): mean 60, sd 6.9; the overall rate has sd 0.0042.
    assert counts.sum().item() / (30 * steps) == pytest.approx(q, abs=0.02)
    assert counts.min().item() > 60 - 5 * 6.93 and counts.max().item() < 60 + 5 * 6.93


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_bandmf_groups_are_global_and_each_step_samples_only_its_group(job):
    rank0, rank1 = both(job, "bandmf")
    assert rank0["groups"] == rank1["groups"]
    groups = rank0["groups"]
    assert sorted(groups[0] + groups[1]) == list(range(48))
    for group in range(2):
        assert sorted(rank0["local_groups"][group] + rank1["local_groups"][group]) == sorted(groups[group])
    for step, (draw0, draw1) in enumerate(zip(rank0["indices"], rank1["indices"])):
        assert not set(draw0) & set(draw1)
        assert set(draw0 + draw1) <= set(groups[step % 2])


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_truncated_batches_have_the_per_rank_shape_and_union_to_one_truncated_sample(job):
    rank0, rank1 = both(job, "truncated")
    group = set(rank0["group"])
    for (draw0, pad0), (draw1, pad1) in zip(zip(rank0["indices"], rank0["padding"]),
                                            zip(rank1["indices"], rank1["padding"])):  # fmt: skip
        assert len(draw0) == len(draw1) == 3  # global cap 6 over 2 ranks
        real = [i for i, p in zip(draw0, pad0) if not p] + [i for i, p in zip(draw1, pad1) if not p]
        assert len(real) == len(set(real)) <= 6
        assert set(real) <= group
        # Padding fills the end of the global batch: rank 1 is padded only if rank 0's slice is full.
        assert not any(pad0) or all(pad1)


# ------------------------------------------------------------------------------ accounting
@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_every_ranks_epsilon_is_the_single_process_dp_sgd_epsilon(job):
    rank0, rank1 = both(job, "noisy")
    assert rank0["steps"] == rank1["steps"] == 4
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(2.0)), 4
    )
    expected = dp_accounting_epsilon(event)
    assert rank0["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert rank1["epsilon"] == rank0["epsilon"]


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_bandmf_epsilon_is_the_single_process_amplified_event(job):
    rank0, rank1 = both(job, "bandmf")
    assert rank0["steps"] == 6
    p = rank0["sample_rate"]
    assert p == pytest.approx(2 * 8 / 48)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(p, dp_accounting.GaussianDpEvent(1.0)), 3  # ceil(6 / 2)
    )
    assert rank0["epsilon"] == pytest.approx(dp_accounting_epsilon(event), rel=1e-9)
    assert rank1["epsilon"] == rank0["epsilon"]


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_truncated_epsilon_is_the_single_process_truncated_event_with_the_global_cap(job):
    rank0, rank1 = both(job, "truncated")
    # One group of 40: an example removed leaves 40, an example added makes 41; the worse is accounted.
    assert rank0["group_size"] in (40, 41) and (rank0["max_batch_size"], rank0["steps"]) == (6, 8)
    epsilons = [
        dp_accounting_epsilon(dp_accounting.SelfComposedDpEvent(
            dp_accounting.TruncatedSubsampledGaussianDpEvent(
                dataset_size=size, sampling_probability=5 / 40, truncated_batch_size=6, noise_multiplier=1.0
            ),
            8,
        ))
        for size in (40, 41)
    ]  # fmt: skip
    assert rank0["epsilon"] == pytest.approx(max(epsilons), rel=1e-9)
    assert rank1["epsilon"] == rank0["epsilon"]


# ------------------------------------------------------------------------------ set-up and failures
@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_mismatched_settings_raise_on_every_rank_naming_the_setting(job):
    rank0, rank1 = both(job, "mismatch")
    for result in (rank0, rank1):
        assert result["error"] is not None
        assert "noise_multiplier: rank 0: 1.0, rank 1: 1.1" in result["error"]
        assert not result["hooked"]  # raised before the model was wrapped


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_ranks_holding_the_same_examples_in_another_order_are_refused_on_every_rank(job):
    rank0, rank1 = both(job, "reordered")
    for result in (rank0, rank1):
        assert result["error"] is not None
        assert "dataset (digest of its examples at fixed indices" in result["error"]
        assert "same order" in result["error"]
        assert not result["hooked"]  # raised before the model was wrapped
        # Opacus's hand-built pipeline (DPDataLoader.from_data_loader(distributed=True)) is refused alike.
        assert "dataset (digest of its examples at fixed indices" in result["hand_built_error"]


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_resuming_every_rank_from_rank_zeros_checkpoint_repeats_the_steps(job):
    rank0, rank1 = both(job, "checkpoint")
    for result in (rank0, rank1):
        assert result["again"]["indices"] == result["first"]["indices"]
        for first, again in zip(result["first"]["params"], result["again"]["params"]):
            assert torch.equal(first, again)  # same sampling, same noise, same update
        assert result["steps"] == 5


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_fsdp2_in_hooks_mode_is_refused_with_a_clear_error(job):
    result = job[0]["fsdp2"]
    if "unavailable" in result:
        pytest.skip(f"fully_shard on CPU/gloo unavailable here: {result['unavailable']}")
    assert "FSDP2" in result["error"] and "grad_sample_mode='ghost'" in result["error"]


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_a_model_without_ddp_in_a_process_group_warns(job):
    assert any("not wrapped in DistributedDataParallel" in w for w in job[0]["unwrapped"]["warnings"])


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_opacus_wrapper_name_broadcasts_rank_zeros_parameters(job):
    rank0, rank1 = both(job, "alias")
    assert not torch.equal(rank0["before"], rank1["before"])
    assert torch.equal(rank0["after"], rank0["before"])
    assert torch.equal(rank1["after"], rank0["before"])
    assert rank0["noise"] == "RankZeroNoise"


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_a_stalled_rank_makes_the_other_fail_within_the_timeout(job):
    result = job[0]["stalled"]
    assert result["error"] is not None and "did not complete (timeout 1.5 s)" in result["error"]
    assert result["seconds"] < 2.9  # the stalled rank sleeps 3 s: the error came from the timeout
    assert result["grads_dropped"]  # the un-noised local sum is not left in .grad


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
@pytest.mark.parametrize("mechanism", ["gaussian", "bandmf"])
def test_a_rank_that_skips_a_step_makes_both_ranks_raise_before_releasing_a_mismatched_sum(job, mechanism):
    rank0, rank1 = both(job, f"skipped_{mechanism}")
    # Rank 0 releases loader step 1 while rank 1 releases loader step 2: the first all-reduce after the skip.
    assert rank0["step"] == 1 and rank1["step"] == 2
    assert "this rank is at global step 1, rank 1 at step 2" in rank0["error"]
    assert "this rank is at global step 2, rank 0 at step 1" in rank1["error"]
    for result in (rank0, rank1):
        assert result["steps_recorded"] == 1  # only step 0 was recorded: nothing mismatched was released
        assert result["unchanged"]


@pytest.mark.slow  # the one 2-process job this module spawns (about 15 s on 2 cores)
def test_a_rank_that_raises_makes_the_other_fail_instead_of_hanging(job):
    result = job[0]["crashed"]
    assert result["error"] is not None and "another rank raised, died or stalled" in result["error"]
    assert job[2][1] != 0 and job[2][0] == 0


# ------------------------------------------------------------------------------ samplers in process
def test_poisson_shards_partition_the_examples_for_any_world_size():
    for world_size in (1, 2, 3, 7):
        shards = [DistributedPoissonBatchSampler(10, 0.3, rank=r, world_size=world_size, seed=1).shard
                  for r in range(world_size)]  # fmt: skip
        assert sorted(torch.cat(shards).tolist()) == list(range(10))


def test_distributed_poisson_inclusion_is_q_independently_across_ranks():
    q, steps = 0.3, 2000
    samplers = [DistributedPoissonBatchSampler(20, q, rank=r, world_size=2, seed=4, steps=steps) for r in range(2)]
    inclusion = torch.zeros(steps, 20, dtype=torch.bool)
    for rank, sampler in enumerate(samplers):
        for step, batch in enumerate(sampler):
            assert not inclusion[step, batch].any()  # never on two ranks at once
            inclusion[step, batch] = True
    frequencies = inclusion.double().mean(0)
    # Each frequency: sd sqrt(q(1-q)/2000) = 0.0102.
    assert (frequencies - q).abs().max().item() < 5 * 0.0103
    # Same seed, distinct streams: example 0 (rank 0) and example 1 (rank 1) agree on inclusion at
    # the rate of independent draws (q^2 + (1-q)^2 = 0.58), not always.
    agreement = (inclusion[:, 0] == inclusion[:, 1]).double().mean().item()
    assert agreement == pytest.approx(q**2 + (1 - q) ** 2, abs=5 * 0.011)


def test_cyclic_groups_depend_on_the_seed_only_and_parts_partition_them():
    for public_size in (False, True):
        samplers = [DistributedCyclicPoissonBatchSampler(31, 3, 0.4, rank=r, world_size=2, seed=8,
                                                         public_size=public_size) for r in range(2)]  # fmt: skip
        assert [g.tolist() for g in samplers[0].groups] == [g.tolist() for g in samplers[1].groups]
        assert sorted(torch.cat(samplers[0].groups).tolist()) == list(range(31))
        for group in range(3):
            parts = samplers[0].local_groups[group].tolist() + samplers[1].local_groups[group].tolist()
            assert sorted(parts) == sorted(samplers[0].groups[group].tolist())
        for step, (batch0, batch1) in enumerate(zip(*samplers)):
            assert set(batch0 + batch1) <= set(samplers[0].groups[step % 3].tolist())
            assert not set(batch0) & set(batch1)


@pytest.mark.parametrize("secure", [False, True])
def test_truncated_slices_reassemble_one_truncated_poisson_sample(secure):
    cap, steps = 4, 2000
    samplers = [DistributedCyclicPoissonBatchSampler(12, 1, 0.5, rank=r, world_size=2, seed=3, steps=steps,
                                                     max_batch_size=cap, secure=secure, shared_seed=7)
                for r in range(2)]  # fmt: skip
    real_counts = []
    inclusion = torch.zeros(12)
    for step in range(steps):
        real = []
        for sampler in samplers:
            indices, padding = sampler._draw(step)
            assert len(indices) == cap // 2
            real += [i for i, p in zip(indices, padding.tolist()) if not p]
        assert len(set(real)) == len(real) <= cap
        real_counts.append(len(real))
        inclusion[real] += 1
    # B ~ Binomial(12, 0.5) truncated at 4: P(real = 4) = P(B >= 4) = 1 - 299/4096 = 0.927 (sd 0.006).
    full = sum(c == cap for c in real_counts) / steps
    assert full == pytest.approx(0.927, abs=5 * 0.006)
    # Symmetric: every example has the same rate E[min(B, 4)] / 12 = (4 - 392/4096) / 12 = 0.325 (sd 0.0105).
    assert (inclusion / steps - 0.325).abs().max().item() < 5 * 0.0105


def test_secure_draws_come_from_the_os_and_no_state_holds_the_shared_seed():
    # Secure: equal seeds do not give equal draws (the OS decides), and the rate is still q.
    first, second = (DistributedPoissonBatchSampler(40, 0.25, rank=0, world_size=2, seed=1, steps=400, secure=True)
                     for _ in range(2))  # fmt: skip
    draws = list(first)
    assert draws != list(second)
    assert sum(len(d) for d in draws) / (20 * 400) == pytest.approx(0.25, abs=5 * 0.0048)
    truncated = DistributedCyclicPoissonBatchSampler(40, 2, 0.25, rank=0, world_size=2, seed=1, secure=True,
                                                     max_batch_size=8, shared_seed=12345)  # fmt: skip
    assert 12345 not in truncated.state_dict().values()
    with pytest.raises(ValueError, match="needs shared_seed"):
        DistributedCyclicPoissonBatchSampler(40, 2, 0.25, rank=0, world_size=2, seed=1, secure=True, max_batch_size=8)


def test_a_global_cap_that_the_ranks_cannot_share_equally_is_refused():
    with pytest.raises(ValueError, match="max_batch_size=5 .* multiple of world_size=2"):
        DistributedCyclicPoissonBatchSampler(20, 1, 0.2, rank=0, world_size=2, seed=0, max_batch_size=5)


def test_bad_rank_is_refused():
    with pytest.raises(ValueError, match="rank must be an int in"):
        DistributedPoissonBatchSampler(10, 0.5, rank=2, world_size=2, seed=0)


def test_sampler_state_round_trip_repeats_the_draws():
    sampler = DistributedCyclicPoissonBatchSampler(30, 2, 0.3, rank=1, world_size=2, seed=6, steps=5)
    list(sampler)
    state = sampler.state_dict()
    after = list(sampler)
    fresh = DistributedCyclicPoissonBatchSampler(30, 2, 0.3, rank=1, world_size=2, seed=99, steps=5)
    fresh.load_state_dict(state)
    assert list(fresh) == after
    wrong_rank = DistributedCyclicPoissonBatchSampler(30, 2, 0.3, rank=0, world_size=2, seed=6)
    with pytest.raises(ValueError, match="rank=1"):
        wrong_rank.load_state_dict(state)


def test_rank_zero_noise_refuses_a_noise_state_saved_on_another_rank():
    class Job:
        rank, world_size = 0, 2

    other = RankZeroNoise(GaussianNoise(seed=1), Job())
    state = other.state_dict()
    state["distributed"]["saved_on_rank"] = 1
    with pytest.raises(ValueError, match="saved on rank 1"):
        RankZeroNoise(GaussianNoise(seed=2), Job()).load_state_dict(state)


# ------------------------------------------------------------------------------ the dataset digest (in process)
class _Examples(torch.utils.data.Dataset):
    def __init__(self, features, labels, transform=None):
        self.features, self.labels, self.transform = features, labels, transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        x = self.features[index]
        return (x if self.transform is None else self.transform(x)), int(self.labels[index])


def _examples(num_examples, seed=0, transform=None):
    generator = torch.Generator().manual_seed(seed)
    return _Examples(torch.randn(num_examples, 4, generator=generator),
                     torch.randint(0, 3, (num_examples,), generator=generator), transform)  # fmt: skip


@pytest.mark.parametrize("num_examples", [10, 256, 5000])
def test_the_dataset_digest_tells_a_reordered_copy_apart(num_examples):
    from privacy_engine.training.distributed_dataset import dataset_digest

    data = _examples(num_examples)
    same = _examples(num_examples)
    order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(1))
    shuffled = _Examples(data.features[order], data.labels[order])
    assert dataset_digest(data) == dataset_digest(same)
    assert dataset_digest(data) != dataset_digest(shuffled)
    assert dataset_digest(data) != dataset_digest(_examples(num_examples + 1))
    one_changed = _Examples(data.features.clone(), data.labels)
    one_changed.features[0, 0] += 1e-6  # index 0 is always hashed
    assert dataset_digest(data) != dataset_digest(one_changed)


def test_the_dataset_digest_reads_random_transforms_alike_and_leaves_the_generators_alone():
    import random

    import numpy as np

    from privacy_engine.training.distributed_dataset import dataset_digest

    def jitter(x):
        return x + 0.1 * torch.randn_like(x) + float(np.random.rand()) + random.random()

    digests, states = [], []
    for seed in (0, 1):  # two ranks whose global generators differ
        torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)
        before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
        digests.append(dataset_digest(_examples(300, transform=jitter)))
        after = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
        states.append(torch.equal(before[0], after[0]) and (before[1] == after[1]).all() and before[2] == after[2])
    assert digests[0] == digests[1]
    assert all(states)
