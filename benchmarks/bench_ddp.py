"""Distributed DP-SGD step time: 1 vs 2 processes (gloo on CPU), against non-private DDP.

For each workload (``mlp``, ``cnn`` from ``workloads.py``, global batch 256) the script starts a
1-process and then a 2-process job (each process 1 thread, as ``torchrun`` sets it) and times, in
every rank, round-robin (``time_interleaved``):

* ``plain``: the model alone on a fixed local batch of ``256 / processes`` (no communication);
* ``ddp``: the same under ``DistributedDataParallel`` (non-private: DDP's own gradient all-reduce);
* ``dp`` / ``dp_ghost``: ``make_private(module=DistributedDataParallel(model))`` (hooks, i.e.
  materialised per-sample gradients / ghost, i.e. fast clipping) on Poisson batches of expected
  global size 256 (each rank ~``256 / processes``): per-example clipping, noise drawn on rank 0,
  one all-reduce of clipped sums + noise per step.

Printed per row: median step time (rank 0; a step ends when its collective does, so it includes
waiting for the slower rank), the DP step over the non-private DDP step, the time DP spends in
its all-reduce (communication + waiting for the other rank) and its share of the step, DDP's
communication overhead (``ddp - plain``), and the DP throughput gained by the second process.
On a 2-core machine shared with other jobs, the two processes compete with everything else:
compare rows of one run, and re-run before trusting absolute numbers.

    python benchmarks/bench_ddp.py [--quick] [--workloads mlp cnn]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workloads import Workload, get_workload, time_interleaved

from privacy_engine import PrivacyEngine

GLOBAL_BATCH = 256


def _step(workload: Workload, model: torch.nn.Module, optimizer: torch.optim.Optimizer, x, y) -> None:
    optimizer.zero_grad(set_to_none=True)
    workload.loss(model(x), y).backward()
    optimizer.step()


def _private_step(workload: Workload, loader: DataLoader, mode: str, communication: list[float]) -> Callable[[], None]:
    """A DP step function (hooks: materialised per-sample gradients; ghost: fast clipping) that appends
    each step's time in the DP all-reduce to ``communication``."""
    torch.manual_seed(0)
    inner = workload.build_model()
    made = PrivacyEngine().make_private(
        module=DistributedDataParallel(inner), optimizer=torch.optim.SGD(inner.parameters(), lr=0.01),
        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, noise_seed=0, grad_sample_mode=mode,
    )  # fmt: skip
    model, optimizer, private_loader = made
    job = optimizer.distributed_job
    state = {"batches": iter(())}

    def run() -> None:
        try:
            x, y = next(state["batches"])
        except StopIteration:
            state["batches"] = iter(private_loader)
            x, y = next(state["batches"])
        before = job.communication_seconds
        _step(workload, model, optimizer, x, y)
        communication.append(job.communication_seconds - before)

    return run


def _all_reduce_alone_seconds(flat: torch.Tensor, repeats: int) -> list[float]:
    """The all-reduce alone (ranks aligned by a barrier first): the communication part of the DP
    all-reduce time, the rest being the wait for the slower rank."""
    alone = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        alone.append(time.perf_counter() - start)
    return alone


