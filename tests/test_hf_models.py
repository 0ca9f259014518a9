"""Hugging Face models called as their documentation calls them, and layers shared by every example.

Each HF model is built from a tiny config (no download), in float64 with dropout off, and called as
``model(input_ids=..., attention_mask=..., labels=...)``: HF then looks position embeddings up with
``position_ids`` of shape ``(1, T)`` (a layer output shared by the whole batch). The reference is the
per-example loop of ``conftest``: example ``i`` alone through a copy of the model, with the loss the model
computes on that batch of one. The wrapped model's ``.loss`` is per-example by construction
(``privacy_engine.integrations.hf_losses``), so its per-sample gradients must equal it; the coupled batch
loss (a token mean over the whole batch) would not.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ATOL, RTOL, assert_matches_reference, per_example_reference
from torch import nn

from privacy_engine import GhostClippingModule, GradSampleModule, PerSampleGradientClipper

BATCH, SEQ, VOCAB, LABELS = 4, 8, 50, 3  # BATCH a power of two: scaling a float32 loss by it is exact


# ---------------------------------------------------------------------------------- helpers
def _ghost_clipped_sum(model: nn.Module, call, max_grad_norm: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Run one ghost-clipping backward; return name -> clipped sum and the per-example norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    clipper = PerSampleGradientClipper(params, max_grad_norm=max_grad_norm)
    wrapped = GhostClippingModule(model, clipper=clipper)
    call(wrapped).backward()
    norms = wrapped.last_per_sample_norms.flatten()
    clipper.pre_step()
    sums = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    wrapped.to_standard_module()
    return sums, norms


def _reference_clipped_sum(reference: dict[str, torch.Tensor], max_grad_norm: float):
    norms = torch.cat([g.flatten(1) for g in reference.values()], dim=1).norm(dim=1)
    factors = (max_grad_norm / norms).clamp(max=1.0)
    return {name: torch.einsum("b,b...->...", factors, g) for name, g in reference.items()}, norms


def _assert_ghost_matches(model: nn.Module, call, reference: dict[str, torch.Tensor]) -> None:
    expected_norms = torch.cat([g.flatten(1) for g in reference.values()], dim=1).norm(dim=1)
    bound = float(expected_norms.median())  # some examples clipped, some not
    sums, norms = _ghost_clipped_sum(model, call, bound)
    expected, _ = _reference_clipped_sum(reference, bound)
    torch.testing.assert_close(norms, expected_norms, rtol=RTOL, atol=ATOL)
    assert set(sums) == set(expected)
    for name in sums:
        torch.testing.assert_close(sums[name], expected[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------- broadcast layers
class PositionEmbedded(nn.Module):
    """Token embedding plus a position embedding looked up with positions of shape (1, T)."""

    def __init__(self, positions_first: bool = False) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, 6)
        self.positions = nn.Embedding(SEQ, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, LABELS)
        self.positions_first = positions_first

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1]).unsqueeze(0)
        if self.positions_first:
            shared = self.positions(position_ids)
            hidden = shared + self.tokens(ids)
        else:
            hidden = self.tokens(ids) + self.positions(position_ids)
        return self.head(self.norm(hidden).mean(dim=1))


def _labels(batch: int) -> torch.Tensor:
    return torch.arange(batch) % LABELS


@pytest.mark.parametrize("positions_first", [False, True], ids=["after-tokens", "before-tokens"])
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_position_embedding_shared_by_the_batch_is_exact(positions_first: bool, batch: int) -> None:
    torch.manual_seed(batch)
    model = PositionEmbedded(positions_first).double()
    ids = torch.randint(0, VOCAB, (batch, SEQ))
    labels = _labels(batch)
    reference = per_example_reference(
        model, [ids], lambda out, i: nn.functional.cross_entropy(out, labels[i : i + 1])
    )
    wrapped = GradSampleModule(model)
    nn.functional.cross_entropy(wrapped(ids), labels).backward()
    assert_matches_reference(model, reference)


@pytest.mark.parametrize("positions_first", [False, True], ids=["after-tokens", "before-tokens"])
def test_position_embedding_shared_by_the_batch_ghost(positions_first: bool) -> None:
    torch.manual_seed(0)
    model = PositionEmbedded(positions_first).double()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = _labels(BATCH)
    reference = per_example_reference(
        model, [ids], lambda out, i: nn.functional.cross_entropy(out, labels[i : i + 1])
    )
    _assert_ghost_matches(model, lambda m: nn.functional.cross_entropy(m(ids), labels), reference)


def test_shared_layer_output_keeps_its_values() -> None:
    """The broadcast layer's output is handed on expanded: same values, batch size B."""
    torch.manual_seed(0)
    model = PositionEmbedded(positions_first=True).double()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    expected = model(ids)
    wrapped = GradSampleModule(model)
    torch.testing.assert_close(wrapped(ids), expected, rtol=0, atol=0)


