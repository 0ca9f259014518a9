"""Where each layer's examples are (issue 21, items 2 and 4): never guessed from a size.

- Layers whose output has no batch dim (T5's relative position bias, ``(q_len, k_len, heads)``, shared by every
  example) or folds another axis into it (Swin's windows, ``(batch * windows, ...)``): the module holding them
  runs as one unit of the ``torch.func`` fallback (``grad_samplers.units``), each example alone, and is exact;
  unregistered, the error names the layer and the unit to register; when the shared axis happens to have the
  batch's size, the first step's row check refuses it (the size alone would have passed).
- The batch dim is a property of each layer's input: layers inside a module that declares its layout
  (``batch_first``) are read there, the others at the wrapper's; fast clipping of a sequence-first
  ``nn.MultiheadAttention``; a fallback module whose output holds the examples at another dim is refused.

Every exactness check is against the float64 per-example loop of ``conftest`` (each example alone through a
copy of the model), in hooks mode (``grad_sample``) and ghost mode (per-example norms and clipped sums).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ATOL, RTOL, assert_matches_reference, per_example_reference
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import grad_samplers.units
from grad_samplers import is_per_sample_unit, register_per_sample_unit, registered_per_sample_units
from privacy_engine import GhostClippingModule, GradSampleModule, PerSampleGradientClipper, PrivacyEngine
from privacy_engine.models.validation import InteractingExamplesError

MODES = ["hooks", "ghost"]
EMBED, HEADS, CLASSES = 8, 2, 3


@pytest.fixture
def unit_registry():
    """Registrations made by a test are undone after it."""
    saved = dict(grad_samplers.units._BY_CLASS)
    yield
    grad_samplers.units._BY_CLASS.clear()
    grad_samplers.units._BY_CLASS.update(saved)


# ---------------------------------------------------------------------------------- helpers
def _check_exact(model: nn.Module, mode: str, call, reference: dict[str, torch.Tensor], **wrapper_options) -> None:
    """hooks: every ``grad_sample`` equals the reference; ghost: per-example norms and the clipped sum (at the
    median norm: some examples clipped, some not) equal the reference's."""
    model = copy.deepcopy(model)
    if mode == "hooks":
        wrapped = GradSampleModule(model, **wrapper_options)
        call(wrapped).backward()
        assert_matches_reference(model, reference)
        return
    expected_norms = torch.cat([g.flatten(1) for g in reference.values()], dim=1).norm(dim=1)
    bound = float(expected_norms.median())
    params = [p for p in model.parameters() if p.requires_grad]
    clipper = PerSampleGradientClipper(params, max_grad_norm=bound)
    wrapped = GhostClippingModule(model, clipper=clipper, **wrapper_options)
    call(wrapped).backward()
    torch.testing.assert_close(wrapped.last_per_sample_norms.flatten(), expected_norms, rtol=RTOL, atol=ATOL)
    clipper.pre_step()
    factors = (bound / expected_norms).clamp(max=1.0)
    for name, param in model.named_parameters():
        expected = torch.einsum("b,b...->...", factors, reference[name])
        torch.testing.assert_close(param.grad, expected, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def _cross_entropy_reference(model: nn.Module, x: torch.Tensor, labels: torch.Tensor, batch_dim: int = 0):
    return per_example_reference(
        model, [x], lambda out, i: F.cross_entropy(out, labels[i : i + 1]), batch_dim=batch_dim
    )


# ---------------------------------------------------------------------------------- plain-torch models
class SharedBiasAttention(nn.Module):
    """Self-attention whose scores get a learned bias per relative position, looked up once for the whole
    batch: the bias embedding's output ``(T, T, heads)`` has no batch dim (T5's layout)."""

    def __init__(self, max_distance: int = 6) -> None:
        super().__init__()
        self.qkv = nn.Linear(EMBED, 3 * EMBED)
        self.out = nn.Linear(EMBED, EMBED)
        self.bias = nn.Embedding(2 * max_distance + 1, HEADS)
        self.max_distance = max_distance

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, E)
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, HEADS, EMBED // HEADS).permute(2, 0, 3, 1, 4)
        positions = torch.arange(length, device=x.device)
        relative = (positions[None, :] - positions[:, None]).clamp(-self.max_distance, self.max_distance)
        bias = self.bias(relative + self.max_distance).permute(2, 0, 1)  # (heads, T, T): every example's
        scores = q @ k.transpose(-1, -2) / math.sqrt(EMBED // HEADS) + bias
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, EMBED)
        return self.out(context)


