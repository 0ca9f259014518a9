"""Correlated noise (BandMF, BLT) on FSDP2 shards and FSDP2 mixed precision (bfloat16): 2 gloo ranks on CPU.

One 2-process job (tests/fsdp_noise_worker.py, spawned once per module, hard time limit) runs every
scenario; the tests compare what the ranks released against independent references: the full-vector
noise ``C^{-1} Z`` computed by a dense triangular solve over the steps, with ``Z`` assembled from the
ranks' own streams; dp-accounting's epsilon of the single-process event; a float64 per-example loop on the
bfloat16-rounded model. The argument checks of ``ShardMechanismNoise`` run in process.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from conftest import run_rank_job

from privacy_engine.noise import BandMFNoise, BLTNoise, BLTStrategy, GaussianNoise
from privacy_engine.training.fsdp_noise import ShardMechanismNoise

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "fsdp_noise_worker.py"
JOB_TIME_LIMIT_S = 240  # a hung job is killed: the tests always end
WORLD_SIZE = 2
DELTA = 1e-5

sys.path.insert(0, str(ROOT / "tests"))
import fsdp_noise_worker as worker  # the scenarios, models and data, for the references
from test_fsdp import float64  # the default dtype inside a block
from test_fsdp import shard_rows as shard_rows_of  # FSDP2's dim-0 chunks


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What every rank saw (a list indexed by rank)."""
    results, logs, _ = run_rank_job(WORKER, WORLD_SIZE, tmp_path_factory.mktemp("fsdp_noise"), JOB_TIME_LIMIT_S)
    for rank, result in enumerate(results):
        assert "traceback" not in result, f"rank {rank}: {result['traceback']}\n{logs[rank][-3000:]}"
    return results


# ------------------------------------------------------------------------------ references
def shard_rows(length: int, rank: int) -> slice:
    return shard_rows_of(length, rank, WORLD_SIZE)


def released_noise(ranks: list[dict], lr: float = 1.0) -> list[list[torch.Tensor]]:
    """Per step, per parameter: the gathered update times B / lr (SGD, zero losses: the noise alone),
    checked equal on every rank."""
    params, batch = ranks[0]["params"], ranks[0]["expected_batch_size"]
    for other in ranks[1:]:
        for step_params, theirs in zip(params, other["params"]):
            assert all(torch.equal(a, b) for a, b in zip(step_params, theirs))
    return [[(before - after) * batch / lr for before, after in zip(params[t], params[t + 1])]
            for t in range(len(params) - 1)]  # fmt: skip


def replayed_draws(shapes: list[torch.Size], steps: int, *, std_multiplier: float, clip: float,
                   seed: int, world_size: int = WORLD_SIZE) -> list[list[torch.Tensor]]:  # fmt: skip
    """Per step, per parameter: the full matrix Z of fresh draws, each rank's rows from that rank's own stream,
    replayed with the same seed and rank as iid Gaussian noise of std ``std_multiplier * clip``."""

    def shard_rows(length: int, rank: int) -> slice:
        return shard_rows_of(length, rank, world_size)

    full = [[torch.zeros(shape, dtype=torch.float64) for shape in shapes] for _ in range(steps)]
    for rank in range(world_size):
        stream = ShardMechanismNoise(GaussianNoise(), noise_multiplier=std_multiplier, max_grad_norm=clip, seed=seed,
                                     rank=rank)  # fmt: skip
        locals_ = [torch.zeros_like(p[shard_rows(p.shape[0], rank)]) for p in full[0]]
        holders = []
        for local in locals_:
            holder = torch.zeros_like(local)
            holder.grad = local
            holders.append(holder)
        for t in range(steps):
            for local in locals_:
                local.zero_()
            stream.add_(holders)
            for position, local in enumerate(locals_):
                full[t][position][shard_rows(full[t][position].shape[0], rank)] = local
    return full


