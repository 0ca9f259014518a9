"""One rank of the FSDP2 black-box jobs that tests/test_fsdp_black_box.py spawns: one private step of the user's
own loop through ``engine.make_private`` on a ``fully_shard`` model, on a dataset and on the same dataset with
one example removed (gloo on loopback, CPU, float64, noise off, SGD lr 1).

    python tests/fsdp_black_box_worker.py RANK WORLD_SIZE OUT_DIR

OUT_DIR/phase names the runs: "quick" (an MLP, mean loss, the removed example on rank 0's shard), "main" (every
2-rank case, then ``noise_mechanism="auto"`` with ``max_noise_memory``: what the plan counted per rank) or "four"
(an MLP on 4 ranks). Each run is named ``CASE/full`` or ``CASE/without{k}``; what it saw
(the batch, the gathered parameters before and after the step, the global expected batch size) goes to
OUT_DIR/rank{RANK}.pt (plain data; the test loads it with weights_only=True). The test holds the cases'
settings (``CASES``, read from here) and every expectation.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Subset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_make_private_worker import decoder_loss, mlp_loss, token_loss
from fsdp_worker import (
    IndexedData,
    TokenData,
    decoder_blocks,
    full,
    join_group,
    lora_decoder,
    mlp,
    run_scenarios_and_leave,
    sharded,
    sharded_blocks,
    transformer,
)

from accountants import make_accountant
from privacy_engine import PrivacyEngine
from privacy_engine.engine.mechanism_choice import noise_vector_bytes
from privacy_engine.training.virtual_steps import VirtualSteps

#: Each case: the model, its data, the loss, the settings and the examples removed (one neighbour per index).
#: ``batch_size`` None: the whole dataset (q = 1, so every example is in the step whatever the others are).
#: BandMF: q = b * batch / N < 1, and the last example is the one removed: the groups and the other examples'
#: draws are then the same in both runs (noise_seed 6 puts example 19 in step 0's group, on rank 0; the test
#: checks both runs' batches).
CASES = {
    "mlp_mean": {"model": "mlp", "size": 12, "removed": [4, 7], "max_grad_norm": 0.3, "loss_reduction": "mean"},
    "mlp_sum": {"model": "mlp", "size": 12, "removed": [4, 7], "max_grad_norm": 0.3, "loss_reduction": "sum"},
    "transformer": {"model": "transformer", "size": 8, "removed": [3], "max_grad_norm": 0.2,
                    "loss_reduction": "mean"},
    "lora": {"model": "lora", "size": 8, "removed": [2], "max_grad_norm": 0.1, "loss_reduction": "mean"},
    "virtual": {"model": "mlp", "size": 12, "removed": [5], "max_grad_norm": 0.3, "loss_reduction": "mean",
                "max_physical_batch_size": 2},
    "bandmf": {"model": "mlp", "size": 20, "removed": [19], "max_grad_norm": 0.3, "loss_reduction": "mean",
               "batch_size": 9, "noise_mechanism": "bandmf", "num_bands": 2, "total_steps": 4, "noise_seed": 6},
    "four_ranks": {"model": "mlp", "size": 12, "removed": [3], "max_grad_norm": 0.3, "loss_reduction": "mean"},
}  # fmt: skip
PHASES = {"quick": {"mlp_mean": [4]}, "four": {"four_ranks": [3]},
          "main": {name: case["removed"] for name, case in CASES.items() if name != "four_ranks"}}  # fmt: skip


def model_of(name: str) -> nn.Module:
    """The case's model, sharded (each block its own FSDP unit, then the root)."""
    if name == "mlp":
        return sharded(mlp(), [])
    if name == "transformer":
        return sharded_blocks(transformer(), lambda m: list(m.blocks))
    return sharded_blocks(lora_decoder(), decoder_blocks)


def data_of(case: dict):
    return IndexedData(case["size"]) if case["model"] == "mlp" else TokenData(case["size"])


def loss_of(case: dict):
    if case["model"] == "mlp":
        return lambda model, batch: mlp_loss(model, batch, reduction=case["loss_reduction"])
    return token_loss if case["model"] == "transformer" else decoder_loss


