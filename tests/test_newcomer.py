"""Issue 19, what a newcomer meets: resuming the Opacus way trains on; the budget guard and the names
errors point to are reachable; a target that cannot mean what the user wants is said so; dp-accounting's
noise that is not the user's concern stays out of the log; a layer is named with its class."""

from __future__ import annotations

import logging
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import dp_accounting
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accountants
import privacy_engine
from privacy_engine import GradSampleModule, PrivacyBudgetExceeded, PrivacyEngine, PrivacyOptions
from privacy_engine.engine.checkpoint import OPTIMIZER_KEY, read_checkpoint
from privacy_engine.models.validation import module_label
from privacy_engine.training.optimizer_state import STATE_DICT_KEY
from tests import checkpoint_worker as worker

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "checkpoint_worker.py"
NUM_EXAMPLES, BATCH_SIZE = 40, 5


def make_setup(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    data = torch.Generator().manual_seed(1234)
    dataset = TensorDataset(torch.randn(NUM_EXAMPLES, 6, generator=data),
                            torch.randint(0, 3, (NUM_EXAMPLES,), generator=data))  # fmt: skip
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(dataset, batch_size=BATCH_SIZE)


def train_epoch(model, optimizer, loader):
    for inputs, targets in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()


# ---------------------------------------------------------------------------------------------- 1. resuming
RUNS = [(accountant, mode) for accountant in ("pld", "rdp") for mode in ("hooks", "ghost")]


@pytest.fixture(scope="module")
def resumed_both_ways(tmp_path_factory):
    """Per (accountant, mode): the uninterrupted run's last steps and parameters at the save, and what a
    fresh process saw after loading the checkpoint saved mid-run the engine's way (with data_loader=) and
    Opacus's way (save_checkpoint / load_checkpoint with path=, module=, optimizer= only)."""
    folder = tmp_path_factory.mktemp("newcomer-resume")
    uninterrupted, pairs = {}, []
    for accountant, mode in RUNS:
        config = f"gaussian-{mode}"
        engine, model, optimizer, criterion, loader = worker.build(config, accountant=accountant)
        records = worker.train(model, optimizer, criterion, worker.batches(loader),
                               worker.STEPS_BEFORE_SAVE + worker.RESUMED_STEPS)  # fmt: skip
        uninterrupted[accountant, mode] = {
            "saved_params": records[worker.STEPS_BEFORE_SAVE - 1]["params"],
            "records": records[worker.STEPS_BEFORE_SAVE:],
            "epsilon": engine.get_epsilon(worker.DELTA),
            "history": engine.accountant.state_dict()["history"],
        }
        engine, model, optimizer, criterion, loader = worker.build(config, accountant=accountant)
        worker.train(model, optimizer, criterion, worker.batches(loader), worker.STEPS_BEFORE_SAVE)
        for way in ("engine", "opacus"):
            path = folder / f"{accountant}-{mode}-{way}.pt"
            if way == "engine":
                engine.save_checkpoint(path=path, module=model, optimizer=optimizer, data_loader=loader)
            else:
                engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
            pairs.append(f"{config},{accountant},{way}={path}")
    out = folder / "resumed.pt"
    completed = subprocess.run([sys.executable, str(WORKER), "resume", str(out), *pairs], cwd=REPO,
                               capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    return uninterrupted, torch.load(out, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize(("accountant", "mode"), RUNS)
def test_a_run_resumed_the_opacus_way_in_a_fresh_process_trains_on(resumed_both_ways, accountant, mode):
    uninterrupted, resumed = resumed_both_ways
    expected, got = uninterrupted[accountant, mode], resumed[f"gaussian-{mode},{accountant},opacus"]
    # Without the loader's state the saved generators must not continue (they would repeat noise): said so.
    assert any("new generators" in message and "sampling state was not restored" in message
               for message in got["warnings"])  # fmt: skip
    for saved, loaded in zip(expected["saved_params"], got["loaded_params"]):
        assert torch.equal(saved, loaded)
    assert len(got["records"]) == worker.RESUMED_STEPS
    before = got["loaded_params"]
    for step, record in enumerate(got["records"]):
        assert all(torch.isfinite(p).all() for p in record["params"]), f"step {step}"
        assert any(not torch.equal(a, b) for a, b in zip(before, record["params"])), f"step {step} changed nothing"
        before = record["params"]
    # The ledger goes on from the saved one: every step of both halves recorded once.
    assert got["history"] == expected["history"]
    assert got["epsilon"] == pytest.approx(expected["epsilon"], rel=1e-12)


@pytest.mark.slow  # the fixture starts a fresh process; in-process resumes run by default (tests/test_checkpoints.py)
@pytest.mark.parametrize(("accountant", "mode"), RUNS)
def test_a_run_resumed_the_engines_way_in_a_fresh_process_is_the_uninterrupted_run(resumed_both_ways, accountant,
                                                                                    mode):  # fmt: skip
    uninterrupted, resumed = resumed_both_ways
    expected, got = uninterrupted[accountant, mode], resumed[f"gaussian-{mode},{accountant},engine"]
    assert not any("new generators" in message for message in got["warnings"])
    for step, (a, b) in enumerate(zip(expected["records"], got["records"], strict=True)):
        for key in ("inputs", "targets", "grads", "params"):
            values_a, values_b = (a[key], b[key]) if isinstance(a[key], list) else ([a[key]], [b[key]])
            assert all(torch.equal(x, y) for x, y in zip(values_a, values_b)), f"step {step}: {key} differs"
    assert got["history"] == expected["history"]
    assert got["epsilon"] == expected["epsilon"]


def test_a_checkpoint_saved_right_after_an_opacus_way_resume_resumes_too(tmp_path):
    """Loaded the Opacus way and saved again before any step: the new generators are in the file, not the
    old ones, and it loads and trains."""
    model, optimizer, loader = make_setup(seed=1)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0, noise_seed=3)  # fmt: skip
    train_epoch(model, optimizer, loader)
    engine.save_checkpoint(path=tmp_path / "first.pt", module=model, optimizer=optimizer)
    runs = []
    for name in ("first.pt", "second.pt"):
        model, optimizer, loader = make_setup(seed=2)
        engine = PrivacyEngine(accountant="rdp")
        model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                       noise_multiplier=1.0, max_grad_norm=1.0, noise_seed=4)  # fmt: skip
        with pytest.warns(UserWarning, match="new generators"):
            engine.load_checkpoint(path=tmp_path / name, module=model, optimizer=optimizer)
        if name == "first.pt":
            engine.save_checkpoint(path=tmp_path / "second.pt", module=model, optimizer=optimizer)
        runs.append((engine, model, optimizer, loader))
    old, new = (_noise_generator_state(read_checkpoint(tmp_path / name)) for name in ("first.pt", "second.pt"))
    assert not torch.equal(old, new)
    for engine, model, optimizer, loader in runs:
        train_epoch(model, optimizer, loader)
        assert optimizer.steps_taken == 2 * len(loader)


def _noise_generator_state(payload):
    return payload[OPTIMIZER_KEY][STATE_DICT_KEY]["noise"]["devices"][0]["generator_states"][0]


# ---------------------------------------------------------------------------------------------- 3. the budget guard
def test_training_past_the_planned_epochs_stops_at_the_step_that_would_pass_the_target():
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=3.0, target_delta=1e-5, epochs=2,
        max_grad_norm=1.0,
    )  # fmt: skip
    train_epoch(model, optimizer, loader)
    train_epoch(model, optimizer, loader)  # the planned epochs run to the end
    assert engine.get_epsilon(1e-5) <= 3.0
    assert engine.steps_left() == 0
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyBudgetExceeded, match="max_epsilon=3") as refused:
        train_epoch(model, optimizer, loader)
    assert refused.value.epsilon_spent <= 3.0 < refused.value.epsilon_after
    assert optimizer.steps_taken == 2 * len(loader)  # nothing released or recorded
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