def correlated_reference(strategy: np.ndarray, draws: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Row t of ``C^{-1} Z`` for every coordinate: a dense lower-triangular solve over the steps."""
    steps = len(draws)
    inverse = torch.linalg.solve_triangular(torch.as_tensor(strategy[:steps, :steps]), torch.eye(steps, dtype=torch.float64),
                                            upper=False)  # fmt: skip
    return [[sum(inverse[t, j] * draws[j][position] for j in range(t + 1)) for position in range(len(draws[0]))]
            for t in range(steps)]  # fmt: skip


def banded_toeplitz(coefficients: tuple[float, ...], n: int) -> np.ndarray:
    matrix = np.zeros((n, n))
    for i, j in itertools.product(range(n), repeat=2):
        if 0 <= i - j < len(coefficients):
            matrix[i, j] = coefficients[i - j]
    return matrix


def blt_toeplitz(buf_decay: tuple[float, ...], output_scale: tuple[float, ...], n: int) -> np.ndarray:
    """C by the BLT definition: t_0 = 1, t_k = sum_i output_scale_i * buf_decay_i^(k-1)."""
    column = [1.0] + [sum(w * d ** (k - 1) for w, d in zip(output_scale, buf_decay)) for k in range(1, n)]
    matrix = np.zeros((n, n))
    for i, j in itertools.product(range(n), repeat=2):
        if i >= j:
            matrix[i, j] = column[i - j]
    return matrix


def brute_force_sensitivity(matrix: np.ndarray, min_sep: int) -> float:
    """max ||C 1_S||_2 over every set S of steps at least min_sep apart (C non-negative: one example with the
    same unit gradient at each of its steps is the worst case)."""
    n = matrix.shape[0]
    best = 0.0
    for size in range(1, n + 1):
        for steps in itertools.combinations(range(n), size):
            if all(b - a >= min_sep for a, b in itertools.pairwise(steps)):
                best = max(best, float(np.linalg.norm(matrix[:, list(steps)].sum(axis=1))))
    return best


def pld_epsilon(event: dp_accounting.DpEvent) -> float:
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=worker.PLD_GRID)
    accountant.compose(event)
    return accountant.get_epsilon(DELTA)


def check_released_noise(ranks: list[dict], strategy: np.ndarray, std_multiplier: float, clip: float, seed: int):
    released = released_noise(ranks)
    shapes = [p.shape for p in ranks[0]["params"][0]]
    draws = replayed_draws(shapes, len(released), std_multiplier=std_multiplier, clip=clip, seed=seed)
    expected = correlated_reference(strategy, draws)
    for t, (got_step, want_step) in enumerate(zip(released, expected)):
        for got, want in zip(got_step, want_step):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=lambda m, t=t: f"step {t}: {m}")
    # The two ranks' streams are distinct (their first rows of draws differ).
    first = draws[0][0]
    assert not torch.equal(first[shard_rows(first.shape[0], 0)][:1], first[shard_rows(first.shape[0], 1)][:1])


def check_history_is_the_shard(ranks: list[dict], rows: int) -> None:
    shapes = [p.shape for p in ranks[0]["params"][0]]
    for rank, result in enumerate(ranks):
        local = sum(math.prod((len(range(*shard_rows(s[0], rank).indices(s[0]))), *s[1:])) for s in shapes)
        assert result["local_numel"] == local
        assert result["history_shapes"] == [(rows, local)]
        assert result["history_numel"] == rows * local < rows * result["full_numel"]
    assert sum(result["local_numel"] for result in ranks) == ranks[0]["full_numel"]


# ------------------------------------------------------------------------------ BandMF
@pytest.mark.slow  # the 2-process job this module spawns (about 15 s on 2 cores)
def test_bandmf_on_shards_releases_the_full_vector_bandmf_noise_of_the_ranks_streams(job):
    settings = worker.BANDMF
    coefficients = settings["coefficients"]
    strategy = banded_toeplitz(coefficients, settings["steps"])
    check_released_noise([r["bandmf"] for r in job], strategy, settings["sigma"] * float(np.linalg.norm(coefficients)),
                         settings["clip"], settings["seed"])  # fmt: skip


@pytest.mark.slow  # the 2-process job this module spawns (about 15 s on 2 cores)
def test_bandmf_history_holds_only_the_local_shard(job):
    check_history_is_the_shard([r["bandmf"] for r in job], rows=len(worker.BANDMF["coefficients"]) - 1)


@pytest.mark.slow  # the 2-process job this module spawns (about 15 s on 2 cores)
def test_bandmf_epsilon_is_the_single_process_cyclic_poisson_event(job):
    settings = worker.BANDMF
    bands = len(settings["coefficients"])
    ranks = [r["bandmf"] for r in job]
    assert {r["steps"] for r in ranks} == {settings["steps"]}
    assert ranks[0]["sample_rate"] == pytest.approx(worker.BATCH * bands / 40)
    participations = -(-settings["steps"] // bands)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(worker.BATCH * bands / 40, dp_accounting.GaussianDpEvent(settings["sigma"])),
        participations,
    )  # fmt: skip
    assert ranks[0]["epsilon"] == pytest.approx(pld_epsilon(event), rel=1e-9)
    assert {r["epsilon"] for r in ranks} == {ranks[0]["epsilon"]}


# ------------------------------------------------------------------------------ BLT
def blt_sensitivity(steps: int) -> float:
    settings = worker.BLT
    return brute_force_sensitivity(blt_toeplitz(settings["buf_decay"], settings["output_scale"], steps),
                                   settings["min_sep"])  # fmt: skip


@pytest.mark.slow  # the 2-process job this module spawns (about 15 s on 2 cores)
def test_blt_on_shards_releases_the_full_vector_blt_noise_of_the_ranks_streams(job):
    settings = worker.BLT
    strategy = blt_toeplitz(settings["buf_decay"], settings["output_scale"], settings["steps"])
    check_released_noise([r["blt"] for r in job], strategy, settings["sigma"] * blt_sensitivity(settings["total_steps"]),
                         settings["clip"], settings["seed"])  # fmt: skip


@pytest.mark.slow  # the 2-process job this module spawns (about 15 s on 2 cores)
def test_blt_buffers_hold_only_the_local_shard(job):
    check_history_is_the_shard([r["blt"] for r in job], rows=len(worker.BLT["buf_decay"]))


@pytest.mark.slow  # the 2-process job this module spawns (about 15 s on 2 cores)
def test_blt_epsilon_is_the_single_process_unamplified_event(job):
    settings = worker.BLT
    ranks = [r["blt"] for r in job]
    assert {r["steps"] for r in ranks} == {settings["steps"]}
    # Draws at the sensitivity of total_steps, the release of the steps run: noise multiplier sigma * S_6 / S_5.
    multiplier = settings["sigma"] * blt_sensitivity(settings["total_steps"]) / blt_sensitivity(settings["steps"])
    want = pld_epsilon(dp_accounting.GaussianDpEvent(multiplier))
    assert ranks[0]["epsilon"] == pytest.approx(want, rel=1e-6)
    assert {r["epsilon"] for r in ranks} == {ranks[0]["epsilon"]}


# ------------------------------------------------------------------------------ refusals across ranks
@pytest.mark.slow  # the 2-process job this module spawns (about 15 s on 2 cores)
def test_ranks_with_different_strategies_are_refused_on_every_rank(job):
    for result in job:
        error = result["strategy_mismatch"]["error"]
        assert error is not None and "noise" in error and "[1.0, 0.5, 0.3]" in error


@pytest.mark.slow  # the 2-process job this module spawns (about 15 s on 2 cores)
def test_bandmf_over_a_loader_with_another_grouping_is_refused(job):
    for result in job:
        error = result["wrong_grouping"]["error"]
        assert error is not None and "num_bands=3" in error and "num_groups=1" in error


# ------------------------------------------------------------------------------ mixed precision
def bf16(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values rounded to bfloat16, in float64."""
    return tensor.to(torch.bfloat16).to(torch.float64)


def per_example_grads(name: str, params: list[torch.Tensor], indices: list[int]) -> list[list[torch.Tensor]]:
    """Each example's own gradient on the model ``name`` with ``params`` (rounded to bfloat16) and
    bfloat16-rounded floating inputs, in float64: the computation FSDP runs in bfloat16, done exactly."""
    build, _, dataset_of, losses_of = worker.MIXED_MODELS[name]
    with float64():
        model, dataset = build(), dataset_of()
        with torch.no_grad():
            for param, value in zip(model.parameters(), params):
                param.copy_(bf16(value))
        grads = []
        for index in indices:
            inputs, targets, _ = dataset[index]
            inputs = bf16(inputs) if inputs.is_floating_point() else inputs
            model.zero_grad()
            losses_of(model, (inputs.unsqueeze(0), targets.unsqueeze(0), None)).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
    return grads


# bfloat16 keeps 8 significant bits (unit roundoff 2^-9 = 0.002 for round-to-nearest). FSDP runs the forward
# and both backward passes in bfloat16 (each layer's output and output gradient rounded: three layers, about
# ten roundings on the way to a parameter's gradient), so an example's gradient and its norm are off by a few
# times 2^-9 relative; 2e-2 of the largest entry / of the norm is that bound with room (measured: MLP 5.1e-3,
# transformer 9.5e-3 of the largest entry; norms 4.1e-3 / 2.3e-3), far below what a missing clip factor or a
# wrong example would change (factors here go down to 0.16).
BF16_TOLERANCE = 2e-2


@pytest.mark.slow  # the 2-process job this module spawns (about 15 s on 2 cores)
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_bfloat16_mixed_precision_clips_in_float32_like_a_float64_loop(job, name):
    settings = worker.MIXED
    ranks = [r["mixed_precision" if name == "mlp" else f"mixed_precision_{name}"] for r in job]
    clipped_any = False
    for step in range(settings["steps"]):
        params = ranks[0]["params"][step]
        union = [index for rank in ranks for index in rank["indices"][step]]
        assert union and len(union) == len(set(union))
        grads = per_example_grads(name, params, union)
        norms = [math.sqrt(sum(float((g**2).sum()) for g in example)) for example in grads]
        clipped_any |= max(norms) > settings["clip"]
        want = [sum(min(1.0, settings["clip"] / norm) * example[i] for example, norm in zip(grads, norms))
                for i in range(len(params))]  # fmt: skip
        scale = max(float(w.abs().max()) for w in want)
        for got, wanted in zip(ranks[0]["clipped_sums"][step], want):
            assert got.dtype == torch.float32  # reduced in float32 into the float32 sharded gradients
            assert float((got.double() - wanted).abs().max()) <= BF16_TOLERANCE * scale
        start = 0
        for rank in ranks:
            count = len(rank["indices"][step])
            assert rank["norms"][step].dtype == torch.float64  # from float32 activations / output gradients
            torch.testing.assert_close(rank["norms"][step], torch.tensor(norms[start : start + count], dtype=torch.float64),
                                       rtol=BF16_TOLERANCE, atol=0)  # fmt: skip
            start += count
    assert clipped_any, "the test needs examples above the clip norm"
    assert set(ranks[0]["loss_dtypes"]) == {"torch.bfloat16"}  # the forward really ran in bfloat16
    assert set(ranks[0]["grad_dtypes"]) == {"torch.float32"}


@pytest.mark.slow  # the 2-process job this module spawns (about 15 s on 2 cores)
def test_float16_compute_and_a_bfloat16_reduction_are_refused_naming_the_fix(job):
    refused = job[0]["refused_precisions"]
    assert "param_dtype=torch.bfloat16" in refused["float16"]
    assert "reduce_dtype=torch.float32" in refused["bf16_reduce"]


# ------------------------------------------------------------------------------ in process
def test_sharded_mechanism_refuses_a_seeded_used_or_foreign_mechanism():
    with pytest.raises(ValueError, match="built with a seed"):
        ShardMechanismNoise(BandMFNoise((1.0, 0.5), seed=3), noise_multiplier=1.0, max_grad_norm=1.0, seed=1, rank=0)
    used = BandMFNoise((1.0, 0.5))
    used.add_noise_([torch.zeros(3)], 1.0, 1.0)
    with pytest.raises(ValueError, match="already taken 1 step"):
        ShardMechanismNoise(used, noise_multiplier=1.0, max_grad_norm=1.0, seed=1, rank=0)
    with pytest.raises(ValueError, match="seed must be None"):
        ShardMechanismNoise(BandMFNoise((1.0,), secure_mode=True), noise_multiplier=1.0, max_grad_norm=1.0, seed=1)
    with pytest.raises(TypeError, match="NoiseMechanism"):
        ShardMechanismNoise(object(), noise_multiplier=1.0, max_grad_norm=1.0, seed=1, rank=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="noise_multiplier"):
        ShardMechanismNoise(BandMFNoise((1.0,)), noise_multiplier=float("nan"), max_grad_norm=1.0, seed=1, rank=0)


def test_a_parameter_without_gradient_is_refused_before_any_noise():
    noise = ShardMechanismNoise(BandMFNoise((1.0, 0.5)), noise_multiplier=1.0, max_grad_norm=1.0, seed=1, rank=0)
    with_grad, without = torch.zeros(4), torch.zeros(2)
    with_grad.grad = torch.zeros(4)
    with pytest.raises(ValueError, match="parameter 1 .* no .grad"):
        noise.add_([with_grad, without])
    assert torch.equal(with_grad.grad, torch.zeros(4)) and noise.mechanism.step == 0


def test_sharded_mechanism_state_reloads_on_its_rank_only():
    def fresh(rank: int) -> ShardMechanismNoise:
        strategy = BLTStrategy(buf_decay=(0.8,), output_scale=(0.4,))
        return ShardMechanismNoise(BLTNoise(strategy, min_sep=1, total_steps=4), noise_multiplier=1.0,
                                   max_grad_norm=1.0, seed=5, rank=rank)  # fmt: skip

    def step(noise: ShardMechanismNoise) -> torch.Tensor:
        holder = torch.zeros(6)
        holder.grad = torch.zeros(6)
        noise.add_([holder])
        return holder.grad

    first = fresh(0)
    step(first)
    saved = first.state_dict()
    want = step(first)
    resumed = fresh(0)
    resumed.load_state_dict(saved)
    assert torch.equal(step(resumed), want)
    with pytest.raises(ValueError, match="rank 0's; this is rank 1"):
        fresh(1).load_state_dict(saved)


def test_secure_mode_mechanism_draws_from_the_os_at_the_stated_std():
    coefficients = (2.0, 0.5)
    noise = ShardMechanismNoise(BandMFNoise(coefficients, secure_mode=True), noise_multiplier=0.5, max_grad_norm=2.0,
                                rank=1)  # fmt: skip
    assert noise.seed_fingerprint == ("secure mode",) and noise.mechanism.state_dict()["seed"] is None
    holder = torch.zeros(20000)
    holder.grad = torch.zeros(20000)
    noise.add_([holder])
    # Step 0 adds z_0 / c_0 with z_0 ~ N(0, (sigma C ||c||)^2): std sigma C ||c|| / c_0 per entry.
    want = 0.5 * 2.0 * float(np.linalg.norm(coefficients)) / coefficients[0]
    assert abs(float(holder.grad.std()) / want - 1) < 4 / (2 * 20000) ** 0.5