def one_step(case: dict, removed: int | None) -> dict:
    """One step of the ordinary loop (or one logical step of the VirtualSteps loop) on the case's dataset, less
    example ``removed``; what the rank saw."""
    dataset = data_of(case)
    if removed is not None:  # the neighbour: every other example kept, in its order (indices after it shift)
        dataset = Subset(dataset, [i for i in range(len(dataset)) if i != removed])
    model = model_of(case["model"])
    settings = {key: case[key] for key in ("noise_mechanism", "num_bands", "total_steps") if key in case}
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(dataset, batch_size=case.get("batch_size") or len(dataset)), noise_multiplier=0.0,
        max_grad_norm=case["max_grad_norm"], loss_reduction=case["loss_reduction"],
        noise_seed=case.get("noise_seed", 5), grad_sample_mode="ghost", **settings,
    )  # fmt: skip
    seen: dict = {"indices": [], "before": full(model), "micro_batches": 0}
    loss = loss_of(case)
    if "max_physical_batch_size" in case:
        with VirtualSteps(data_loader=loader, max_physical_batch_size=case["max_physical_batch_size"],
                          optimizer=optimizer) as batches:  # fmt: skip
            for batch in batches:
                optimizer.zero_grad()
                loss(model, batch).backward()
                optimizer.step()
                seen["indices"] += [int(i) for i in batch[2]]
                seen["micro_batches"] += 1
                if optimizer.accumulated_micro_batches == 0:  # the step closed its logical batch
                    break
    else:
        batch = next(iter(loader))
        loss(model, batch).backward()
        optimizer.step()
        seen["indices"] = [int(i) for i in batch[2]]
        seen["micro_batches"] = 1
    seen["after"] = full(model)
    seen["expected_batch_size"] = optimizer.expected_batch_size
    seen["sample_rate"] = optimizer.sample_rate
    seen["steps"] = engine.accountant.steps
    optimizer.remove_hooks()
    return seen


def auto_memory() -> dict:
    """``noise_mechanism="auto"`` with ``max_noise_memory`` on a sharded MLP (uneven shards: rank 0 holds more):
    the budget is twice the largest rank's shard bytes, which BandMF b = 2 fits per rank and the full vector's
    count does not; what each rank holds and what the plan counted, then one step."""
    model = sharded(mlp(), [])
    trainable = [p for p in model.parameters() if p.requires_grad]
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in trainable)
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, local_bytes)
    budget = 2 * max(every_rank)
    engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=1e-3))
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(IndexedData(40), batch_size=8), target_epsilon=3.0, target_delta=1e-5, epochs=2,
        max_grad_norm=1.0, noise_seed=3, noise_mechanism="auto", max_noise_memory=budget,
    )  # fmt: skip
    mlp_loss(model, next(iter(loader))).backward()
    optimizer.step()
    seen = {"local_bytes": every_rank, "budget": budget, "counted": noise_vector_bytes(trainable),
            "full_bytes": sum(p.numel() * p.element_size() for p in trainable),
            "element_size": trainable[0].element_size(), "local_numel": sum(p.to_local().numel() for p in trainable),
            "history_numel": optimizer.noise.history_numel() if hasattr(optimizer.noise, "history_numel") else 0,
            "mechanism": engine.noise_plan.mechanism, "num_bands": engine.noise_plan.num_bands,
            "candidates": [dataclasses.asdict(c) for c in engine.noise_plan.mechanism_candidates]}  # fmt: skip
    optimizer.remove_hooks()
    return seen


def main() -> None:
    rank, world_size, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    phase = (out / "phase").read_text().strip()
    results = join_group(rank, world_size, out)
    scenarios = []
    for name, removed in PHASES[phase].items():
        case = CASES[name]
        scenarios.append((f"{name}/full", lambda case=case: one_step(case, None)))
        scenarios += [(f"{name}/without{k}", lambda case=case, k=k: one_step(case, k)) for k in removed]
    if phase == "main":
        scenarios.append(("auto_memory", auto_memory))
    run_scenarios_and_leave(scenarios, results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