class WindowFold(nn.Module):
    """Cuts each example's sequence into windows and folds them into the batch dim (Swin's layout)."""

    def __init__(self, window: int = 2) -> None:
        super().__init__()
        self.proj = nn.Linear(EMBED, EMBED)
        self.norm = nn.LayerNorm(EMBED)
        self.window = window

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, E)
        batch, length, _ = x.shape
        windows = x.reshape(batch * length // self.window, self.window, EMBED)
        windows = self.norm(self.proj(windows) + windows.flip(1))  # mixes the positions of one window
        return windows.reshape(batch, length, EMBED)


class Classifier(nn.Module):
    """``body`` between an input projection and a pooled head, all batch first."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Linear(5, EMBED)
        self.body = body
        self.head = nn.Linear(EMBED, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)).mean(dim=1))


def _sequences(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, 5, dtype=torch.float64, generator=generator)
    return x, torch.arange(batch) % CLASSES


# ---------------------------------------------------------------------------------- item 2: units
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("batch", "length"), [(4, 6), (4, 4), (3, 8)], ids=["T!=B", "T==B", "odd"])
def test_registered_unit_with_a_bias_shared_by_the_batch_is_exact(unit_registry, mode, batch, length) -> None:
    register_per_sample_unit(SharedBiasAttention)
    torch.manual_seed(0)
    model = Classifier(SharedBiasAttention()).double()
    x, labels = _sequences(batch, length)
    reference = _cross_entropy_reference(model, x, labels)
    _check_exact(model, mode, lambda m: F.cross_entropy(m(x), labels), reference)


@pytest.mark.parametrize("mode", MODES)
def test_registered_unit_folding_windows_into_the_batch_is_exact(unit_registry, mode) -> None:
    register_per_sample_unit(WindowFold)
    torch.manual_seed(0)
    model = Classifier(WindowFold()).double()
    x, labels = _sequences(4, 6)
    reference = _cross_entropy_reference(model, x, labels)
    _check_exact(model, mode, lambda m: F.cross_entropy(m(x), labels), reference)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("body", "layer", "unit"),
    [
        (SharedBiasAttention, r"'body\.bias' \(Embedding\) has 6 rows at dim 0", "SharedBiasAttention"),
        (WindowFold, r"'body\.proj' \(Linear\) has 12 rows at dim 0", "WindowFold"),
    ],
)
def test_unregistered_layer_without_the_batch_names_itself_and_the_unit(unit_registry, mode, body, layer, unit) -> None:
    torch.manual_seed(0)
    model = Classifier(body()).double()
    x, labels = _sequences(4, 6)
    wrapped = GradSampleModule(model) if mode == "hooks" else GhostClippingModule(
        model, clipper=PerSampleGradientClipper(list(model.parameters()), max_grad_norm=1.0))  # fmt: skip
    with pytest.raises(ValueError, match=layer) as raised:
        F.cross_entropy(wrapped(x), labels).backward()
    message = str(raised.value)
    assert f"register_per_sample_unit({__name__}.{unit})" in message
    assert f"'body' ({unit})" in message


@pytest.mark.parametrize("mode", MODES)
def test_shared_axis_with_the_batchs_size_is_refused_by_the_row_check(unit_registry, mode) -> None:
    """T == B: the bias embedding's (T, T, heads) output has the batch size at dim 0, which a size check
    accepts. The first step's sub-batch forward shows that axis does not follow the examples: refused before
    anything is released."""
    torch.manual_seed(0)
    model = Classifier(SharedBiasAttention()).double()
    x, labels = _sequences(8, 4)
    engine = PrivacyEngine(accountant="rdp")
    private_model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, labels), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling=False, grad_sample_mode=mode,
    )  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InteractingExamplesError, match=r"'body\.bias' \(Embedding\) does not hold the examples at dim 0"):
        for inputs, targets in loader:
            optimizer.zero_grad()
            F.cross_entropy(private_model(inputs), targets).backward()
            optimizer.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert engine.accountant.steps == 0


def test_registered_unit_trains_through_make_private_with_the_row_check(unit_registry) -> None:
    register_per_sample_unit(SharedBiasAttention)
    torch.manual_seed(0)
    model = Classifier(SharedBiasAttention()).double()
    x, labels = _sequences(8, 4)
    engine = PrivacyEngine(accountant="rdp")
    private_model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, labels), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling=False,
    )  # fmt: skip
    for inputs, targets in loader:
        optimizer.zero_grad()
        F.cross_entropy(private_model(inputs), targets).backward()
        optimizer.step()
    assert engine.accountant.steps == 2


def test_unit_registration_checks_its_arguments(unit_registry) -> None:
    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_per_sample_unit("SharedBiasAttention")
    with pytest.raises(TypeError, match="when must be a callable"):
        register_per_sample_unit(SharedBiasAttention, when=True)
    register_per_sample_unit(SharedBiasAttention, when=lambda module: module.max_distance > 3)
    assert is_per_sample_unit(SharedBiasAttention(max_distance=6))
    assert not is_per_sample_unit(SharedBiasAttention(max_distance=2))
    assert not is_per_sample_unit(WindowFold())
    listed = registered_per_sample_units()
    assert listed[0] == f"{__name__}.SharedBiasAttention"
    assert "transformers.models.t5.modeling_t5.T5Attention" in listed


# ---------------------------------------------------------------------------------- item 2: HF models
def _t5(transformers):
    config = transformers.T5Config(
        vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _swin(transformers):
    config = transformers.SwinConfig(
        image_size=16, patch_size=2, num_channels=3, embed_dim=8, depths=[2, 1], num_heads=[1, 2], window_size=2,
        num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
    )  # fmt: skip
    return transformers.SwinForImageClassification(config)


def _opt(transformers):
    config = transformers.OPTConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.OPTForCausalLM(config)


def _deberta_v2(transformers):
    config = transformers.DebertaV2Config(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        num_labels=CLASSES, max_position_embeddings=32, relative_attention=True, position_buckets=8,
        max_relative_positions=16, pos_att_type=["p2c", "c2p"], pooler_dropout=0.0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.DebertaV2ForSequenceClassification(config)


def _hf_case(name: str, batch: int, length: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if name == "t5":
        model = _t5(transformers).double().train()
        inputs = {
            "input_ids": torch.randint(1, 50, (batch, length), generator=generator),
            "labels": torch.randint(1, 50, (batch, length - 2), generator=generator),
        }
    elif name in ("opt", "deberta"):
        model = (_opt if name == "opt" else _deberta_v2)(transformers).double().train()
        ids = torch.randint(3, 50, (batch, length), generator=generator)
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[-1, length - 2 :] = 0  # one padded example
        labels = ids.masked_fill(mask == 0, -100) if name == "opt" else torch.arange(batch) % CLASSES
        inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    else:
        model = _swin(transformers).double().train()
        inputs = {
            "pixel_values": torch.randn(batch, 3, 16, 16, dtype=torch.float64, generator=generator),
            "labels": torch.arange(batch) % CLASSES,
        }
    first, *rest = inputs
    reference = per_example_reference(
        model, [inputs[first]], lambda out, i: out.loss, kwargs={key: inputs[key] for key in rest}
    )
    return model, inputs, reference


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("name", "batch", "length"),
    [("t5", 4, 7), ("t5", 4, 6), ("swin", 4, 0), ("opt", 4, 6)],
    ids=["t5", "t5-decoder-length-equals-batch", "swin", "opt"],
)
def test_hf_models_with_layers_without_the_batch_are_exact(mode, name, batch, length) -> None:
    """From tiny configs, exact in both modes: T5 (relative position bias, in encoder and decoder), Swin (windows
    folded into the batch, learned relative position bias added through the attention mask), OPT (feed-forward
    on (batch * seq_len, hidden)). (DeBERTa-v2 runs as a unit too, but its own logits for an example alone
    differ from those in a batch by ~1e-8 relative, so the per-example loop is no reference to 1e-6 there.)"""
    model, inputs, reference = _hf_case(name, batch, length)
    _check_exact(model, mode, lambda m: m(**inputs).loss, reference)


def test_t5_attention_with_the_relative_bias_is_a_unit_and_the_others_are_hooked() -> None:
    transformers = pytest.importorskip("transformers")
    model = _t5(transformers)
    first = model.encoder.block[0].layer[0].SelfAttention
    later = model.encoder.block[1].layer[0].SelfAttention
    assert first.has_relative_attention_bias and is_per_sample_unit(first)
    assert not later.has_relative_attention_bias and not is_per_sample_unit(later)
    wrapped = GradSampleModule(model)
    patched = set(map(id, wrapped._tables.patched))
    assert id(first) in patched and id(later) not in patched  # later layers keep their own samplers


# ---------------------------------------------------------------------------------- item 4: layouts
class SequenceFirstEncoder(nn.Module):
    """Token ids (B, T) -> a sequence-first ``nn.TransformerEncoder`` (T, B, E) -> a batch-first head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, EMBED)
        layer = nn.TransformerEncoderLayer(EMBED, HEADS, 16, dropout=0.0, batch_first=False)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(EMBED, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(ids).transpose(0, 1))
        return self.head(hidden.mean(dim=0))


