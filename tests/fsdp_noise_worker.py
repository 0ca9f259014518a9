"""One rank of the 2-process job that tests/test_fsdp_noise.py spawns: correlated noise on FSDP2 shards and FSDP2
mixed precision (gloo on 127.0.0.1, CPU).

    python tests/fsdp_noise_worker.py RANK WORLD_SIZE OUT_DIR

Rendezvous through a file store in OUT_DIR; every scenario runs in order on one process group and what the
rank saw goes to OUT_DIR/rank{RANK}.pt (plain types and tensors, loaded with weights_only=True). The test
holds the expectations and the references. Models, data and helpers are tests/fsdp_worker.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_worker import (
    IndexedData,
    TokenData,
    full,
    join_group,
    mlp,
    mlp_losses,
    run_scenarios_and_leave,
    sharded,
    token_losses,
    transformer,
)

from accountants import make_accountant
from privacy_engine.noise import BandMFNoise, BLTNoise, BLTStrategy
from privacy_engine.training.distributed import DistributedSettingsError
from privacy_engine.training.distributed_sampling import DistributedDPDataLoader
from privacy_engine.training.fsdp import FSDPGhostClipping, FSDPPrivateStep, ShardNoise
from privacy_engine.training.fsdp_noise import ShardMechanismNoise

PLD_GRID = 1e-3
BATCH = 8
BANDMF = {"coefficients": (1.0, 0.6, 0.3), "sigma": 1.5, "clip": 1.0, "seed": 21, "steps": 5}
BLT = {"buf_decay": (0.9, 0.5), "output_scale": (0.3, 0.2), "min_sep": 2, "total_steps": 6, "sigma": 1.2,
       "clip": 0.8, "seed": 22, "steps": 5}  # fmt: skip
MIXED = {"clip": 0.5, "lr": 0.5, "seed": 23, "steps": 2}
#: name: (model, its blocks sharded on their own, dataset, per-example losses)
MIXED_MODELS = {
    "mlp": (mlp, lambda model: [model[0]], lambda: IndexedData(40), mlp_losses),
    "transformer": (transformer, lambda model: list(model.blocks), lambda: TokenData(32), token_losses),
}


def cyclic_loader(num_groups: int, seed: int, steps: int = 8, dataset=None) -> DistributedDPDataLoader:
    return DistributedDPDataLoader.from_data_loader(
        DataLoader(IndexedData(40) if dataset is None else dataset, batch_size=BATCH), rank=dist.get_rank(),
        world_size=dist.get_world_size(), seed=seed, num_groups=num_groups, steps=steps,
    )  # fmt: skip


def correlated(mechanism, *, sigma: float, clip: float, seed: int, steps: int, num_groups: int) -> dict:
    """Zero losses (the release is the noise alone), SGD with lr 1: what each step released, the noise state's
    size, and the accountant's epsilon."""
    model = sharded(mlp(), [])
    accountant = make_accountant("pld", value_discretization_interval=PLD_GRID)
    noise = ShardMechanismNoise(mechanism, noise_multiplier=sigma, max_grad_norm=clip, seed=seed)
    loader = cyclic_loader(num_groups, seed, steps)
    clipping = FSDPGhostClipping(model, max_grad_norm=clip)
    step = FSDPPrivateStep(torch.optim.SGD(model.parameters(), lr=1.0), noise, loader, accountant=accountant)
    seen: dict = {"params": [full(model)]}
    batches = iter(loader)
    for _ in range(steps):
        clipping.backward(mlp_losses(model, next(batches)) * 0)
        step.step()
        seen["params"].append(full(model))
    clipping.remove()
    history = [device["history"] for device in noise.mechanism.state_dict()["devices"]]
    return {**seen, "expected_batch_size": step.expected_batch_size, "sample_rate": step.sample_rate,
            "epsilon": accountant.get_epsilon(1e-5), "steps": accountant.steps,
            "history_shapes": [tuple(h.shape) for h in history], "history_numel": noise.history_numel(),
            "local_numel": sum(p.to_local().numel() for p in model.parameters()),
            "full_numel": sum(p.numel() for p in model.parameters())}  # fmt: skip


def bandmf() -> dict:
    return correlated(BandMFNoise(BANDMF["coefficients"]), sigma=BANDMF["sigma"], clip=BANDMF["clip"],
                      seed=BANDMF["seed"], steps=BANDMF["steps"], num_groups=len(BANDMF["coefficients"]))  # fmt: skip