def test_shared_layer_before_the_batch_is_known_raises_clearly() -> None:
    """Positions (1, T) first, and the inputs do not say which size is the batch (one tensor each)."""
    model = PositionEmbedded(positions_first=True).double()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    wrapped = GradSampleModule(model)
    message = r"'positions' \(Embedding\) got 1 example.*'tokens' \(Embedding\), later, got 4.*position_ids of shape"
    with pytest.raises(ValueError, match=message):
        wrapped(ids, torch.arange(SEQ).unsqueeze(0))


def test_input_batch_decided_by_the_majority_of_inputs() -> None:
    """ids, positions and a mask: the batch size most inputs have wins, so positions first still works."""

    class WithMask(PositionEmbedded):
        def forward(self, ids, position_ids, mask):
            return super().forward(ids, position_ids) * mask[:, :1]

    torch.manual_seed(0)
    model = WithMask(positions_first=True).double()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    positions = torch.arange(SEQ).unsqueeze(0)
    mask = torch.ones(BATCH, SEQ, dtype=torch.float64)
    labels = _labels(BATCH)
    # The positions are shared by every example (the conftest loop would slice them): loop here.
    reference_model = copy.deepcopy(model)
    stacks: dict[str, list[torch.Tensor]] = {n: [] for n, _ in reference_model.named_parameters()}
    for i in range(BATCH):
        reference_model.zero_grad()
        out = reference_model(ids[i : i + 1], positions, mask[i : i + 1])
        nn.functional.cross_entropy(out, labels[i : i + 1]).backward()
        for name, param in reference_model.named_parameters():
            stacks[name].append(param.grad.clone())
    reference = {name: torch.stack(grads) for name, grads in stacks.items()}
    wrapped = GradSampleModule(model)
    nn.functional.cross_entropy(wrapped(ids, positions, mask), labels).backward()
    assert_matches_reference(model, reference)


def test_batch_of_one_is_not_expanded() -> None:
    """A (T, T) mask first and a batch of one: a tie, so no layer is taken for a broadcast."""

    class MaskFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(SEQ, SEQ)

        def forward(self, mask, x):
            return self.proj(x) + mask

    model = MaskFirst().double()
    wrapped = GradSampleModule(model)
    out = wrapped(torch.zeros(SEQ, SEQ, dtype=torch.float64), torch.randn(1, SEQ, SEQ, dtype=torch.float64))
    assert out.shape == (1, SEQ, SEQ)
    out.sum().backward()
    assert model.proj.weight.grad_sample.shape == (1, SEQ, SEQ)


def test_empty_batch_with_shared_layer() -> None:
    model = PositionEmbedded().double()
    wrapped = GradSampleModule(model)
    out = wrapped(torch.zeros(0, SEQ, dtype=torch.long))
    assert out.shape == (0, LABELS)
    out.sum().backward()
    assert model.positions.weight.grad_sample.shape == (0, SEQ, 6)


def test_other_batch_mismatch_still_raises() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 2)
            self.b = nn.Linear(3, 2)

        def forward(self, x, y):
            return self.a(x).sum() + self.b(y).sum()

    wrapped = GradSampleModule(TwoInputs())
    with pytest.raises(ValueError, match=r"'b' \(Linear\) has 3 rows at dim 0.* but 'a' \(Linear\) had 4"):
        wrapped(torch.randn(4, 3), torch.randn(3, 3))


# ---------------------------------------------------------------------------------- HF Conv1D sampler
def test_conv1d_samplers_agree_with_per_example_loop() -> None:
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    from grad_samplers import grad_sampler_for
    from grad_samplers.hf_conv1d import conv1d_grad_sample, conv1d_norm_sample, conv1d_weighted_sum

    torch.manual_seed(0)
    layer = pytorch_utils.Conv1D(5, 3).double()
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    reference = per_example_reference(layer, [x], lambda out, i: out.pow(2).sum())
    wrapped = GradSampleModule(layer)
    assert grad_sampler_for(layer) is conv1d_grad_sample
    wrapped(x).pow(2).sum().mul(1.0 / 4).backward()
    assert_matches_reference(layer, reference)
    with torch.no_grad():
        grads = 2 * layer(x)
    norms = conv1d_norm_sample(layer, (x,), grads)
    weights = torch.rand(4, dtype=torch.float64)
    sums = conv1d_weighted_sum(layer, (x,), grads, weights)
    for name, param in layer.named_parameters():
        torch.testing.assert_close(norms[param], reference[name].flatten(1).pow(2).sum(1))
        torch.testing.assert_close(sums[param], torch.einsum("b,b...->...", weights, reference[name]))


# ---------------------------------------------------------------------------------- HF models
def _transformers():
    return pytest.importorskip("transformers")


def _bert(transformers):
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(config)


def _gpt2(transformers):
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def _llama(transformers):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def _vit(transformers):
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.ViTForImageClassification(config)


