"""Private training of a sharded (FSDP2) transformer on 2 ranks (gloo, CPU): memory per rank against DDP, and the
DP step against the non-private FSDP step.

The model: a pre-norm decoder of ``--layers`` blocks (multi-head causal attention and an MLP built from
``nn.Linear``, ``nn.LayerNorm``; ``nn.Embedding`` for tokens and positions; untied head), width ``--width``,
vocabulary ``--vocab``, sequences of ``--seq`` tokens, global batch ``--batch``, AdamW. Default: 4 blocks of
width 512, vocabulary 8000, 32 tokens, batch 8: about 21M parameters. Variants (each rank runs 1 torch thread):

* ``ddp``: ``DistributedDataParallel``, non-private (each rank holds the whole model, gradients and AdamW state);
* ``ddp-dp``: ``make_private(module=DistributedDataParallel(model), grad_sample_mode="ghost")``;
* ``fsdp``: ``fully_shard`` on every block and on the model, non-private;
* ``fsdp-dp``: the same sharded model, ``FSDPGhostClipping`` + ``ShardNoise`` + ``FSDPPrivateStep``
  (privacy_engine.training.fsdp, built by hand);
* ``fsdp-dp-bandmf``: as ``fsdp-dp`` with ``ShardMechanismNoise(BandMFNoise(4 bands))``: each rank keeps the
  3 history rows of its shard only;
* ``fsdp-dp-bf16`` (not in the default set): ``fsdp-dp`` with ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)``.

Memory (one fresh 2-process job per variant, 2 warm-up steps then 3 steps): **peak resident set per rank**
(the kernel's ``VmHWM`` minus the ``VmRSS`` the process held before the model was built: everything the
training touches, what an out-of-memory killer sees; the larger of the two ranks), and the **tracked tensor
bytes** per rank: the local parameters, their gradients (measured after backward), AdamW's state and the
noise history, summed from the tensors themselves. Time (one 2-process job, all variants round-robin with
``workloads.time_interleaved``, rank 0's median): each step's wall time and its ratio to the non-private step
of the same parallelism (fsdp-dp / fsdp, ddp-dp / ddp). Private steps draw Poisson batches of expected global
size ``--batch``; non-private steps a fixed local batch of ``--batch / 2``.

    python benchmarks/bench_fsdp.py              # ~21M parameters, about 10 min on 2 loaded cores
    python benchmarks/bench_fsdp.py --quick      # ~3M parameters, fewer rounds (a smoke run)
    python benchmarks/bench_fsdp.py --variants fsdp fsdp-dp fsdp-dp-bf16 --no-time
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workloads import _status_kib, reference_matmul_ms, time_interleaved

from privacy_engine import PrivacyEngine
from privacy_engine.noise import BandMFNoise
from privacy_engine.training.distributed import distributed_data_loader
from privacy_engine.training.distributed_sampling import DistributedDPDataLoader
from privacy_engine.training.fsdp import FSDPGhostClipping, FSDPPrivateStep, ShardNoise
from privacy_engine.training.fsdp_noise import ShardMechanismNoise

WORLD_SIZE = 2
VARIANTS = ("ddp", "ddp-dp", "fsdp", "fsdp-dp", "fsdp-dp-bandmf", "fsdp-dp-bf16")
DEFAULT_VARIANTS = VARIANTS[:-1]
BANDMF_COEFFICIENTS = (1.0, 0.5, 0.3, 0.15)  # any positive coefficients: memory and time do not depend on them
MIB = 2**20


# ---------------------------------------------------------------------------------------------- the model
class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.query, self.key, self.value = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        h = self.norm1(x)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)

        attended = nn.functional.scaled_dot_product_attention(split(self.query(h)), split(self.key(h)),
                                                              split(self.value(h)), is_causal=True)  # fmt: skip
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self, *, layers: int, width: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList([Block(width, max(1, width // 64)) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Positions per example (batch first), as the private wrappers read every layer's examples at dim 0.
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def per_example_losses(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    per_token = nn.functional.cross_entropy(logits.transpose(1, 2).float(), tokens[:, 1:], reduction="none")
    return per_token.mean(1)


# ---------------------------------------------------------------------------------------------- variants
def _local_bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


class Variant:
    """One way of training the model on this rank: ``step()`` runs one training step; the byte counts are
    those of the tensors it holds."""

    def __init__(self, name: str, args: argparse.Namespace, dataset: TensorDataset) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        model = Decoder(layers=args.layers, width=args.width, vocab=args.vocab, seq=args.seq)
        self.name, self.noise, self.grad_bytes = name, None, 0
        rank = dist.get_rank()
        local = args.batch // WORLD_SIZE
        self.fixed_batch = dataset.tensors[0][rank * local : (rank + 1) * local]
        global_loader = DataLoader(dataset, batch_size=args.batch)
        if name.startswith("fsdp"):
            policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                      if name.endswith("bf16") else MixedPrecisionPolicy())  # fmt: skip
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        else:
            model = DistributedDataParallel(model)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if name == "ddp-dp":
            self.model, self.optimizer, self.loader = PrivacyEngine().make_private(
                module=model, optimizer=self.optimizer, data_loader=global_loader, noise_multiplier=1.0,
                max_grad_norm=1.0, noise_seed=0, grad_sample_mode="ghost",
            )  # fmt: skip
        elif name.startswith("fsdp-dp"):
            self.clipping = FSDPGhostClipping(model, max_grad_norm=1.0)
            generator = torch.Generator().manual_seed(1)
            if name == "fsdp-dp-bandmf":
                self.noise = ShardMechanismNoise(BandMFNoise(BANDMF_COEFFICIENTS), noise_multiplier=1.0,
                                                 max_grad_norm=1.0, seed=0)  # fmt: skip
                self.loader = DistributedDPDataLoader.from_data_loader(
                    global_loader, rank=rank, world_size=WORLD_SIZE, seed=1, num_groups=len(BANDMF_COEFFICIENTS),
                    steps=10**6)  # fmt: skip
            else:
                self.noise = ShardNoise(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
                self.loader = distributed_data_loader(global_loader, generator=generator)
            self.private_step = FSDPPrivateStep(self.optimizer, self.noise, self.loader)
        self.batches = iter(())

    def _next_private_batch(self) -> torch.Tensor:
        try:
            return next(self.batches)[0]
        except StopIteration:
            self.batches = iter(self.loader)
            return next(self.batches)[0]

    def _trainable(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def _note_grad_bytes(self) -> None:
        self.grad_bytes = max(self.grad_bytes, _local_bytes(p.grad for p in self._trainable() if p.grad is not None))

    def step(self) -> None:
        if self.name in ("ddp", "fsdp", "ddp-dp"):
            batch = self.fixed_batch if self.name != "ddp-dp" else self._next_private_batch()
            per_example_losses(self.model, batch).mean().backward()
            self._note_grad_bytes()
            self.optimizer.step()
            self._note_grad_bytes()  # the private DDP optimizer writes .grad (clipped sum + noise) in its step
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.clipping.backward(per_example_losses(self.model, self._next_private_batch()))
            self._note_grad_bytes()
            self.private_step.step()

    def tracked_bytes(self) -> dict[str, int]:
        optimizer_state = [t for state in self.optimizer.state.values() for t in state.values()
                           if isinstance(t, torch.Tensor) and t.numel() > 1]  # fmt: skip
        history = 0
        if isinstance(self.noise, ShardMechanismNoise):
            history = self.noise.history_numel() * 4  # float32 history rows
        return {"params": _local_bytes(self.model.parameters()), "grads": self.grad_bytes,
                "optimizer": _local_bytes(optimizer_state), "noise_history": history}  # fmt: skip


def _init(rank: int, out: str, tag: str) -> None:
    torch.set_num_threads(1)
    # FSDP2 warns that the root returns a view (the head's output); nothing here modifies it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    dist.init_process_group("gloo", init_method=f"file://{out}/store-{tag}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=600))  # fmt: skip


def _dataset(args: argparse.Namespace) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randint(0, args.vocab, (args.batch * 16, args.seq + 1), generator=generator))


def memory_rank(rank: int, name: str, args: argparse.Namespace, out: str) -> None:
    _init(rank, out, f"memory-{name}")
    dataset = _dataset(args)
    baseline_kib = _status_kib("VmRSS")
    variant = Variant(name, args, dataset)
    for _ in range(5):  # 2 warm-up steps and 3 measured: the high-water mark covers all of them
        variant.step()
    result = {"rank": rank, "peak_rss_mib": (_status_kib("VmHWM") - baseline_kib) / 1024,
              **{key: value / MIB for key, value in variant.tracked_bytes().items()},
              "parameters": sum(p.numel() for p in variant.model.parameters())}  # fmt: skip
    Path(out, f"memory-{name}-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def time_rank(rank: int, names: list[str], args: argparse.Namespace, out: str) -> None:
    _init(rank, out, "time")
    dataset = _dataset(args)
    variants = {name: Variant(name, args, dataset) for name in names}
    timings = time_interleaved({name: variant.step for name, variant in variants.items()}, repeats=args.repeats,
                               warmup=1)  # fmt: skip
    if rank == 0:
        result = {name: {"median_ms": t.median_ms, "spread": t.spread} for name, t in timings.items()}
        Path(out, "time.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~3M-parameter model and 3 rounds (smoke run)")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="expected global batch (private), 2 x local (plain)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5, --quick 3)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-time", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write the raw numbers here too")
    args = parser.parse_args()
    args.layers = args.layers or (2 if args.quick else 4)
    args.width = args.width or (256 if args.quick else 512)
    args.repeats = args.repeats or (3 if args.quick else 5)
    if args.quick:
        args.vocab = min(args.vocab, 2000)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Freed blocks of 64 KiB or more go back to the kernel (as in workloads.peak_memory_increase).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    started = time.perf_counter()
    with open("/proc/loadavg") as load:
        load_before = load.read().split()[:3]
    probe_before = reference_matmul_ms()
    memory: dict[str, list[dict]] = {}
    timing: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as out:
        if not args.no_memory:
            for name in args.variants:
                mp.spawn(memory_rank, args=(name, args, out), nprocs=WORLD_SIZE, join=True)
                memory[name] = [json.loads(Path(out, f"memory-{name}-{rank}.json").read_text())
                                for rank in range(WORLD_SIZE)]  # fmt: skip
        if not args.no_time:
            mp.spawn(time_rank, args=(list(args.variants), args, out), nprocs=WORLD_SIZE, join=True)
            timing = json.loads(Path(out, "time.json").read_text())
    with open("/proc/loadavg") as load:
        load_after = load.read().split()[:3]
    probe_after = reference_matmul_ms()

    parameters = next(iter(memory.values()))[0]["parameters"] if memory else None
    print(f"FSDP2 vs DDP, {WORLD_SIZE} ranks (gloo, CPU, 1 thread each): decoder {args.layers} x {args.width}, vocab "
          f"{args.vocab}, seq {args.seq}, global batch {args.batch}, AdamW"
          + (f", {parameters / 1e6:.1f}M parameters" if parameters else ""))  # fmt: skip
    print(f"load average before {' '.join(load_before)}, after {' '.join(load_after)}; 1024^3 matmul "
          f"{probe_before:.0f} ms before, {probe_after:.0f} ms after\n")  # fmt: skip
    if memory:
        header = (f"{'variant':<15} {'peak RSS/rank':>13} {'tracked/rank':>12} {'params':>8} {'grads':>8} "
                  f"{'AdamW':>8} {'noise hist':>10}   (MiB; the larger rank)")  # fmt: skip
        print(header)
        print("-" * len(header))
        for name, ranks in memory.items():
            worst = max(ranks, key=lambda r: r["peak_rss_mib"])
            tracked = max(r["params"] + r["grads"] + r["optimizer"] + r["noise_history"] for r in ranks)
            big = max(ranks, key=lambda r: r["params"])
            print(f"{name:<15} {worst['peak_rss_mib']:>13.0f} {tracked:>12.0f} {big['params']:>8.0f} "
                  f"{big['grads']:>8.0f} {big['optimizer']:>8.0f} {big['noise_history']:>10.1f}")  # fmt: skip
        print()
    if timing:
        header = f"{'variant':<15} {'step ms':>9} {'IQR/med':>8} {'x non-private':>14}"
        print(header)
        print("-" * len(header))
        for name, row in timing.items():
            reference = "fsdp" if name.startswith("fsdp") else "ddp"
            ratio = (f"{row['median_ms'] / timing[reference]['median_ms']:>14.2f}"
                     if reference in timing and name != reference else f"{'':>14}")  # fmt: skip
            print(f"{name:<15} {row['median_ms']:>9.0f} {row['spread']:>8.2f} {ratio}")
        print("\nx non-private: step time over the non-private step of the same parallelism (fsdp or ddp), "
              "measured interleaved in one job (rank 0's median).")  # fmt: skip
    print("peak RSS/rank: VmHWM - VmRSS before the model was built; tracked/rank: local parameters + gradients + "
          "AdamW state + noise history, from the tensors.")  # fmt: skip
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({"memory": memory, "time": timing, "load": [load_before, load_after],
                                         "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