def blt() -> dict:
    strategy = BLTStrategy(buf_decay=BLT["buf_decay"], output_scale=BLT["output_scale"])
    return correlated(BLTNoise(strategy, min_sep=BLT["min_sep"], total_steps=BLT["total_steps"]), sigma=BLT["sigma"],
                      clip=BLT["clip"], seed=BLT["seed"], steps=BLT["steps"], num_groups=BLT["min_sep"])  # fmt: skip


def refused_step(coefficients: tuple[float, ...], num_groups: int, error_type: type) -> dict:
    """The message of the ``error_type`` that building a BandMF step with ``coefficients`` over a loader of
    ``num_groups`` groups raises (None if it does not)."""
    model = sharded(mlp(), [])
    noise = ShardMechanismNoise(BandMFNoise(coefficients), noise_multiplier=1.0, max_grad_norm=1.0, seed=3)
    try:
        FSDPPrivateStep(torch.optim.SGD(model.parameters(), lr=0.1), noise, cyclic_loader(num_groups, 3))
    except error_type as error:
        return {"error": str(error)}
    return {"error": None}


def strategy_mismatch(rank: int) -> dict:
    """Rank 1 builds its BandMF with other coefficients: every rank refuses, naming the noise."""
    return refused_step((1.0, 0.5, 0.3) if rank == 1 else BANDMF["coefficients"], 3, DistributedSettingsError)


def wrong_grouping() -> dict:
    """BandMF with 3 bands over a plain Poisson loader (one group): refused at construction."""
    return refused_step(BANDMF["coefficients"], 1, ValueError)


def mixed_precision(name: str) -> dict:
    """bfloat16 compute, float32 reduction and parameters (blocks sharded on their own too) of MIXED_MODELS[name]:
    the clipped sums, per-example norms and parameters of each step, no noise."""
    build, blocks_of, dataset, losses_of = MIXED_MODELS[name]
    model = build().float()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    loader = cyclic_loader(1, MIXED["seed"], dataset=dataset())
    clipping = FSDPGhostClipping(model, max_grad_norm=MIXED["clip"])
    step = FSDPPrivateStep(torch.optim.SGD(model.parameters(), lr=MIXED["lr"]),
                           ShardNoise(noise_multiplier=0.0, max_grad_norm=MIXED["clip"], seed=0), loader)  # fmt: skip
    seen: dict = {"indices": [], "clipped_sums": [], "norms": [], "loss_dtypes": [], "params": [full(model)]}
    batches = iter(loader)
    for _ in range(MIXED["steps"]):
        inputs, targets, indices = next(batches)
        losses = losses_of(model, (inputs.float() if inputs.is_floating_point() else inputs, targets, indices))
        seen["loss_dtypes"].append(str(losses.dtype))
        norms = clipping.backward(losses)
        seen["norms"].append(norms.clone())
        seen["indices"].append([int(i) for i in indices])
        seen["clipped_sums"].append(full(model, "grad"))
        step.step()
        seen["params"].append(full(model))
    clipping.remove()
    seen["grad_dtypes"] = [str(p.dtype) for p in model.parameters()]
    return seen


def refused_precisions() -> dict:
    """float16 compute and a bfloat16 reduction are refused at construction, naming what to use."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result = {}
    for name, policy in (("float16", MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)),
                         ("bf16_reduce", MixedPrecisionPolicy(param_dtype=torch.bfloat16))):  # fmt: skip
        model = mlp().float()
        fully_shard(model, mesh=mesh, mp_policy=policy)
        try:
            FSDPGhostClipping(model, max_grad_norm=1.0)
            result[name] = None
        except NotImplementedError as error:
            result[name] = str(error)
    return result


def main() -> None:
    rank, world_size, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    results = join_group(rank, world_size, out)
    scenarios = [
        ("bandmf", bandmf),
        ("blt", blt),
        ("strategy_mismatch", lambda: strategy_mismatch(rank)),
        ("wrong_grouping", wrong_grouping),
        ("mixed_precision", lambda: mixed_precision("mlp")),
        ("mixed_precision_transformer", lambda: mixed_precision("transformer")),
        ("refused_precisions", refused_precisions),
    ]
    run_scenarios_and_leave(scenarios, results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
