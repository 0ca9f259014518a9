"""DPTrainer: Hugging Face Trainer with the engine's Poisson loader, DP optimizer and accountant."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from privacy_engine import DPDataLoader, DPOptimizer, PrivacyEngine
from privacy_engine.integrations.hf_trainer import DPTrainer

NUM_EXAMPLES, SEQ, VOCAB = 48, 8, 40


class TokenDataset(torch.utils.data.Dataset):
    """Sequences whose label is whether token 1 appears: a task a tiny BERT learns a little of."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(2, VOCAB, (NUM_EXAMPLES, SEQ), generator=generator)
        self.labels = torch.randint(0, 2, (NUM_EXAMPLES,), generator=generator)
        self.ids[self.labels == 1, 0] = 1

    def __len__(self) -> int:
        return NUM_EXAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": self.labels[index]}


def _model():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=2,
    )
    return transformers.BertForSequenceClassification(config)


def _arguments(tmp_path, **overrides):
    settings = {
        "output_dir": str(tmp_path), "per_device_train_batch_size": 8, "num_train_epochs": 1, "learning_rate": 1e-2,
        "logging_steps": 1, "save_strategy": "no", "report_to": [], "use_cpu": True, "disable_tqdm": True, "seed": 0,
    }  # fmt: skip
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_dp_trainer_samples_poisson_batches_and_logs_epsilon(tmp_path, mode: str) -> None:
    from dp_accounting import dp_event, rdp

    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = PrivacyEngine(accountant="rdp")
    trainer = DPTrainer(
        model=model, args=_arguments(tmp_path), train_dataset=TokenDataset(), privacy_engine=engine,
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode,
    )
    sizes = []
    step = trainer.training_step

    def recording_step(model, inputs, num_items_in_batch=None):
        sizes.append(int(inputs["input_ids"].shape[0]))
        return step(model, inputs, num_items_in_batch)

    trainer.training_step = recording_step
    trainer.train()

    assert isinstance(trainer.get_train_dataloader(), DPDataLoader)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    assert isinstance(optimizer, DPOptimizer)
    steps = trainer.state.global_step
    assert steps == NUM_EXAMPLES // 8 and len(sizes) == steps
    assert len(set(sizes)) > 1  # Poisson: batch sizes vary (fixed seed)
    assert trainer.args.max_grad_norm == 0.0
    assert all(not torch.equal(before[name], p) for name, p in model.named_parameters())

    # The accounted event is DP-SGD at q = 8 / 48, sigma = 1, for the steps taken: check with dp-accounting.
    expected = rdp.RdpAccountant()
    expected.compose(dp_event.PoissonSampledDpEvent(8 / NUM_EXAMPLES, dp_event.GaussianDpEvent(1.0)), steps)
    epsilon = trainer.get_epsilon()
    assert epsilon == pytest.approx(expected.get_epsilon(1e-5), rel=1e-6)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all("epsilon" in entry and "grad_norm" not in entry for entry in logged)
    assert logged[-1]["epsilon"] == pytest.approx(epsilon, rel=1e-6)


@pytest.mark.slow
def test_dp_trainer_with_target_epsilon_stays_within_it(tmp_path) -> None:
    trainer = DPTrainer(
        model=_model(), args=_arguments(tmp_path, num_train_epochs=2), train_dataset=TokenDataset(),
        privacy_engine=PrivacyEngine(accountant="rdp"), target_epsilon=4.0, target_delta=1e-5,
    )
    trainer.train()
    assert trainer.state.global_step == 2 * (NUM_EXAMPLES // 8)
    assert 3.0 < trainer.get_epsilon() <= 4.0


def test_dp_trainer_refuses_what_the_accounting_does_not_cover(tmp_path) -> None:
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        DPTrainer(model=_model(), args=_arguments(tmp_path, gradient_accumulation_steps=2),
                  train_dataset=TokenDataset(), noise_multiplier=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="exactly one of noise_multiplier and target_epsilon"):
        DPTrainer(model=_model(), args=_arguments(tmp_path), train_dataset=TokenDataset())
    trainer = DPTrainer(model=_model(), args=_arguments(tmp_path), train_dataset=TokenDataset(), noise_multiplier=1.0)
    with pytest.raises(ValueError, match="cannot resume"):
        trainer.train(resume_from_checkpoint=str(tmp_path))


def test_plain_trainer_with_a_private_optimizer_is_refused(tmp_path) -> None:
    """Trainer's own shuffled batches are not the ones the accountant records, and it calls the unwrapped
    model: the first training forward is refused, naming DPTrainer."""
    model = _model()
    dataset = TokenDataset()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _, private_optimizer, _ = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=optimizer, data_loader=torch.utils.data.DataLoader(dataset, batch_size=8),
        noise_multiplier=1.0, max_grad_norm=1.0,
    )
    trainer = transformers.Trainer(model=model, args=_arguments(tmp_path), train_dataset=dataset,
                                   optimizers=(private_optimizer, None))  # fmt: skip
    with pytest.raises(RuntimeError, match="without going through its GradSampleModule.*DPTrainer"):
        trainer.train()


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_private_model_presents_the_wrapped_models_signature_and_attributes(mode: str) -> None:
    """Tools that read a model's forward signature (Trainer keeps only the dataset columns it accepts) see the
    wrapped model's, not the wrapper's ``*args, **kwargs``; HF's introspected attributes come through."""
    import inspect

    model = _model()
    private_model, _, _ = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(TokenDataset(), batch_size=8), noise_multiplier=1.0,
        max_grad_norm=1.0, grad_sample_mode=mode,
    )  # fmt: skip
    assert private_model is not model
    assert inspect.signature(private_model.forward) == inspect.signature(model.forward)
    assert "input_ids" in inspect.signature(private_model.forward).parameters
    assert private_model.main_input_name == "input_ids"
    assert private_model.config is model.config
    assert private_model.can_generate() == model.can_generate()


