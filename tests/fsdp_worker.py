"""One rank of the 2-process FSDP2 job that tests/test_fsdp.py spawns (gloo on 127.0.0.1, CPU).

    python tests/fsdp_worker.py RANK WORLD_SIZE OUT_DIR

Rendezvous through a file store in OUT_DIR. Runs every scenario in order on one process group and
writes what the rank saw to OUT_DIR/rank{RANK}.pt (plain types and tensors: the test loads it with
weights_only=True). The test holds the expectations and references. The last scenario breaks the job
on purpose (rank 1 raises and leaves; rank 0 must fail instead of hanging).
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accountants import make_accountant
from privacy_engine import PrivacyEngine
from privacy_engine.training.distributed import DistributedSettingsError, distributed_data_loader
from privacy_engine.training.fsdp import FSDPGhostClipping, FSDPPrivateStep, ShardNoise

PLD_GRID = 1e-3
NUM_FEATURES, NUM_CLASSES = 6, 3
VOCAB, SEQ_LEN, WIDTH = 11, 5, 8


class IndexedData(Dataset):
    """(features, label, index): the index says which examples a rank's batch held."""

    def __init__(self, num_examples: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.features = torch.randn(num_examples, NUM_FEATURES, generator=generator) * 3
        self.labels = torch.randint(0, NUM_CLASSES, (num_examples,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.features[index], self.labels[index], index


class TokenData(Dataset):
    """(tokens, next tokens, index) of random sequences."""

    def __init__(self, num_examples: int, seed: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (num_examples, SEQ_LEN + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int):
        return self.tokens[index, :-1], self.tokens[index, 1:], index


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(NUM_FEATURES, 10), nn.Tanh(), nn.Linear(10, 7), nn.Tanh(),
                         nn.Linear(7, NUM_CLASSES))  # fmt: skip


class Block(nn.Module):
    """A pre-norm transformer block with single-head causal attention from Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.query, self.key, self.value = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        scores = self.query(h) @ self.key(h).transpose(1, 2) / WIDTH**0.5
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        attention = scores.masked_fill(causal, float("-inf")).softmax(-1)
        x = x + self.out(attention @ self.value(h))
        return x + self.down(torch.tanh(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ_LEN, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def transformer() -> nn.Module:
    torch.manual_seed(0)
    model = TinyTransformer()
    with torch.no_grad():  # non-trivial norm weights, so that their gradients are not the default's
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.add_(torch.randn_like(module.weight) * 0.3)
                module.bias.add_(torch.randn_like(module.bias) * 0.3)
    return model


def lora_decoder() -> nn.Module:
    """A tiny GPT-2 with LoRA adapters (peft) on its attention and MLP projections; only the adapters train."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = GPT2LMHeadModel(config).to(torch.get_default_dtype())
    # Random adapters on both sides (the default zero B would make A's first gradients zero).
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(model, lora)
    model.train()
    return model


def decoder_blocks(model: nn.Module) -> list:
    return list(model.base_model.model.transformer.h)


def decoder_losses(model, batch):
    tokens, targets, _ = batch
    logits = model(input_ids=tokens).logits
    per_token = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    return per_token.reshape(tokens.shape).mean(1)


def sharded(model: nn.Module, blocks) -> nn.Module:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def sharded_blocks(model: nn.Module, blocks_of) -> nn.Module:
    return sharded(model, blocks_of(model))


def full(model: nn.Module, attribute: str | None = None) -> list[torch.Tensor]:
    """The gathered full tensors of every parameter (or of every trainable one's ``.grad``); collective."""
    if attribute is None:
        tensors = list(model.parameters())
    else:
        tensors = [getattr(p, attribute) for p in model.parameters() if p.requires_grad]
    return [t.full_tensor().detach().clone() for t in tensors]


def mlp_losses(model, batch):
    features, labels, _ = batch
    return nn.functional.cross_entropy(model(features), labels, reduction="none")


def token_losses(model, batch):
    tokens, targets, _ = batch
    logits = model(tokens)
    per_token = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    return per_token.reshape(tokens.shape).mean(1)


def train(model, dataset, losses_of, *, steps: int, sigma: float, clip: float, seed: int, lr: float,
          accountant=None, zero_losses: bool = False, empty_rank: int | None = None) -> dict:  # fmt: skip
    """``steps`` private steps; what each one saw: batch indices, gathered clipped sum, parameters."""
    loader = distributed_data_loader(DataLoader(dataset, batch_size=8),
                                     generator=torch.Generator().manual_seed(seed))  # fmt: skip
    clipping = FSDPGhostClipping(model, max_grad_norm=clip)
    step = FSDPPrivateStep(torch.optim.SGD(model.parameters(), lr=lr),
                           ShardNoise(noise_multiplier=sigma, max_grad_norm=clip, seed=seed), loader,
                           accountant=accountant)  # fmt: skip
    seen: dict = {"indices": [], "clipped_sums": [], "params": [full(model)], "local_noise": []}
    batches = iter(loader)
    for _ in range(steps):
        batch = next(batches)
        if dist.get_rank() == empty_rank:
            batch = [part[:0] for part in batch]  # a rank whose Poisson draw was empty still takes part
        losses = losses_of(model, batch)
        clipping.backward(losses * 0 if zero_losses else losses)
        seen["indices"].append([int(i) for i in batch[2]])
        seen["clipped_sums"].append(full(model, "grad"))
        step.step()
        seen["params"].append(full(model))
    seen["expected_batch_size"] = step.expected_batch_size
    seen["sample_rate"] = step.sample_rate
    seen["shard_shapes"] = [tuple(p.to_local().shape) for p in model.parameters()]
    clipping.remove()
    return seen


def noisy() -> dict:
    """Noise on, zero losses (the release is the noise alone), accounted by a PLD accountant."""
    accountant = make_accountant("pld", value_discretization_interval=PLD_GRID)
    seen = train(sharded(mlp(), []), IndexedData(40), mlp_losses, steps=4, sigma=2.0, clip=1.5, seed=14, lr=1.0,
                 accountant=accountant, zero_losses=True)  # fmt: skip
    return {**seen, "epsilon": accountant.get_epsilon(1e-5), "steps": accountant.steps}


def refusals() -> dict:
    result: dict = {}
    model = sharded(mlp(), [])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for mode in ("hooks", "ghost", "auto"):
        try:
            _, built, _ = PrivacyEngine().make_private(module=model, optimizer=optimizer,
                                                       data_loader=DataLoader(IndexedData(20), batch_size=4),
                                                       noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode,
                                                       noise_seed=1)  # fmt: skip
            built.remove_hooks()  # the scenarios after this one hook their own models
            result[mode] = None
        except NotImplementedError as error:
            result[mode] = str(error)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(mlp(), device_id=torch.device("cpu"))
    except Exception as error:  # noqa: BLE001 - FSDP1 on CPU is not available everywhere
        result["fsdp1"] = {"unavailable": f"{type(error).__name__}: {error}"}
        return result
    try:
        PrivacyEngine().make_private(module=wrapped, optimizer=torch.optim.SGD(wrapped.parameters(), lr=0.1),
                                     data_loader=DataLoader(IndexedData(20), batch_size=4),
                                     noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost")  # fmt: skip
        result["fsdp1"] = {"error": None}
    except NotImplementedError as error:
        result["fsdp1"] = {"error": str(error)}
    return result


def mixed_precision() -> dict:
    """FSDP2 mixed precision in float16 is refused before any gradient (bfloat16: tests/test_fsdp_noise.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = mlp()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32))  # fmt: skip
    try:
        clipping = FSDPGhostClipping(model, max_grad_norm=1.0)
        dataset = IndexedData(8)
        clipping.backward(mlp_losses(model, (dataset.features, dataset.labels, None)))
    except NotImplementedError as error:
        return {"error": str(error), "grads": [p.grad is None for p in model.parameters()]}
    return {"error": None}


def in_place() -> dict:
    """A layer output modified in place afterwards (ReLU(inplace=True)) is refused before any gradient."""
    torch.manual_seed(0)
    model = sharded(nn.Sequential(nn.Linear(NUM_FEATURES, 5), nn.ReLU(inplace=True), nn.Linear(5, NUM_CLASSES)), [])
    clipping = FSDPGhostClipping(model, max_grad_norm=1.0)
    dataset = IndexedData(8)
    losses = mlp_losses(model, (dataset.features, dataset.labels, None))
    try:
        clipping.backward(losses)
    except RuntimeError as error:
        return {"error": str(error), "grads": [p.grad is None for p in model.parameters()]}
    return {"error": None}


def mismatch(rank: int) -> dict:
    """Rank 1 builds its step with another noise multiplier: every rank must refuse, naming it."""
    model = sharded(mlp(), [])
    loader = distributed_data_loader(DataLoader(IndexedData(40), batch_size=8),
                                     generator=torch.Generator().manual_seed(6))  # fmt: skip
    noise = ShardNoise(noise_multiplier=1.5 if rank == 1 else 1.0, max_grad_norm=1.0, seed=6)
    try:
        FSDPPrivateStep(torch.optim.SGD(model.parameters(), lr=0.1), noise, loader)
    except DistributedSettingsError as error:
        return {"error": str(error)}
    return {"error": None}


def crashed(rank: int) -> dict:
    """Rank 1 raises after one step and leaves; rank 0 goes on and must fail, not hang."""
    model = sharded(mlp(), [])
    loader = distributed_data_loader(DataLoader(IndexedData(40), batch_size=8),
                                     generator=torch.Generator().manual_seed(5))  # fmt: skip
    clipping = FSDPGhostClipping(model, max_grad_norm=1.0)
    step = FSDPPrivateStep(torch.optim.SGD(model.parameters(), lr=0.1),
                           ShardNoise(noise_multiplier=1.0, max_grad_norm=1.0, seed=5), loader)  # fmt: skip
    batches = iter(loader)
    clipping.backward(mlp_losses(model, next(batches)))
    step.step()
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    try:
        for _ in range(3):
            clipping.backward(mlp_losses(model, next(batches)))
            step.step()
    except Exception as error:  # noqa: BLE001 - whatever gloo raises when its peer is gone
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None}


def main() -> None:
    rank, world_size, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    results = join_group(rank, world_size, out)

    scenarios = [
        ("refusals", refusals),
        ("mlp", lambda: train(sharded(mlp(), []), IndexedData(40), mlp_losses, steps=3, sigma=0.0, clip=1.0,
                              seed=11, lr=0.5)),
        ("mlp_blocks", lambda: train(sharded_blocks(mlp(), lambda m: [m[0], m[2]]), IndexedData(40), mlp_losses,
                                     steps=2, sigma=0.0, clip=0.7, seed=12, lr=0.5)),
        ("transformer", lambda: train(sharded_blocks(transformer(), lambda m: list(m.blocks)), TokenData(32),
                                      token_losses, steps=2, sigma=0.0, clip=0.5, seed=13, lr=0.5)),
        ("lora", lambda: train(sharded_blocks(lora_decoder(), decoder_blocks), TokenData(32), decoder_losses,
                               steps=2, sigma=0.0, clip=0.5, seed=16, lr=0.5)),
        ("empty", lambda: train(sharded(mlp(), []), IndexedData(40), mlp_losses, steps=2, sigma=0.0, clip=1.0,
                                seed=15, lr=0.5, empty_rank=1)),
        ("noisy", noisy),
        ("mixed_precision", mixed_precision),
        ("mismatch", lambda: mismatch(rank)),
        ("in_place", in_place),
        ("crashed", lambda: crashed(rank)),
    ]  # fmt: skip
    run_scenarios_and_leave(scenarios, results, out / f"rank{rank}.pt")


def join_group(rank: int, world_size: int, out: Path, timeout_s: float = 20.0) -> dict:
    """One thread, float64, this rank in the gloo group on the job's file store (``out/store``); returns the
    results dict every worker fills and writes."""
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
    return {"rank": rank, "world_size": world_size}


def run_scenarios_and_leave(scenarios, results: dict, path) -> None:
    """Run each ``(name, scenario)`` in turn into ``results``, written to ``path`` before a scenario named
    "crashed" (a rank leaves in it), after a failure (with its traceback) and at the end; then leave with
    ``os._exit`` (0, or 1 after a failure): a process group a peer left or stalled can wait or abort in its
    teardown at exit, and every result is written by then."""
    try:
        for name, scenario in scenarios:
            if name == "crashed":
                torch.save(results, path)
            results[name] = scenario()
    except BaseException:  # noqa: BLE001 - written for the test, then the process leaves
        results["traceback"] = traceback.format_exc()
    torch.save(results, path)
    sys.stdout.flush()
    os._exit(0 if "traceback" not in results else 1)


if __name__ == "__main__":
    main()