def test_max_epsilon_inf_turns_the_guard_off():
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=3.0, target_delta=1e-5, epochs=1,
        max_grad_norm=1.0, max_epsilon=math.inf,
    )  # fmt: skip
    for _ in range(3):
        train_epoch(model, optimizer, loader)
    assert engine.get_epsilon(1e-5) > 3.0


def test_the_names_errors_point_to_are_importable_from_privacy_engine():
    model, optimizer, loader = make_setup()
    with pytest.raises(TypeError, match=r"see PrivacyOptions") as unknown:
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                                     max_grad_norm=1.0, max_grad_norms=1.0)  # fmt: skip
    for name in re.findall(r"\bsee (\w+)", str(unknown.value)):
        assert getattr(privacy_engine, name) is PrivacyOptions
    assert "max_grad_norm" in {field.name for field in PrivacyOptions.__dataclass_fields__.values()}
    # What calibration raises can be caught by its name from privacy_engine (PrivacyBudgetExceeded, the
    # budget guard's, is caught that way in the budget test above).
    assert privacy_engine.CalibrationError is accountants.CalibrationError


# ---------------------------------------------------------------------------------------------- 4. targets
def _hooked(model):
    return any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


@pytest.mark.parametrize("target_delta", [0.0, -1e-5, 1.0, 1.5])
@pytest.mark.parametrize("entry_point", ["make_private_with_epsilon", "make_private with max_epsilon"])
def test_a_target_delta_outside_0_1_is_refused_naming_it_before_anything_changes(entry_point, target_delta):
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine()
    if entry_point == "make_private_with_epsilon":
        call = engine.make_private_with_epsilon
        settings = {"target_epsilon": 3.0, "epochs": 1}
    else:
        call = engine.make_private
        settings = {"noise_multiplier": 1.0, "max_epsilon": 3.0}
    with pytest.raises(ValueError, match=rf"target_delta must be in \(0, 1\).*got {target_delta!r}"):
        call(module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=1.0, target_delta=target_delta,
             **settings)  # fmt: skip
    assert not _hooked(model) and engine.accountant.steps == 0 and engine.noise_plan is None