def test_plain_trainer_given_the_private_model_keeps_the_columns(tmp_path) -> None:
    """A plain Trainer given the private model used to drop every column ("The batch received was empty"); it
    now passes the model its inputs, and the step contract refuses its own shuffled batches (no private loader)."""
    model = _model()
    dataset = TokenDataset()
    private_model, private_optimizer, _ = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(dataset, batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=private_model, args=_arguments(tmp_path), train_dataset=dataset,
                                   optimizers=(private_optimizer, None))  # fmt: skip
    with pytest.raises(RuntimeError, match="data that the private loader did not draw.*DPTrainer"):
        trainer.train()


def test_wrapper_signature_is_the_models_own_forward_even_through_the_fallback() -> None:
    """A model whose root owns a large parameter runs whole through the fallback (its forward replaced on the
    instance); the wrapper still presents the model's own forward signature. Calls are unchanged."""
    import inspect

    from privacy_engine import GhostClippingModule, GradSampleModule, PerSampleGradientClipper

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(20))
            self.linear = torch.nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, *, shift: float = 0.0) -> torch.Tensor:
            return self.linear(x) * self.scale[:3] + shift

    for build in (GradSampleModule, lambda m: GhostClippingModule(m, clipper=PerSampleGradientClipper(list(m.parameters()), 1.0))):
        model = Scaled()
        expected = inspect.signature(Scaled.forward).replace(parameters=list(inspect.signature(Scaled.forward).parameters.values())[1:])
        wrapped = build(model)
        assert inspect.signature(wrapped.forward) == expected
        x = torch.randn(4, 3)
        torch.testing.assert_close(wrapped(x, shift=1.0), model.linear(x) * model.scale[:3] + 1.0)


class _TinyImageModel(torch.nn.Module):
    """A convolutional model in Trainer's calling convention (``pixel_values``, ``labels`` -> ``{"loss"}``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 2, 3), torch.nn.GroupNorm(1, 2), torch.nn.Flatten(), torch.nn.Linear(2 * 4 * 4, 2)
        )

    def forward(self, pixel_values, labels=None):
        logits = self.net(pixel_values)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


class _ImageDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return {"pixel_values": torch.randn(1, 6, 6, generator=generator), "labels": torch.tensor(index % 2)}


@pytest.mark.parametrize(
    ("kind", "named", "ghost"),
    [("cnn", None, True), ("cnn", "hooks", False), ("bert", None, False), ("bert", "ghost", True)],
)
def test_dp_trainer_default_mode_is_make_privates_auto_choice(tmp_path, kind: str, named, ghost: bool) -> None:
    """No ``grad_sample_mode`` given: the trainer's wrapper is the one ``make_private``'s ``"auto"`` builds
    (ghost for a model with trainable convolutions, hooks for BERT); a named mode is kept."""
    from privacy_engine import GhostClippingModule, GradSampleModule

    build, dataset = (_TinyImageModel, _ImageDataset()) if kind == "cnn" else (_model, TokenDataset())
    trainer = DPTrainer(
        model=build(), args=_arguments(tmp_path), train_dataset=dataset,
        privacy_engine=PrivacyEngine(accountant="rdp"), noise_multiplier=1.0, **({} if named is None else {"grad_sample_mode": named}),
    )  # fmt: skip
    assert isinstance(trainer.get_train_dataloader(), DPDataLoader)
    assert isinstance(trainer.private_model, GradSampleModule)
    assert isinstance(trainer.private_model, GhostClippingModule) == ghost
    model = build()
    reference, _, _ = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(dataset, batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        **({} if named is None else {"grad_sample_mode": named}),
    )  # fmt: skip
    assert type(reference) is type(trainer.private_model)
