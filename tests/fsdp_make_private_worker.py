"""One rank of the FSDP2 jobs that tests/test_fsdp_make_private.py spawns: ``engine.make_private`` on a
``fully_shard`` model, the user's ordinary loop (gloo on loopback, CPU, float64).

    python tests/fsdp_make_private_worker.py RANK WORLD_SIZE OUT_DIR

OUT_DIR/phase names what to run: "main" (every scenario, the last one breaks the job on purpose),
"resume" (a fresh set of ranks loads OUT_DIR/../main/checkpoint and runs the remaining steps) or "tutorial"
(tutorials/fsdp_lora.py --quick, its process group on a file store). Writes what
the rank saw to OUT_DIR/rank{RANK}.pt (plain data; the test loads it with weights_only=True) and holds no
expectation: the test compares against its references.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_worker import (  # the models, data and per-example losses of the hand-built tests
    VOCAB,
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
from privacy_engine.noise import BandMFNoise
from privacy_engine.training.distributed import DistributedSettingsError

PLD_GRID = 1e-3
BATCH = 8
# Correlated noise through make_private (the test builds its references from the same settings).
BANDMF_NOISE = {"noise_mechanism": "bandmf", "num_bands": 3, "total_steps": 6, "noise_multiplier": 1.2,
                "max_grad_norm": 1.5, "noise_seed": 32}  # fmt: skip
BLT_NOISE = {"noise_mechanism": "blt", "num_bands": 2, "total_steps": 5, "num_buffers": 2, "noise_multiplier": 1.2,
             "max_grad_norm": 1.5, "noise_seed": 33}  # fmt: skip
SECURE_BANDMF = {"noise_mechanism": "bandmf", "num_bands": 2, "total_steps": 4, "noise_multiplier": 1.0,
                 "max_grad_norm": 2.0}  # fmt: skip
RESUMABLE_BANDMF = {"noise_mechanism": "bandmf", "num_bands": 2, "total_steps": 8}


def mlp_loss(model, batch, reduction="mean"):
    features, labels, _ = batch
    return nn.functional.cross_entropy(model(features), labels, reduction=reduction)


def token_loss(model, batch):
    tokens, targets, _ = batch
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def decoder_loss(model, batch):
    tokens, targets, _ = batch
    logits = model(input_ids=tokens).logits  # a transformers ModelOutput
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def engine_for(model, dataset, *, optimizer=None, secure_mode=False, **settings):
    engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=PLD_GRID),
                           secure_mode=secure_mode)  # fmt: skip
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.5)
    private = engine.make_private(module=model, optimizer=optimizer, data_loader=DataLoader(dataset, batch_size=BATCH),
                                  **settings)  # fmt: skip
    return engine, private


def train(model, dataset, loss_of, *, steps: int, empty_rank: int | None = None, **settings) -> dict:
    """``steps`` steps of the ordinary loop through make_private; what each one saw."""
    engine, (model, optimizer, loader) = engine_for(model, dataset, **settings)
    seen: dict = {"indices": [], "params": [full(model)], "type": type(optimizer).__name__}
    batches = iter(loader)
    for _ in range(steps):
        batch = next(batches)
        if dist.get_rank() == empty_rank:
            batch = [part[:0] for part in batch]  # a rank whose Poisson draw was empty still takes part
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seen["indices"].append([int(i) for i in batch[2]])
        seen["params"].append(full(model))
    seen["expected_batch_size"] = optimizer.expected_batch_size
    seen["sample_rate"] = optimizer.sample_rate
    seen["noise_multiplier"] = optimizer.noise_multiplier
    seen["epsilon"] = engine.get_epsilon(1e-5)
    seen["steps"] = engine.accountant.steps
    seen["mechanism"], seen["num_bands"] = engine.noise_plan.mechanism, engine.noise_plan.num_bands
    seen["noise_settings"] = optimizer.noise.settings()
    seen["noise_type"] = type(optimizer.noise).__name__
    if loader.batch_sampler.num_groups > 1:  # cyclic sampling: the global groups every rank holds alike
        seen["groups"] = [[int(i) for i in group] for group in loader.batch_sampler.groups]
    optimizer.remove_hooks()
    return seen


def bfloat16() -> dict:
    """FSDP2 mixed precision (bfloat16 compute, float32 reduction) through make_private: one step, noise off."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = mlp()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))  # fmt: skip
    return train(model, IndexedData(40), mlp_loss, steps=1, noise_multiplier=0.0, max_grad_norm=1.0, noise_seed=18)