class DeclaredTimeMajor(nn.Module):
    """A hand-written block that runs its layers on (T, B, E) and says so (``batch_first = False``)."""

    batch_first = False

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(EMBED, EMBED)
        self.norm = nn.LayerNorm(EMBED)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, E) in and out
        time_major = x.transpose(0, 1)
        return self.norm(torch.tanh(self.mix(time_major))).transpose(0, 1)


@pytest.mark.parametrize("mode", MODES)
def test_sequence_first_encoder_under_a_batch_first_head_is_exact(mode) -> None:
    torch.manual_seed(0)
    model = SequenceFirstEncoder().double()
    ids = torch.randint(0, 20, (5, 7))
    labels = torch.arange(5) % CLASSES
    reference = _cross_entropy_reference(model, ids, labels)
    _check_exact(model, mode, lambda m: F.cross_entropy(m(ids), labels), reference)


@pytest.mark.parametrize("mode", MODES)
def test_module_declaring_its_layout_has_its_layers_read_there(mode) -> None:
    torch.manual_seed(0)
    model = Classifier(DeclaredTimeMajor()).double()
    x, labels = _sequences(5, 7)
    reference = _cross_entropy_reference(model, x, labels)
    _check_exact(model, mode, lambda m: F.cross_entropy(m(x), labels), reference)