@pytest.mark.parametrize("entry_point", ["make_private_with_epsilon", "make_private with max_epsilon"])
def test_a_target_delta_of_at_least_one_over_the_dataset_size_warns(entry_point):
    model, optimizer, loader = make_setup()
    engine = PrivacyEngine(accountant="rdp")
    if entry_point == "make_private_with_epsilon":
        call, settings = engine.make_private_with_epsilon, {"target_epsilon": 3.0, "epochs": 1}
    else:
        call, settings = engine.make_private, {"noise_multiplier": 1.0, "max_epsilon": 3.0}
    with pytest.warns(UserWarning, match=r"target_delta=0.025 is at least 1/N = 1/40") as caught:
        call(module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=1.0, target_delta=1 / NUM_EXAMPLES,
             **settings)  # fmt: skip
    (warning,) = [w for w in caught if "1/N" in str(w.message)]
    assert warning.filename == __file__  # points at the user's call


def test_a_target_delta_below_one_over_the_dataset_size_says_nothing():
    model, optimizer, loader = make_setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PrivacyEngine(accountant="rdp").make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader, target_epsilon=3.0,
            target_delta=0.99 / NUM_EXAMPLES, epochs=1, max_grad_norm=1.0,
        )  # fmt: skip


def test_a_calibrated_noise_larger_than_the_batch_size_warns_with_its_numbers():
    model, optimizer, loader = make_setup()
    with pytest.warns(UserWarning, match="Training is unlikely to learn") as caught:
        _, private_optimizer, _ = PrivacyEngine(accountant="rdp").make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader, target_epsilon=0.01, target_delta=1e-5,
            epochs=1, max_grad_norm=1.0,
        )  # fmt: skip
    sigma = private_optimizer.noise_multiplier
    assert sigma > BATCH_SIZE  # the rule: noise std per coordinate sigma * C / B above C
    (warning,) = [w for w in caught if "unlikely to learn" in str(w.message)]
    assert f"noise_multiplier={sigma:.4g}" in str(warning.message)
    assert f"= {sigma / BATCH_SIZE:.3g} C to every coordinate" in str(warning.message)
    assert warning.filename == __file__


