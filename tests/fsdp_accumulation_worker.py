"""One rank of the FSDP2 jobs that tests/test_fsdp_accumulation.py spawns: virtual steps (``VirtualSteps``)
through ``engine.make_private`` on a ``fully_shard`` model, and a stalled rank (gloo on loopback, CPU, float64).

    python tests/fsdp_accumulation_worker.py RANK WORLD_SIZE OUT_DIR

OUT_DIR/phase names what to run: "accumulate" (logical batches cut into micro-batches: noise off, noise on, a
loop left mid logical batch), "stall_forward" or "stall_step" (rank 1 stops calling into the job without crashing,
before its forward or before its step). Writes what the
rank saw to OUT_DIR/rank{RANK}.pt (plain data; the test loads it with weights_only=True) and holds no
expectation: the test compares against its references.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_make_private_worker import engine_for, mlp_loss, token_loss
from fsdp_worker import (
    IndexedData,
    TokenData,
    full,
    join_group,
    mlp,
    run_scenarios_and_leave,
    sharded,
    sharded_blocks,
    transformer,
)

from privacy_engine.training.distributed import DistributedStepError
from privacy_engine.training.virtual_steps import VirtualSteps

#: How long the stalled rank sleeps at most (it wakes as soon as rank 0 has raised).
STALL_CAP_S = 120.0
#: The process group's timeout in the stall phase (what bounds the other ranks' wait).
STALL_TIMEOUT_S = 5


def virtual(model, dataset, loss_of, *, steps: int, max_physical_batch_size: int, **settings) -> dict:
    """``steps`` logical steps of the VirtualSteps loop through make_private; what each one saw."""
    engine, (model, optimizer, loader) = engine_for(model, dataset, **settings)
    seen: dict = {"indices": [[]], "micro_batches": [0], "params": [full(model)], "type": type(optimizer).__name__}
    with VirtualSteps(data_loader=loader, max_physical_batch_size=max_physical_batch_size,
                      optimizer=optimizer) as batches:  # fmt: skip
        for batch in batches:
            optimizer.zero_grad()
            loss_of(model, batch).backward()
            optimizer.step()
            seen["indices"][-1] += [int(i) for i in batch[2]]
            seen["micro_batches"][-1] += 1
            if optimizer.accumulated_micro_batches == 0:  # the step closed its logical batch
                seen["params"].append(full(model))
                if len(seen["params"]) == steps + 1:
                    break
                seen["indices"].append([])
                seen["micro_batches"].append(0)
    seen["expected_batch_size"] = optimizer.expected_batch_size
    seen["sample_rate"] = optimizer.sample_rate
    seen["epsilon"] = engine.get_epsilon(1e-5)
    seen["steps"] = engine.accountant.steps
    optimizer.remove_hooks()
    return seen


def left_mid_batch() -> dict:
    """The loop leaves after the first micro-batch of a logical batch (a warning; nothing released or recorded),
    then a new pass runs one whole logical step, whose update must be its own batch's clipped sum alone."""
    model = sharded(mlp(), [])
    engine, (model, optimizer, loader) = engine_for(model, IndexedData(40), noise_multiplier=0.0, max_grad_norm=1.0,
                                                    noise_seed=41)  # fmt: skip
    seen: dict = {"params": [full(model)], "type": type(optimizer).__name__}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = iter(VirtualSteps(data_loader=loader, max_physical_batch_size=1, optimizer=optimizer))
        batch = next(batches)
        mlp_loss(model, batch).backward()
        optimizer.step()
        seen["open_after_first"] = optimizer.accumulated_micro_batches
        try:
            optimizer.state_dict()
            seen["state_dict_mid_batch"] = None
        except RuntimeError as error:
            seen["state_dict_mid_batch"] = str(error)
        batches.close()  # what leaving the for loop does
    seen["warnings"] = [str(w.message) for w in caught]
    seen["unchanged"] = all(torch.equal(a, b) for a, b in zip(seen["params"][0], full(model)))
    seen["steps_after_leaving"] = engine.accountant.steps
    seen["indices"], micro = [[]], 0
    for batch in VirtualSteps(data_loader=loader, max_physical_batch_size=1, optimizer=optimizer):
        optimizer.zero_grad()
        mlp_loss(model, batch).backward()
        optimizer.step()
        seen["indices"][0] += [int(i) for i in batch[2]]
        micro += 1
        if optimizer.accumulated_micro_batches == 0:
            break
    seen["params"].append(full(model))
    seen["micro_batches"] = [micro]
    seen["expected_batch_size"] = optimizer.expected_batch_size
    seen["steps"] = engine.accountant.steps
    optimizer.remove_hooks()
    return seen


def stall(rank: int, out: Path, where: str) -> dict:
    """One ordinary step, then rank 1 sleeps (alive, not crashed) before its next forward (``where="forward"``)
    or between its next loss.backward() and step() (``"step"``); rank 0 must raise."""
    model = sharded(mlp(), [])
    _, (model, optimizer, loader) = engine_for(model, IndexedData(40), noise_multiplier=1.0, max_grad_norm=1.0,
                                               noise_seed=42)  # fmt: skip
    batches = iter(loader)
    mlp_loss(model, next(batches)).backward()
    optimizer.step()
    optimizer.zero_grad()
    raised = out / "rank0_raised"
    batch = next(batches)
    if rank == 1:
        if where == "step":
            mlp_loss(model, batch).backward()
        start = time.monotonic()
        while not raised.exists() and time.monotonic() - start < STALL_CAP_S:
            time.sleep(0.2)
        return {"woken_by_rank0": raised.exists()}
    start = time.monotonic()
    try:
        mlp_loss(model, batch).backward()
        optimizer.step()
    except DistributedStepError as error:
        raised.write_text("raised")
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
    return {"error": None}


def main() -> None:
    rank, world_size, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    phase = (out / "phase").read_text().strip()
    results = join_group(rank, world_size, out, STALL_TIMEOUT_S if phase.startswith("stall") else 60)
    scenarios = {
        "accumulate": [
            ("mlp", lambda: virtual(sharded(mlp(), []), IndexedData(40), mlp_loss, steps=3, max_physical_batch_size=1,
                                    noise_multiplier=0.0, max_grad_norm=1.0, noise_seed=11)),
            ("transformer", lambda: virtual(sharded_blocks(transformer(), lambda m: list(m.blocks)), TokenData(32),
                                            token_loss, steps=2, max_physical_batch_size=2, noise_multiplier=0.0,
                                            max_grad_norm=0.5, noise_seed=13)),
            ("noise_only", lambda: virtual(sharded(mlp(), []), IndexedData(40), lambda m, b: mlp_loss(m, b) * 0,
                                           steps=3, max_physical_batch_size=1, noise_multiplier=2.0,
                                           max_grad_norm=1.5, noise_seed=14)),
            ("left_mid_batch", left_mid_batch),
        ],
        "stall_forward": [("stall", lambda: stall(rank, out, "forward"))],
        "stall_step": [("stall", lambda: stall(rank, out, "step"))],
    }[phase]  # fmt: skip
    run_scenarios_and_leave(scenarios, results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