def _text_batch(causal_lm: bool, generator: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 2 :] = 0  # one padded example
    if causal_lm:
        labels = ids.masked_fill(mask == 0, -100)
    else:
        labels = torch.randint(0, LABELS, (BATCH,), generator=generator)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


FAMILIES = {
    "bert": (_bert, "classification"),
    "gpt2": (_gpt2, "causal_lm"),
    "llama": (_llama, "causal_lm"),
    "vit": (_vit, "image"),
}


def _family(name: str):
    transformers = _transformers()
    build, kind = FAMILIES[name]
    torch.manual_seed(0)
    model = build(transformers).double().train()
    generator = torch.Generator().manual_seed(1)
    if kind == "image":
        batch = {
            "pixel_values": torch.randn(BATCH, 3, 8, 8, dtype=torch.float64, generator=generator),
            "labels": torch.randint(0, LABELS, (BATCH,), generator=generator),
        }
    else:
        batch = _text_batch(kind == "causal_lm", generator)
    return model, batch, kind


def _hf_reference(model: nn.Module, batch: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """Each example alone through a copy of the model, its loss the one HF computes on a batch of one.

    That is the definition of a per-example loss (issue 18): not the example's share of the batch loss, whose
    token mean couples every example to the others' lengths."""
    first, *rest = batch  # the model's first positional argument (input_ids / pixel_values)
    return per_example_reference(
        model, [batch[first]], lambda out, i: out.loss, kwargs={name: batch[name] for name in rest}
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_model_per_sample_gradients_exact(family: str) -> None:
    model, batch, kind = _family(family)
    reference = _hf_reference(model, batch, kind)
    wrapped = GradSampleModule(model)
    wrapped(**batch).loss.backward()
    assert_matches_reference(model, reference)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_model_ghost_clipping_exact(family: str) -> None:
    model, batch, kind = _family(family)
    reference = _hf_reference(model, batch, kind)
    _assert_ghost_matches(model, lambda m: m(**batch).loss, reference)


def test_gpt2_uses_the_conv1d_sampler_and_ties_embeddings() -> None:
    from grad_samplers import grad_sampler_for
    from grad_samplers.hf_conv1d import conv1d_grad_sample

    model, _, _ = _family("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    GradSampleModule(model)
    assert grad_sampler_for(model.transformer.h[0].attn.c_attn) is conv1d_grad_sample


def _lora(model: nn.Module, target_modules: list[str]):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=target_modules)
    return peft.get_peft_model(model, config).double()


@pytest.mark.parametrize("family,targets", [("bert", ["query", "value"]), ("llama", ["q_proj", "v_proj"]),
                                            ("gpt2", ["c_attn"])])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_lora_adapters_exact(family: str, targets: list[str], mode: str) -> None:
    model, batch, kind = _family(family)
    model = _lora(model, targets)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    reference = _hf_reference(model, batch, kind)
    if mode == "hooks":
        wrapped = GradSampleModule(model)
        wrapped(**batch).loss.backward()
        assert_matches_reference(model, reference)
        assert all(getattr(p, "grad_sample", None) is None for p in model.parameters() if not p.requires_grad)
    else:
        _assert_ghost_matches(model, lambda m: m(**batch).loss, reference)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("family", ["gpt2", "llama-lora"])
def test_hf_model_trains_under_dp(family: str, mode: str) -> None:
    """A few DP-SGD steps through PrivacyEngine, the model called as HF documents."""
    from torch.utils.data import DataLoader, TensorDataset

    from privacy_engine import PrivacyEngine

    model, _, _ = _family(family.split("-")[0])
    if family.endswith("lora"):
        model = _lora(model, ["q_proj", "v_proj"])
    model = model.float()
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (32, SEQ), generator=generator)
    loader = DataLoader(TensorDataset(ids, torch.ones_like(ids)), batch_size=8)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine = PrivacyEngine(accountant="rdp")
    private_model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        grad_sample_mode=mode,
    )
    steps = 0
    for input_ids, attention_mask in loader:
        if len(input_ids) == 0:
            continue
        optimizer.zero_grad()
        loss = private_model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()
        steps += 1
    assert steps >= 2
    assert all(not torch.equal(before[name], p) for name, p in model.named_parameters() if p.requires_grad)
    assert engine.get_epsilon(delta=1e-5) > 0


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_activation_checkpointing_is_exact(mode: str, use_reentrant: bool) -> None:
    # HF's gradient checkpointing (issue 21): per-example results equal the float64 per-example loop.
    model, batch, kind = _family("bert")
    reference = _hf_reference(model, batch, kind)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    if mode == "ghost":
        _assert_ghost_matches(model, lambda m: m(**batch).loss, reference)
    else:
        wrapped = GradSampleModule(model)
        wrapped(**batch).loss.backward()
        assert_matches_reference(model, reference)
