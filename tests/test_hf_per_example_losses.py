"""Issue 18: the guarantee holds when examples interact through the loss.

A Hugging Face model called with ``labels=`` averages its token loss over the whole batch, so each example's
gradient depends on the other examples' lengths. Through the engine's wrappers the loss is per-example by
construction (``privacy_engine.integrations.hf_losses``); ``privacy_engine.losses`` gives the same loss to
users who compute it themselves. The reference everywhere is each example alone (a batch of one), in float64.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import ATOL, RTOL, assert_matches_reference, module_fingerprint, per_example_reference
from torch import nn
from torch.nn import functional as F

from privacy_engine import GhostClippingModule, GradSampleModule, PerSampleGradientClipper, PrivacyEngine
from privacy_engine.losses import per_example_token_cross_entropy

transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB, LABELS = 4, 8, 40, 3
# The black-box tests' clipping bound: inside the range of the per-example gradient norms there (1.8 to 7.6),
# so some examples are clipped and some are not. With every example clipped the coupling would rescale each
# gradient before clipping and stay invisible; unclipped, the batch token mean moves the others.
CLIP = 6.0


# ---------------------------------------------------------------------------------- the public helper
def _loop_token_losses(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """Each example alone: the ordinary token-mean cross-entropy of a batch of one (0 if unlabelled)."""
    losses = []
    for i in range(labels.shape[0]):
        x, y = (logits[i, :-1], labels[i, 1:]) if shift else (logits[i], labels[i])
        if bool((y != -100).any()):
            losses.append(F.cross_entropy(x.reshape(-1, x.shape[-1]), y.reshape(-1), ignore_index=-100))
        else:
            losses.append(logits.new_zeros(()))
    return torch.stack(losses)


def _padded_labels(batch: int, length: int, classes: int, generator: torch.Generator) -> torch.Tensor:
    labels = torch.randint(0, classes, (batch, length), generator=generator)
    for i in range(batch):  # a different number of labelled tokens per example
        labels[i, int(torch.randint(1, length + 1, (1,), generator=generator)) :] = -100
    return labels


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_cross_entropy_is_each_example_alone(shift: bool, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    batch, length, classes = (int(v) for v in torch.randint(2, 7, (3,), generator=generator))
    logits = torch.randn(batch, length, classes, dtype=torch.float64, generator=generator, requires_grad=True)
    labels = _padded_labels(batch, length, classes, generator)
    expected = _loop_token_losses(logits, labels, shift)
    vector = per_example_token_cross_entropy(logits, labels, shift=shift, reduction="none")
    torch.testing.assert_close(vector, expected, rtol=RTOL, atol=ATOL)
    mean = per_example_token_cross_entropy(logits, labels, shift=shift)
    (grad,) = torch.autograd.grad(mean, logits)
    (expected_grad,) = torch.autograd.grad(expected.mean(), logits)
    torch.testing.assert_close(grad, expected_grad, rtol=RTOL, atol=ATOL)
    total = per_example_token_cross_entropy(logits, labels, shift=shift, reduction="sum")
    torch.testing.assert_close(total, expected.sum(), rtol=RTOL, atol=ATOL)


def test_token_cross_entropy_of_an_example_ignores_the_others() -> None:
    """Adding a long example changes no other example's loss (the batch token mean would)."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, SEQ, VOCAB, dtype=torch.float64, generator=generator)
    labels = _padded_labels(3, SEQ, VOCAB, generator)
    labels[2] = torch.randint(0, VOCAB, (SEQ,), generator=generator)  # fully labelled
    alone = per_example_token_cross_entropy(logits[:2], labels[:2], reduction="none")
    together = per_example_token_cross_entropy(logits, labels, reduction="none")
    torch.testing.assert_close(together[:2], alone, rtol=0, atol=0)
    coupled = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    assert not torch.isclose(coupled, together.mean())  # the coupled loss is another quantity


def test_token_cross_entropy_unlabelled_example_contributes_zero() -> None:
    logits = torch.randn(2, SEQ, VOCAB, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, SEQ))
    labels[1] = -100
    vector = per_example_token_cross_entropy(logits, labels, reduction="none")
    assert vector[1] == 0
    vector.sum().backward()
    assert torch.count_nonzero(logits.grad[1]) == 0
    assert per_example_token_cross_entropy(logits[:0], labels[:0]) == 0  # empty batch
    assert per_example_token_cross_entropy(logits[:, :1], labels[:, :1], shift=True) == 0  # nothing to predict