def test_a_calibrated_noise_below_the_batch_size_says_nothing():
    model, optimizer, loader = make_setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, private_optimizer, _ = PrivacyEngine(accountant="rdp").make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader, target_epsilon=3.0, target_delta=1e-5, epochs=1,
            max_grad_norm=1.0,
        )  # fmt: skip
    assert private_optimizer.noise_multiplier < BATCH_SIZE


# ---------------------------------------------------------------------------------------------- 5. dp-accounting's log
NOT_CONVERGED = "_compute_log_a_frac failed to converge"


def test_rdp_calibration_keeps_dp_accountings_convergence_messages_out_of_the_log(caplog):
    absl_logger = logging.getLogger("absl")
    filters_before = list(absl_logger.filters)
    model, optimizer, loader = make_setup()
    with caplog.at_level(logging.WARNING, logger="absl"):
        _, private_optimizer, private_loader = PrivacyEngine(accountant="rdp").make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader, target_epsilon=3.0, target_delta=1e-5,
            epochs=1, max_grad_norm=1.0,
        )  # fmt: skip
    assert not [record for record in caplog.records if record.getMessage().startswith(NOT_CONVERGED)]
    # Scoped: afterwards the absl logger is as it was, and dp-accounting called directly on the calibrated
    # mechanism still logs what it logs (this case does: the filter above had something to drop).
    assert absl_logger.filters == filters_before
    event = dp_accounting.PoissonSampledDpEvent(private_loader.sample_rate,
                                                dp_accounting.GaussianDpEvent(private_optimizer.noise_multiplier))
    with caplog.at_level(logging.WARNING, logger="absl"):
        dp_accounting.rdp.RdpAccountant().compose(event, len(private_loader))
    assert [record for record in caplog.records if record.getMessage().startswith(NOT_CONVERGED)]


def test_dp_accountings_other_warnings_still_reach_the_log(caplog):
    from accountants.rdp import _without_convergence_warnings

    with caplog.at_level(logging.WARNING, logger="absl"), _without_convergence_warnings():
        logging.getLogger("absl").warning("Negative Renyi divergence of %s, probably caused by numerical", -1.0)
        logging.getLogger("absl").warning(NOT_CONVERGED + " after %d iterations", 1000)
    assert [record.getMessage() for record in caplog.records] == [
        "Negative Renyi divergence of -1.0, probably caused by numerical"
    ]


# ---------------------------------------------------------------------------------------------- 6. layer names
def test_a_layer_is_named_by_its_path_and_its_class():
    assert module_label("0", nn.Linear(2, 3)) == "'0' (Linear)"
    assert module_label("encoder.attention", nn.MultiheadAttention(4, 2)) == "'encoder.attention' (MultiheadAttention)"
    assert module_label("", nn.Sequential()) == "the top-level module (Sequential)"
    assert module_label("0") == "'0'"


def test_an_error_about_a_layer_names_its_class():
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    GradSampleModule(model)
    with pytest.raises(ValueError, match=r"^'0' \(Linear\) is already hooked by another GradSampleModule"):
        GradSampleModule(model)


def test_a_batch_size_error_names_both_layers_with_their_classes():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.text = nn.Embedding(10, 3)
            self.image = nn.Linear(3, 2)

        def forward(self, tokens, pixels):
            return self.text(tokens).sum() + self.image(pixels).sum()

    wrapped = GradSampleModule(TwoInputs())
    with pytest.raises(ValueError, match=r"'image' \(Linear\) has 3 rows at dim 0.* but 'text' \(Embedding\) had 4\. .*\(1\) If the inputs differ"):
        wrapped(torch.randint(0, 10, (4, 2)), torch.randn(3, 3))