def run_rank(rank: int, world_size: int, workload_name: str, repeats: int, warmup: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store-{workload_name}-{world_size}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))  # fmt: skip
    workload = get_workload(workload_name)
    local_batch = GLOBAL_BATCH // world_size
    generator = torch.Generator().manual_seed(rank)
    features, labels = workload.make_batch(local_batch, generator)

    torch.manual_seed(0)
    plain_model = workload.build_model()
    plain_optimizer = torch.optim.SGD(plain_model.parameters(), lr=0.01)

    torch.manual_seed(0)
    ddp_model = DistributedDataParallel(workload.build_model())
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)

    all_features, all_labels = workload.make_batch(GLOBAL_BATCH * 8, torch.Generator().manual_seed(100))
    loader = DataLoader(TensorDataset(all_features, all_labels), batch_size=GLOBAL_BATCH)

    communication: dict[str, list[float]] = {"hooks": [], "ghost": []}
    timings = time_interleaved(
        {
            "plain": lambda: _step(workload, plain_model, plain_optimizer, features, labels),
            "ddp": lambda: _step(workload, ddp_model, ddp_optimizer, features, labels),
            "dp": _private_step(workload, loader, "hooks", communication["hooks"]),
            "dp_ghost": _private_step(workload, loader, "ghost", communication["ghost"]),
        },
        repeats=repeats,
        warmup=warmup,
    )
    flat = torch.zeros(sum(p.numel() for p in plain_model.parameters()))
    alone = _all_reduce_alone_seconds(flat, repeats)
    if rank == 0:
        skip = warmup + repeats  # the warm-up and settling calls (time_interleaved: 1 settle + 1 timed a round)
        result = {
            "workload": workload_name,
            "processes": world_size,
            "local_batch": local_batch,
            **{f"{name}_ms": timing.median_ms for name, timing in timings.items()},
            **{f"{name}_iqr": timing.spread for name, timing in timings.items()},
            "dp_comm_ms": 1e3 * statistics.median(communication["hooks"][skip:]),
            "dp_ghost_comm_ms": 1e3 * statistics.median(communication["ghost"][skip:]),
            "all_reduce_alone_ms": 1e3 * statistics.median(alone),
            "parameters": flat.numel(),
        }
        Path(out, f"result-{workload_name}-{world_size}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (noisier)")
    parser.add_argument("--workloads", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn", "transformer"])
    args = parser.parse_args()
    repeats, warmup = (8, 2) if args.quick else (30, 5)
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        for name in args.workloads:
            for world_size in (1, 2):
                mp.spawn(run_rank, args=(world_size, name, repeats, warmup, out), nprocs=world_size, join=True)
                rows.append(json.loads(Path(out, f"result-{name}-{world_size}.json").read_text()))
    print(f"DP-SGD under DistributedDataParallel, gloo on CPU, global batch {GLOBAL_BATCH}, 1 thread per process; "
          f"median of {repeats} interleaved steps (rank 0)\n")  # fmt: skip
    header = (f"{'workload':<9} {'procs':>5} {'local B':>7} {'plain ms':>9} {'DDP ms':>8} {'DDP comm':>9} "
              f"{'reduce':>7} | "
              f"{'DP ms':>8} {'x DDP':>6} {'all-reduce':>16} {'speed-up':>8} | {'ghost ms':>9} {'x DDP':>6} "
              f"{'all-reduce':>16} {'speed-up':>8}")  # fmt: skip
    print(header)
    print("-" * len(header))
    single: dict[tuple[str, str], float] = {}
    for row in rows:
        cells = []
        for variant in ("dp", "dp_ghost"):
            milliseconds = row[f"{variant}_ms"]
            if row["processes"] == 1:
                single[row["workload"], variant] = milliseconds
            speedup = single[row["workload"], variant] / milliseconds
            share = row[f"{variant}_comm_ms"] / milliseconds
            cells.append(f"{milliseconds:>8.1f} {milliseconds / row['ddp_ms']:>6.2f} "
                         f"{row[f'{variant}_comm_ms']:>7.1f} ({share:>5.1%}) {speedup:>7.2f}x")  # fmt: skip
        print(f"{row['workload']:<9} {row['processes']:>5} {row['local_batch']:>7} {row['plain_ms']:>9.1f} "
              f"{row['ddp_ms']:>8.1f} {row['ddp_ms'] - row['plain_ms']:>9.1f} {row['all_reduce_alone_ms']:>7.1f} | "
              f"{cells[0]} | {cells[1]}")  # fmt: skip
    worst = max(max(row[f"{name}_iqr"] for name in ("plain", "ddp", "dp", "dp_ghost")) for row in rows)
    print(
        "\nDDP comm: DDP step - plain step (its all-reduce, overlapped with backward). reduce: one all-reduce of the "
        "parameter-sized vector alone, ranks aligned first (pure communication). DP: materialised per-sample "
        "gradients (hooks); ghost: fast clipping. x DDP: DP step / non-private DDP step. all-reduce: time in DP's one "
        "all-reduce per step (communication + waiting for the other rank), and its share of the step. speed-up: the "
        "1-process step time over this one, at the same global batch."
    )
    print(f"largest IQR/median of any timing: {worst:.2f} (above ~0.3: the machine was busy; run again)")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