@pytest.mark.parametrize(
    "logits_shape,labels_shape,dtype,kwargs,match",
    [
        (
            (2, 5, 3),
            (2, 4),
            torch.long,
            {},
            r"logits must have shape labels.shape \+ \(num_classes,\).*\(2, 5, 3\).*\(2, 4\)",
        ),
        ((2, 5, 3), (2, 5), torch.float64, {}, "labels must hold class indices"),
        (
            (2, 5, 3),
            (2, 5),
            torch.long,
            {"reduction": "batchmean"},
            r"reduction must be one of \('mean', 'sum', 'none'\)",
        ),
    ],
)
def test_token_cross_entropy_refuses_with_the_argument_named(logits_shape, labels_shape, dtype, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        per_example_token_cross_entropy(torch.zeros(logits_shape), torch.zeros(labels_shape, dtype=dtype), **kwargs)


# ---------------------------------------------------------------------------------- HF loss functions
@pytest.mark.parametrize("name", ["ForCausalLMLoss", "ForMaskedLMLoss", "ForTokenClassification"])
def test_vectorised_token_losses_equal_the_originals_on_one_example(name: str) -> None:
    from transformers.loss import loss_utils

    from privacy_engine.integrations.hf_losses import per_example_loss_function

    original = getattr(loss_utils, name)
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(BATCH, SEQ, VOCAB, dtype=torch.float64, generator=generator)
    labels = _padded_labels(BATCH, SEQ, VOCAB, generator)
    labels[:, :2] = torch.randint(0, VOCAB, (BATCH, 2), generator=generator)  # every example has a label
    config = transformers.PretrainedConfig(num_labels=VOCAB)

    def call(function, rows, **extra):
        if name == "ForTokenClassification":
            return function(logits=logits[rows], labels=labels[rows], config=config, **extra)
        return function(logits=logits[rows], labels=labels[rows], vocab_size=VOCAB, **extra)

    expected = torch.stack([call(original, slice(i, i + 1)) for i in range(BATCH)])
    summed = per_example_loss_function(original, "sum")
    averaged = per_example_loss_function(original, "mean")
    torch.testing.assert_close(call(summed, slice(None)), expected.sum(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(call(averaged, slice(None)), expected.mean(), rtol=1e-6, atol=1e-6)
    # num_items_in_batch (a batch-wide count) is ignored
    torch.testing.assert_close(
        call(averaged, slice(None), num_items_in_batch=torch.tensor(3)), expected.mean(), rtol=1e-6, atol=1e-6
    )
    assert not torch.isclose(call(original, slice(None)), expected.mean())  # the original couples examples
    # another ignore_index, passed as the models pass it (a keyword, for ForTokenClassification in **kwargs)
    labels = labels.masked_fill(labels == -100, VOCAB + 5)
    expected = torch.stack([call(original, slice(i, i + 1), ignore_index=VOCAB + 5) for i in range(BATCH)])
    torch.testing.assert_close(
        call(averaged, slice(None), ignore_index=VOCAB + 5), expected.mean(), rtol=1e-6, atol=1e-6
    )


def test_other_loss_functions_run_once_per_example() -> None:
    from transformers.loss import loss_utils

    from privacy_engine.integrations.hf_losses import per_example_loss_function

    generator = torch.Generator().manual_seed(6)
    start, end = (torch.randn(BATCH, SEQ, dtype=torch.float64, generator=generator) for _ in range(2))
    start_positions = torch.tensor([1, 2, SEQ - 1, 0])
    end_positions = torch.tensor([2, SEQ - 1, 4, 0])
    original = loss_utils.ForQuestionAnsweringLoss
    expected = torch.stack([
        original(start[i : i + 1], end[i : i + 1], start_positions[i : i + 1], end_positions[i : i + 1])
        for i in range(BATCH)
    ])  # fmt: skip
    per_example = per_example_loss_function(original, "mean")
    torch.testing.assert_close(per_example(start, end, start_positions, end_positions), expected.mean())


# ---------------------------------------------------------------------------------- HF heads
def _bert_config(num_labels: int = LABELS, problem_type: str | None = None):
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=num_labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        problem_type=problem_type,
    )  # fmt: skip


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=1,
        n_head=2,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def _bart():
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=16,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    return transformers.BartForConditionalGeneration(config)


def _llama_classifier():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        num_labels=LABELS,
        pad_token_id=0,
    )
    return transformers.LlamaForSequenceClassification(config)


# head -> (builder, how its labels look); the comment says where its loss is computed in transformers 5.x
HEADS = {
    "causal_lm": (_gpt2, "tokens"),  # self.loss_function (ForCausalLMLoss)
    "masked_lm": (lambda: transformers.BertForMaskedLM(_bert_config()), "tokens"),  # inline CrossEntropyLoss
    "token_classification": (lambda: transformers.BertForTokenClassification(_bert_config()), "tags"),  # inline
    "sequence_classification": (lambda: transformers.BertForSequenceClassification(_bert_config()), "class"),  # inline
    "sequence_classification_loss_function": (_llama_classifier, "class"),  # self.loss_function
    "regression": (lambda: transformers.BertForSequenceClassification(_bert_config(num_labels=1)), "value"),  # inline
    "multi_label": (  # inline BCEWithLogitsLoss
        lambda: transformers.BertForSequenceClassification(_bert_config(problem_type="multi_label_classification")),
        "multi",
    ),
    "seq2seq_bart": (_bart, "decoder"),  # inline CrossEntropyLoss
}


def _head(name: str):
    build, labels_kind = HEADS[name]
    torch.manual_seed(0)
    model = build().double().train()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    lengths = [SEQ, 3, 6, 2]  # padded examples of different lengths
    mask = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if labels_kind == "tokens":
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    elif labels_kind == "tags":
        batch["labels"] = torch.randint(0, LABELS, (BATCH, SEQ), generator=generator).masked_fill(mask == 0, -100)
    elif labels_kind == "class":
        batch["labels"] = torch.randint(0, LABELS, (BATCH,), generator=generator)
    elif labels_kind == "value":
        batch["labels"] = torch.randn(BATCH, dtype=torch.float64, generator=generator)
    elif labels_kind == "multi":
        batch["labels"] = torch.randint(0, 2, (BATCH, LABELS), generator=generator).double()
    else:  # decoder targets of their own lengths
        targets = torch.randint(3, VOCAB, (BATCH, SEQ - 2), generator=generator)
        for i, length in enumerate([2, SEQ - 2, 4, 1]):
            targets[i, length:] = -100
        batch["labels"] = targets
    return model, batch


def _reference(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each example alone through a copy of the model: the loss it computes on a batch of one."""
    first, *rest = batch
    return per_example_reference(model, [batch[first]], lambda out, i: out.loss, kwargs={k: batch[k] for k in rest})


def _ghost(model: nn.Module, batch: dict[str, torch.Tensor], max_grad_norm: float):
    params = [p for p in model.parameters() if p.requires_grad]
    clipper = PerSampleGradientClipper(params, max_grad_norm=max_grad_norm)
    wrapped = GhostClippingModule(model, clipper=clipper)
    wrapped(**batch).loss.backward()
    norms = wrapped.last_per_sample_norms.flatten()
    clipper.pre_step()
    sums = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    wrapped.to_standard_module()
    return sums, norms


def test_the_fixture_batches_couple_examples() -> None:
    """The batch loss HF computes is not the mean of the batch-of-one losses: the tests below can fail."""
    for name in ("causal_lm", "masked_lm", "token_classification", "seq2seq_bart"):
        model, batch = _head(name)
        coupled = model(**batch).loss
        alone = torch.stack([model(**{k: v[i : i + 1] for k, v in batch.items()}).loss for i in range(BATCH)])
        assert not torch.isclose(coupled, alone.mean(), rtol=1e-4), name


@pytest.mark.parametrize("head", sorted(HEADS))
def test_hooks_loss_is_per_example(head: str) -> None:
    model, batch = _head(head)
    reference = _reference(model, batch)
    alone = torch.stack(
        [copy.deepcopy(model)(**{k: v[i : i + 1] for k, v in batch.items()}).loss for i in range(BATCH)]
    )
    wrapped = GradSampleModule(model)
    loss = wrapped(**batch).loss
    torch.testing.assert_close(loss, alone.mean(), rtol=RTOL, atol=ATOL)
    loss.backward()
    assert_matches_reference(model, reference)


@pytest.mark.parametrize("head", sorted(HEADS))
def test_ghost_clipped_sum_is_per_example(head: str) -> None:
    model, batch = _head(head)
    reference = _reference(model, batch)
    expected_norms = torch.cat([g.flatten(1) for g in reference.values()], dim=1).norm(dim=1)
    bound = float(expected_norms.median())  # some examples clipped, some not
    sums, norms = _ghost(model, batch, bound)
    torch.testing.assert_close(norms, expected_norms, rtol=RTOL, atol=ATOL)
    factors = (bound / expected_norms).clamp(max=1.0)
    for name, grads in reference.items():
        expected = torch.einsum("b,b...->...", factors, grads)
        torch.testing.assert_close(sums[name], expected, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def test_sum_reduction_sums_the_examples() -> None:
    model, batch = _head("causal_lm")
    alone = torch.stack(
        [copy.deepcopy(model)(**{k: v[i : i + 1] for k, v in batch.items()}).loss for i in range(BATCH)]
    )
    reference = _reference(model, batch)
    wrapped = GradSampleModule(model, loss_reduction="sum")
    loss = wrapped(**batch, num_items_in_batch=torch.tensor(5)).loss  # a batch-wide count: ignored
    torch.testing.assert_close(loss, alone.sum(), rtol=RTOL, atol=ATOL)
    loss.backward()
    assert_matches_reference(model, reference)


def test_unwrapping_gives_the_model_its_own_loss_back() -> None:
    model, batch = _head("causal_lm")
    own = model(**batch).loss
    before = module_fingerprint(model)
    wrapped = GradSampleModule(model).eval()  # eval: the model may then be called directly
    torch.testing.assert_close(model(**batch).loss, own, rtol=0, atol=0)  # called directly: unchanged
    assert not torch.isclose(wrapped(**batch).loss, own)
    assert wrapped.to_standard_module() is model
    model.train()
    assert module_fingerprint(model) == before
    torch.testing.assert_close(model(**batch).loss, own, rtol=0, atol=0)


def test_loss_function_set_before_wrapping_is_made_per_example_and_restored() -> None:
    from transformers.loss import loss_utils

    model, batch = _head("causal_lm")
    calls = []

    def custom(logits, labels, **kwargs):
        calls.append(logits.shape[0])
        return loss_utils.ForCausalLMLoss(logits, labels, **kwargs)

    model.loss_function = custom
    wrapped = GradSampleModule(model)
    wrapped(**batch).loss.backward()
    # not a token loss of transformers: called on each example alone (the wrapper's first-step checks may
    # run the forward again, so the number of calls is a multiple of the batch size)
    assert len(calls) >= BATCH and set(calls) == {1}
    wrapped.to_standard_module()
    assert model.loss_function is custom


def test_inline_loss_from_other_label_arguments_is_refused() -> None:
    torch.manual_seed(0)
    model = transformers.BertForQuestionAnswering(_bert_config(num_labels=2)).double()
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    wrapped = GradSampleModule(model)
    with pytest.raises(RuntimeError, match=r"BertForQuestionAnswering.*start_positions.*inline.*without labels="):
        wrapped(input_ids=ids, start_positions=torch.zeros(BATCH, dtype=torch.long),
                end_positions=torch.ones(BATCH, dtype=torch.long))  # fmt: skip
    assert all(getattr(p, "grad", None) is None for p in model.parameters())


def test_inline_loss_matching_no_head_formula_is_refused() -> None:
    class Smoothed(transformers.BertForMaskedLM):
        def forward(self, *args, labels=None, **kwargs):
            output = super().forward(*args, **kwargs)
            logits = output.logits
            output.loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), label_smoothing=0.1)
            return output

    torch.manual_seed(0)
    model = Smoothed(_bert_config()).double()
    _, batch = _head("masked_lm")
    wrapped = GradSampleModule(model)
    with pytest.raises(RuntimeError, match=r"Smoothed.*no head formula reproduce"):
        wrapped(**batch)


def test_auxiliary_term_added_to_the_loss_is_refused() -> None:
    class WithAuxiliary(transformers.GPT2LMHeadModel):
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.loss = output.loss + 0.01 * output.logits.mean()  # a term over the whole batch
            return output

    torch.manual_seed(0)
    model = WithAuxiliary(_gpt2().config).double()
    _, batch = _head("causal_lm")
    wrapped = GradSampleModule(model)
    with pytest.raises(RuntimeError, match=r"WithAuxiliary.*auxiliary term"):
        wrapped(**batch)


# ---------------------------------------------------------------------------------- black box: one step
LM_SEQ = 16  # GPT-2's n_positions
LENGTHS = (2, 2, LM_SEQ, 2, 3, 2, 2, 2, 3, 2)  # example 2 is long: the batch token mean gave it most of the weight
N = len(LENGTHS)


def _lm_dataset(drop: int | None) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (N, LM_SEQ), generator=generator)
    examples = []
    for i, length in enumerate(LENGTHS):
        if i == drop:
            continue
        mask = (torch.arange(LM_SEQ) < length).long()
        examples.append({"input_ids": ids[i], "attention_mask": mask, "labels": ids[i].masked_fill(mask == 0, -100)})
    return examples


def _released_sum_make_private(mode: str, drop: int | None) -> torch.Tensor:
    """The clipped sum one step releases (noise off): parameter change times expected batch size / lr."""
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    model = _gpt2().double()
    data = _lm_dataset(drop)
    loader = DataLoader(data, batch_size=len(data), collate_fn=torch.utils.data.default_collate)
    engine = PrivacyEngine()
    out = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader, noise_multiplier=0.0,
        max_grad_norm=CLIP, grad_sample_mode=mode, poisson_sampling=True,
    )  # fmt: skip
    wrapped, optimizer, private_loader = out  # q = 1: every example in the batch
    before = [p.detach().clone() for p in model.parameters()]
    batch = next(iter(private_loader))
    optimizer.zero_grad()
    wrapped(**batch).loss.backward()  # as Hugging Face documents it
    optimizer.step()
    scale = private_loader.expected_batch_size
    return torch.cat([(b - p.detach()).flatten() * scale for b, p in zip(before, model.parameters())])


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_removing_one_example_moves_the_causal_lm_release_by_at_most_the_clip_norm(mode: str) -> None:
    full = _released_sum_make_private(mode, drop=None)
    assert float(full.norm()) > 2 * CLIP  # several examples contribute: the test can fail
    for drop in (2, 0):
        fewer = _released_sum_make_private(mode, drop=drop)
        assert float((full - fewer).norm()) <= CLIP * (1 + 1e-6)


def _released_sum_trainer(tmp_path, mode: str, drop: int | None) -> torch.Tensor:
    pytest.importorskip("accelerate")
    from privacy_engine.integrations.hf_trainer import DPTrainer

    torch.manual_seed(0)
    model = _gpt2().double()
    data = _lm_dataset(drop)
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=len(data), max_steps=1, learning_rate=1.0,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    trainer = DPTrainer(
        model=model,
        args=arguments,
        train_dataset=data,
        noise_multiplier=0.0,
        max_grad_norm=CLIP,
        grad_sample_mode=mode,
    )
    trainer.train()
    scale = trainer.get_train_dataloader().expected_batch_size
    return torch.cat([(b - p.detach()).flatten() * scale for b, p in zip(before, model.parameters())])


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_removing_one_example_moves_the_dp_trainer_release_by_at_most_the_clip_norm(tmp_path, mode: str) -> None:
    full = _released_sum_trainer(tmp_path, mode, drop=None)
    assert float(full.norm()) > 2 * CLIP
    fewer = _released_sum_trainer(tmp_path, mode, drop=2)
    assert float((full - fewer).norm()) <= CLIP * (1 + 1e-6)


# ---------------------------------------------------------------------------------- DPTrainer seeding
def _one_noisy_step(tmp_path, **trainer_options) -> torch.Tensor:
    pytest.importorskip("accelerate")
    from privacy_engine.integrations.hf_trainer import DPTrainer

    torch.manual_seed(0)
    model = _gpt2()
    data = _lm_dataset(None)
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=len(data), max_steps=1, learning_rate=1.0,
        optim="sgd", save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,  # Trainer's seed 42
    )  # fmt: skip
    trainer = DPTrainer(model=model, args=arguments, train_dataset=data, noise_multiplier=1.0, **trainer_options)
    trainer.train()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_dp_trainer_noise_is_not_seeded_by_trainers_public_seed(tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="privacy_engine.integrations.hf_trainer"):
        first = _one_noisy_step(tmp_path)
    assert "OS entropy" in caplog.text
    second = _one_noisy_step(tmp_path)
    assert not torch.equal(first, second)


def test_dp_trainer_noise_seed_makes_the_run_reproducible(tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="privacy_engine.integrations.hf_trainer"):
        first = _one_noisy_step(tmp_path, noise_seed=5)
    assert "reproducible" in caplog.text
    assert torch.equal(first, _one_noisy_step(tmp_path, noise_seed=5))


def test_dp_trainer_refuses_coupling_or_ambiguous_settings(tmp_path) -> None:
    from privacy_engine.integrations.hf_trainer import DPTrainer

    model = _gpt2()
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="noise_seed either as an argument or in private_options"):
        DPTrainer(model=model, args=arguments, noise_multiplier=1.0, noise_seed=1, private_options={"noise_seed": 2})
    with pytest.raises(ValueError, match="noise_seed must be an int >= 0"):
        DPTrainer(model=model, args=arguments, noise_multiplier=1.0, noise_seed=-1)
    with pytest.raises(ValueError, match="noise_seed with a secure-mode PrivacyEngine"):
        DPTrainer(
            model=model,
            args=arguments,
            noise_multiplier=1.0,
            noise_seed=1,
            privacy_engine=PrivacyEngine(secure_mode=True),
        )
    smoothing = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, label_smoothing_factor=0.1
    )
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1"):
        DPTrainer(model=model, args=smoothing, noise_multiplier=1.0)