@pytest.mark.parametrize("mode", MODES)
def test_sequence_first_encoder_trains_through_make_private_with_the_row_check(mode) -> None:
    torch.manual_seed(0)
    model = SequenceFirstEncoder().double()
    ids = torch.randint(0, 20, (10, 7))
    labels = torch.arange(10) % CLASSES
    engine = PrivacyEngine(accountant="rdp")
    private_model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(ids, labels), batch_size=5), noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling=False, grad_sample_mode=mode,
    )  # fmt: skip
    for inputs, targets in loader:
        optimizer.zero_grad()
        F.cross_entropy(private_model(inputs), targets).backward()
        optimizer.step()
    assert engine.accountant.steps == 2


class SequenceFirstAttention(nn.Module):
    """``nn.MultiheadAttention(batch_first=False)`` and a head, on (T, B, E) throughout."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(EMBED, HEADS)
        self.head = nn.Linear(EMBED, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attended, _ = self.attention(x, x, x)
        return self.head(attended)  # (T, B, classes)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("length", "batch"), [(12, 9), (6, 6)])
def test_sequence_first_attention_in_a_sequence_first_wrapper_is_exact(mode, length, batch) -> None:
    """Fast clipping decomposes the attention batch first; its projections' output gradients are not moved again
    (they were: "reached out_proj with 12 examples but 'head' with 9")."""
    torch.manual_seed(0)
    model = SequenceFirstAttention().double()
    x = torch.randn(length, batch, EMBED, dtype=torch.float64)
    reference = per_example_reference(model, [x], lambda out, i: out.square().sum(), batch_dim=1)
    _check_exact(model, mode, lambda m: m(x).square().sum(), reference, batch_first=False, loss_reduction="sum")


class WholeModelFallback(nn.Module):
    """Owns a parameter of its own (too large for the root-parameter path), so the whole model is one fallback
    module; its input is sequence first and its output batch first."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, B, 16) -> (B, classes)
        return self.head(self.proj(x * self.scale).mean(dim=0))


@pytest.mark.parametrize("mode", MODES)
def test_fallback_output_holding_the_examples_at_another_dim_is_refused(mode) -> None:
    """It used to come back as (1, B, C) without an error."""
    model = WholeModelFallback().double()
    wrapped = GradSampleModule(model, batch_first=False) if mode == "hooks" else GhostClippingModule(
        model, batch_first=False, clipper=PerSampleGradientClipper(list(model.parameters()), max_grad_norm=1.0))  # fmt: skip
    with pytest.raises(ValueError, match=r"the model \(WholeModelFallback\).*shape \(1, 3\).*no axis of size 1 at dim 1"):
        wrapped(torch.randn(7, 5, 16, dtype=torch.float64))


@pytest.mark.slow
def test_deberta_relative_position_embeddings_run_as_a_unit() -> None:
    """DeBERTa-v2's encoder (relative position embeddings shared by every example) runs as one unit. Its own
    logits for an example alone differ from those in a batch by ~1e-8 relative (the model's float32 position
    buckets and scale), so the reference here is the batched model: the per-sample gradients sum to its gradient,
    and the head's are the analytic per-example ones."""
    model, inputs, _ = _hf_case("deberta", 4, 6)
    plain = copy.deepcopy(model)
    logits = plain(**inputs).logits
    F.cross_entropy(logits, inputs["labels"], reduction="sum").backward()
    wrapped = GradSampleModule(model, loss_reduction="sum")
    F.cross_entropy(wrapped(**{k: v for k, v in inputs.items() if k != "labels"}).logits, inputs["labels"],
                    reduction="sum").backward()  # fmt: skip
    assert wrapped._tables.owner_paths[model.deberta.encoder.rel_embeddings.weight] == "deberta.encoder"
    for (name, param), (_, expected) in zip(model.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(param.grad_sample.sum(0), expected.grad, rtol=1e-10, atol=1e-12, msg=name)
    analytic = torch.softmax(logits.detach(), dim=-1)
    analytic[torch.arange(4), inputs["labels"]] -= 1
    torch.testing.assert_close(model.classifier.bias.grad_sample, analytic, rtol=1e-12, atol=1e-14)