def calibrated(**settings) -> dict:
    """make_private_with_epsilon: sigma calibrated for 2 epochs of the global loader, then 3 steps."""
    model = sharded(mlp(), [])
    engine = PrivacyEngine(accountant=make_accountant("pld", value_discretization_interval=PLD_GRID))
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(IndexedData(40), batch_size=BATCH), target_epsilon=3.0, target_delta=1e-5, epochs=2,
        max_grad_norm=1.0, noise_seed=3, **settings,
    )  # fmt: skip
    batches = iter(loader)
    for _ in range(3):
        mlp_loss(model, next(batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"noise_multiplier": optimizer.noise_multiplier, "sample_rate": optimizer.sample_rate,
            "steps_per_epoch": len(loader), "epsilon": engine.get_epsilon(1e-5), "steps": engine.accountant.steps,
            "steps_left": engine.steps_left(3.0, 1e-5), "mechanism": engine.noise_plan.mechanism,
            "num_bands": engine.noise_plan.num_bands, "noise_type": type(optimizer.noise).__name__}  # fmt: skip


def refusals() -> dict:
    """Settings the sharded build cannot honour: refused before anything changes (no hook left behind)."""
    result: dict = {}
    cases = {
        "hooks": {"grad_sample_mode": "hooks"},
        "functorch": {"grad_sample_mode": "functorch"},
        "mechanism_object": {"noise_mechanism": BandMFNoise((1.0, 0.5))},
        "per_layer": {"clipping": "per_layer"},
        "no_poisson": {"poisson_sampling": False},
        "user_level": {"privacy_unit": "user", "user_ids": list(range(40))},
    }
    for name, settings in cases.items():
        model = sharded(mlp(), [])
        hooks_before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
        try:
            engine_for(model, IndexedData(40), noise_multiplier=1.0, max_grad_norm=1.0, **settings)
            result[name] = {"error": None}
        except (NotImplementedError, ValueError, TypeError) as error:
            hooks_after = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
            result[name] = {"error": f"{type(error).__name__}: {error}", "unchanged": hooks_before == hooks_after}
    return result


def loop_errors() -> dict:
    """A step before backward, and a second forward before the step: clear errors, nothing released."""
    model = sharded(mlp(), [])
    engine, (model, optimizer, loader) = engine_for(model, IndexedData(40), noise_multiplier=0.0, max_grad_norm=1.0,
                                                    noise_seed=4)  # fmt: skip
    batches = iter(loader)
    before = full(model)
    result: dict = {}
    batch = next(batches)
    mlp_loss(model, batch)
    try:
        optimizer.step()
        result["step_before_backward"] = None
    except RuntimeError as error:
        result["step_before_backward"] = str(error)
    mlp_loss(model, batch).backward()
    try:
        mlp_loss(model, batch)
        result["second_forward"] = None
    except RuntimeError as error:
        result["second_forward"] = str(error)
    optimizer.zero_grad()
    model.reshard()  # the forward without a backward left the root's parameters gathered
    result["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, full(model)))
    result["steps"] = engine.accountant.steps
    # The loop goes on normally afterwards.
    mlp_loss(model, next(batches)).backward()
    optimizer.step()
    result["steps_after"] = engine.accountant.steps
    optimizer.remove_hooks()
    return result


def mismatch(rank: int) -> dict:
    """Rank 1 passes another noise multiplier: every rank refuses, naming it."""
    model = sharded(mlp(), [])
    try:
        engine_for(model, IndexedData(40), noise_multiplier=1.5 if rank == 1 else 1.0, max_grad_norm=1.0, noise_seed=6)
    except DistributedSettingsError as error:
        return {"error": str(error)}
    return {"error": None}


def wrong_resume(out: Path) -> dict:
    """Loading the checkpoint into a run with another noise multiplier: refused before anything changes."""
    model = sharded_blocks(transformer(), lambda m: list(m.blocks))
    engine, (model, optimizer, loader) = engine_for(model, TokenData(32), noise_multiplier=0.9, max_grad_norm=0.5,
                                                    noise_seed=21)  # fmt: skip
    before = full(model)
    try:
        engine.load_checkpoint(path=out.parent / "main" / "checkpoint", module=model, optimizer=optimizer,
                               data_loader=loader)  # fmt: skip
        error = None
    except ValueError as caught:
        error = f"{type(caught).__name__}: {caught}"
    unchanged = all(torch.equal(a, b) for a, b in zip(before, full(model)))
    return {"error": error, "unchanged": unchanged, "steps": engine.accountant.steps}


def resumable(out: Path, phase: str, folder: str = "checkpoint", **settings) -> dict:
    """AdamW with noise on: main = 2 steps, checkpoint, 2 more steps; resume = load, the same 2 more steps."""
    model = sharded_blocks(transformer(), lambda m: list(m.blocks))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine, (model, optimizer, loader) = engine_for(model, TokenData(32), optimizer=optimizer, noise_multiplier=0.8,
                                                    max_grad_norm=0.5, noise_seed=21, **settings)  # fmt: skip
    checkpoint = out.parent / "main" / folder
    seen: dict = {"indices": []}
    batches = iter(loader)
    if phase == "resume":
        engine.load_checkpoint(path=checkpoint, module=model, optimizer=optimizer, data_loader=loader)
        batches = iter(loader)
    for step in range(4 if phase == "main" else 2):
        if phase == "main" and step == 2:
            engine.save_checkpoint(path=checkpoint, module=model, optimizer=optimizer, data_loader=loader)
            seen["params_at_checkpoint"] = full(model)
        batch = next(batches)
        token_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        seen["indices"].append([int(i) for i in batch[2]])
    seen["params"] = full(model)
    seen["epsilon"] = engine.get_epsilon(1e-5)
    seen["steps"] = engine.accountant.steps
    seen["history_numel"] = getattr(optimizer.noise, "history_numel", lambda: 0)()
    optimizer.remove_hooks()
    return seen


def crashed(rank: int) -> dict:
    """Rank 1 raises after one step and leaves; rank 0 goes on and must fail, not hang."""
    model = sharded(mlp(), [])
    _, (model, optimizer, loader) = engine_for(model, IndexedData(40), noise_multiplier=1.0, max_grad_norm=1.0,
                                               noise_seed=5)  # fmt: skip
    batches = iter(loader)
    mlp_loss(model, next(batches)).backward()
    optimizer.step()
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    try:
        for _ in range(3):
            mlp_loss(model, next(batches)).backward()
            optimizer.step()
    except Exception as error:  # noqa: BLE001 - whatever gloo raises when its peer is gone
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None}


def main() -> None:
    rank, world_size, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    phase = (out / "phase").read_text().strip()
    if phase == "tutorial":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tutorials"))
        import fsdp_lora

        rows = fsdp_lora.main(["--quick", "--no-compare"], init_method=f"file://{out / 'store'}", rank=rank,
                              world_size=world_size)  # fmt: skip
        torch.save({"rank": rank, "rows": rows}, out / f"rank{rank}.pt")
        return
    results = join_group(rank, world_size, out)

    scenarios = {
        "main": [
            ("mlp", lambda: train(sharded(mlp(), []), IndexedData(40), mlp_loss, steps=3, noise_multiplier=0.0,
                                  max_grad_norm=1.0, noise_seed=11, grad_sample_mode="ghost")),
            ("mlp_sum", lambda: train(sharded(mlp(), []), IndexedData(40),
                                      lambda m, b: mlp_loss(m, b, reduction="sum"), steps=2, noise_multiplier=0.0,
                                      max_grad_norm=0.7, noise_seed=12, loss_reduction="sum")),
            ("transformer", lambda: train(sharded_blocks(transformer(), lambda m: list(m.blocks)), TokenData(32),
                                          token_loss, steps=2, noise_multiplier=0.0, max_grad_norm=0.5,
                                          noise_seed=13)),
            ("lora", lambda: train(sharded_blocks(lora_decoder(), decoder_blocks), TokenData(32), decoder_loss,
                                   steps=2, noise_multiplier=0.0, max_grad_norm=0.5, noise_seed=16,
                                   grad_sample_mode="ghost")),
            ("lora_empty", lambda: train(sharded_blocks(lora_decoder(), decoder_blocks), TokenData(32),
                                         decoder_loss, steps=2, noise_multiplier=0.0, max_grad_norm=0.5,
                                         noise_seed=17, empty_rank=1)),
            ("bfloat16", bfloat16),
            ("noise_only", lambda: train(sharded(mlp(), []), IndexedData(40), lambda m, b: mlp_loss(m, b) * 0,
                                         steps=3, noise_multiplier=2.0, max_grad_norm=1.5, noise_seed=14)),
            ("noisy", lambda: train(sharded(mlp(), []), IndexedData(40), mlp_loss, steps=4, noise_multiplier=1.3,
                                    max_grad_norm=1.0, noise_seed=14)),
            ("bandmf_clean", lambda: train(sharded(mlp(), []), IndexedData(40), mlp_loss, steps=3,
                                           noise_multiplier=0.0, max_grad_norm=1.0, noise_seed=31,
                                           noise_mechanism="bandmf", num_bands=2, total_steps=6)),
            ("bandmf_noise", lambda: train(sharded(mlp(), []), IndexedData(40), lambda m, b: mlp_loss(m, b) * 0,
                                           steps=4, **BANDMF_NOISE)),
            ("blt_noise", lambda: train(sharded(mlp(), []), IndexedData(40), lambda m, b: mlp_loss(m, b) * 0,
                                        steps=4, **BLT_NOISE)),
            ("auto", lambda: calibrated(noise_mechanism="auto")),
            ("secure_bandmf", lambda: train(sharded(mlp(), []), IndexedData(40), lambda m, b: mlp_loss(m, b) * 0,
                                            steps=1, secure_mode=True, **SECURE_BANDMF)),
            ("calibrated", calibrated),
            ("refusals", refusals),
            ("loop_errors", loop_errors),
            ("mismatch", lambda: mismatch(rank)),
            ("resumable", lambda: resumable(out, "main")),
            ("resumable_bandmf", lambda: resumable(out, "main", "checkpoint_bandmf", **RESUMABLE_BANDMF)),
            ("crashed", lambda: crashed(rank)),
        ],
        "resume": [("wrong_resume", lambda: wrong_resume(out)), ("resumable", lambda: resumable(out, "resume")),
                   ("resumable_bandmf", lambda: resumable(out, "resume", "checkpoint_bandmf", **RESUMABLE_BANDMF))],
    }[phase]  # fmt: skip
    run_scenarios_and_leave(scenarios, results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
