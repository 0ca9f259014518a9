"""Ghost clipping of a weight tied between an embedding and a linear head (``clipping.ghost.tied``).

The per-example norm of a tied weight is ``||S_i + H_i||`` with ``S_i`` the embedding's and ``H_i`` the head's
gradient of it; the tied form gets it from each use's own norm form plus the cross term ``2 <S_i, H_i>`` and never
forms the ``(B, V, d)`` per-example gradients. Checked against a float64 per-example loop (clipped sums and norms,
rel 1e-10) for small language models with various vocabularies, lengths and batches, a padding index, the head
before or after the embedding, several uses per forward, HF GPT-2 and Llama with tied embeddings; that nothing of
size ``B x V x d`` is allocated; that nothing of the pass outlives it.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from conftest import per_example_reference
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from grad_samplers.embedding import embedding_grad_sample, embedding_gradient_factors
from grad_samplers.linear import linear_grad_sample, linear_gradient_factors
from privacy_engine.clipping import PerSampleGradientClipper
from privacy_engine.clipping.ghost import GhostClippingModule
from privacy_engine.clipping.ghost import backward as ghost_backward
from privacy_engine.clipping.ghost import tied as tied_module
from privacy_engine.clipping.ghost.uses import BackwardPass
from privacy_engine.clipping.rule import clip_factors

DOUBLE = torch.float64


# ---------------------------------------------------------------------------------------------- models
class TiedLM(nn.Module):
    """Embedding -> Linear + tanh -> head, the head's weight the embedding's table (``TiedEmbeddings`` of
    test_ghost_clipping, with a vocabulary, padding index and head bias to choose)."""

    def __init__(self, vocab: int, dim: int, padding_idx: int | None = None, head_bias: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=head_bias)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


class HeadFirst(nn.Module):
    """The tied weight read first as a linear map (features -> vocabulary scores), then as an embedding of
    another input of another length: backward reaches the embedding first."""

    def __init__(self, vocab: int, dim: int, padding_idx: int | None = None) -> None:
        super().__init__()
        self.head = nn.Linear(dim, vocab, bias=False)
        self.embed = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.embed.weight = self.head.weight
        self.down = nn.Linear(vocab, dim)
        self.out = nn.Linear(dim, 3)

    def forward(self, features, tokens):
        scores = self.down(torch.tanh(self.head(features)))
        return self.out(torch.tanh(torch.cat([scores, self.embed(tokens)], dim=1)))


class TwiceThrough(nn.Module):
    """A tied model run twice in one forward (on the tokens and on them reversed): four uses of the tied weight,
    every pair's cross term (embedding x embedding, head x head, embedding x head)."""

    def __init__(self, vocab: int, dim: int, padding_idx: int | None = None) -> None:
        super().__init__()
        self.lm = TiedLM(vocab, dim, padding_idx)

    def forward(self, tokens):
        return self.lm(tokens) + 0.5 * self.lm(tokens.flip(1))


# ---------------------------------------------------------------------------------------------- helpers
def example_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).flatten(1).sum(dim=1)


def reference(model: nn.Module, inputs: tuple, target: torch.Tensor, max_grad_norm: float, keep=None):
    """Float64 per-example loop: (name -> clipped sum, norms, name -> sum_i f_i ||g_i|| (the terms' scale))."""
    per_sample = per_example_reference(model, inputs, lambda out, i: example_loss(out, target[i : i + 1]).sum())
    norms = torch.sqrt(sum(g.flatten(1).square().sum(dim=1) for g in per_sample.values()))
    factors = clip_factors(norms, max_grad_norm)
    if keep is not None:
        factors = torch.where(keep, factors, torch.zeros_like(factors))
    sums = {name: torch.tensordot(factors, g, dims=1) for name, g in per_sample.items()}
    scales = {name: float(factors @ g.flatten(1).norm(dim=1)) for name, g in per_sample.items()}
    return sums, norms, scales


def ghost(model: nn.Module, inputs: tuple, target: torch.Tensor, max_grad_norm: float, *, reduction="mean",
          padding_mask=None):  # fmt: skip
    """One ghost pass: (name -> clipped sum, per-example norms, the wrapper)."""
    clipper = PerSampleGradientClipper([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    wrapped = GhostClippingModule(model, clipper=clipper, loss_reduction=reduction)
    losses = example_loss(wrapped(*inputs), target)
    if padding_mask is not None:
        wrapped.set_padding_mask(padding_mask)
    (losses.mean() if reduction == "mean" else losses.sum()).backward()
    clipper.pre_step()
    sums = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return sums, wrapped.last_per_sample_norms[:, 0], wrapped


def assert_exact(sums, norms, expected, expected_norms, scales, rtol=1e-10) -> None:
    torch.testing.assert_close(norms, expected_norms, rtol=rtol, atol=0)
    assert set(sums) == set(expected)
    for name, value in expected.items():
        error = float((sums[name] - value).norm())
        assert error <= rtol * max(scales[name], 1e-300), f"{name}: error {error:.3g}, scale {scales[name]:.3g}"


def tokens_for(batch: int, length: int, vocab: int, generator: torch.Generator, padding_idx=None) -> torch.Tensor:
    tokens = torch.randint(0, vocab, (batch, length), generator=generator)
    tokens[:, 0] = tokens[:, -1]  # a repeated token in every example
    if padding_idx is not None:
        tokens[0, -2:] = padding_idx  # padding in one example
    return tokens


def _case(model: nn.Module, inputs: tuple, seed: int = 0):
    model = model.to(DOUBLE)
    with torch.no_grad():
        target = torch.randn(model(*inputs).shape, generator=torch.Generator().manual_seed(seed), dtype=DOUBLE)
    return model, inputs, target


def _median_bound(model, inputs, target) -> float:
    """A clipping bound between the examples' norms: some clipped, some not."""
    _, norms, _ = reference(model, inputs, target, float("inf"))
    return float(norms.median())


class _UsesOfTheTiedForm:
    """Spy on ``tied_uses``: the parameters each pass tied (weakly held ``TiedUses``: the spy keeps nothing)."""

    def __init__(self, monkeypatch) -> None:
        self.tied: list[frozenset] = []
        self.passes: list[weakref.ref] = []
        original = tied_module.tied_uses

        def spy(uses, shared):
            result = original(uses, shared)
            if result is not None:
                self.tied.append(result.parameters)
                self.passes.append(weakref.ref(result))
            return result

        monkeypatch.setattr(ghost_backward, "tied_uses", spy)


# ---------------------------------------------------------------------------------------------- factor forms
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_factors_rebuild_its_per_example_gradients(padding_idx) -> None:
    generator = torch.Generator().manual_seed(0)
    layer = nn.Embedding(9, 3, padding_idx=padding_idx).double()
    tokens = tokens_for(4, 6, 9, generator, padding_idx)
    grads = torch.randn(4, 6, 3, generator=generator, dtype=DOUBLE)
    indices, rows = embedding_gradient_factors(layer, (tokens,), grads)
    rebuilt = torch.zeros(4, 9, 3, dtype=DOUBLE)
    for i in range(4):
        rebuilt[i].index_add_(0, indices[i], rows[i])
    assert torch.equal(rebuilt, embedding_grad_sample(layer, (tokens,), grads)[layer.weight])


@pytest.mark.parametrize("positions", [(), (5,), (2, 3)])
def test_linear_factors_rebuild_its_per_example_gradients(positions) -> None:
    generator = torch.Generator().manual_seed(1)
    layer = nn.Linear(4, 6).double()
    inputs = torch.randn(3, *positions, 4, generator=generator, dtype=DOUBLE)
    grads = torch.randn(3, *positions, 6, generator=generator, dtype=DOUBLE)
    row_grads, columns = linear_gradient_factors(inputs, grads)
    rebuilt = torch.bmm(row_grads.transpose(1, 2), columns)
    torch.testing.assert_close(rebuilt, linear_grad_sample(layer, (inputs,), grads)[layer.weight], rtol=1e-14, atol=0)


# ---------------------------------------------------------------------------------------------- exactness
TIED_LM_CASES = [
    # (vocab, dim, length, batch, padding_idx, head_bias)
    (7, 4, 5, 4, None, False),  # test_ghost_clipping's TiedEmbeddings sizes
    (13, 5, 1, 3, None, True),  # one position: the head's rank-one form
    (31, 6, 9, 5, 0, False),  # a padding index
    (97, 8, 16, 2, 3, True),  # Gram form for the head (positions * (in + out) < in * out)
    (257, 4, 40, 6, None, False),  # a long input: the embedding's segment form
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("vocab", "dim", "length", "batch", "padding_idx", "head_bias"), TIED_LM_CASES)
def test_tied_lm_matches_the_per_example_loop(
    vocab, dim, length, batch, padding_idx, head_bias, reduction, monkeypatch
):
    spy = _UsesOfTheTiedForm(monkeypatch)
    torch.manual_seed(vocab)
    generator = torch.Generator().manual_seed(length)
    model, inputs, target = _case(
        TiedLM(vocab, dim, padding_idx, head_bias), (tokens_for(batch, length, vocab, generator, padding_idx),)
    )
    bound = _median_bound(model, inputs, target)
    expected, expected_norms, scales = reference(model, inputs, target, bound)
    sums, norms, _ = ghost(copy.deepcopy(model), inputs, target, bound, reduction=reduction)
    assert_exact(sums, norms, expected, expected_norms, scales)
    assert len(spy.tied) == 1 and len(spy.tied[0]) == 1  # the tied form ran, for the one shared weight


@pytest.mark.parametrize(("vocab", "feature_length", "token_length", "padding_idx"), [(11, 3, 5, None), (50, 7, 2, 1)])
def test_head_before_the_embedding_matches_the_per_example_loop(vocab, feature_length, token_length, padding_idx,
                                                                monkeypatch):  # fmt: skip
    spy = _UsesOfTheTiedForm(monkeypatch)
    torch.manual_seed(2)
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(4, feature_length, 6, generator=generator, dtype=DOUBLE)
    model, inputs, target = _case(
        HeadFirst(vocab, 6, padding_idx), (features, tokens_for(4, token_length, vocab, generator, padding_idx))
    )
    bound = _median_bound(model, inputs, target)
    expected, expected_norms, scales = reference(model, inputs, target, bound)
    sums, norms, _ = ghost(copy.deepcopy(model), inputs, target, bound)
    assert_exact(sums, norms, expected, expected_norms, scales)
    assert len(spy.tied) == 1


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_several_uses_in_one_forward_match_the_per_example_loop(padding_idx, monkeypatch):
    spy = _UsesOfTheTiedForm(monkeypatch)
    torch.manual_seed(4)
    model, inputs, target = _case(
        TwiceThrough(23, 5, padding_idx), (tokens_for(5, 6, 23, torch.Generator().manual_seed(5), padding_idx),)
    )
    bound = _median_bound(model, inputs, target)
    expected, expected_norms, scales = reference(model, inputs, target, bound)
    sums, norms, _ = ghost(copy.deepcopy(model), inputs, target, bound)
    assert_exact(sums, norms, expected, expected_norms, scales)
    assert len(spy.tied) == 1


def test_two_forwards_before_one_backward_match_the_per_example_loop(monkeypatch):
    # Two calls of the wrapper, their losses added: the pass sees both forwards' uses of the tied weight.
    spy = _UsesOfTheTiedForm(monkeypatch)
    torch.manual_seed(6)
    generator = torch.Generator().manual_seed(6)
    model = TiedLM(19, 4, padding_idx=1).to(DOUBLE)
    first, second = tokens_for(4, 5, 19, generator, 1), tokens_for(4, 3, 19, generator, 1)
    target_first = torch.randn(4, 5, 19, generator=generator, dtype=DOUBLE)
    target_second = torch.randn(4, 3, 19, generator=generator, dtype=DOUBLE)

    class BothBatches(nn.Module):  # the same two forwards, as one model, for the per-example loop
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, a, b):
            return torch.cat([self.lm(a), self.lm(b)], dim=1)

    target = torch.cat([target_first, target_second], dim=1)
    bound = _median_bound(BothBatches(model), (first, second), target)
    expected, expected_norms, scales = reference(BothBatches(model), (first, second), target, bound)
    clipper = PerSampleGradientClipper(list(model.parameters()), bound)
    lm = copy.deepcopy(model)
    clipper = PerSampleGradientClipper(list(lm.parameters()), bound)
    wrapped = GhostClippingModule(lm, clipper=clipper, loss_reduction="sum")
    (example_loss(wrapped(first), target_first).sum() + example_loss(wrapped(second), target_second).sum()).backward()
    clipper.pre_step()
    sums = {f"lm.{name}": p.grad for name, p in lm.named_parameters()}
    assert_exact(sums, wrapped.last_per_sample_norms[:, 0], expected, expected_norms, scales)
    assert len(spy.tied) == 1


def test_padding_mask_drops_the_masked_examples():
    torch.manual_seed(7)
    model, inputs, target = _case(
        TiedLM(17, 4, padding_idx=0), (tokens_for(5, 4, 17, torch.Generator().manual_seed(7), 0),)
    )
    keep = torch.tensor([True, False, True, True, False])
    bound = _median_bound(model, inputs, target)
    expected, expected_norms, scales = reference(model, inputs, target, bound, keep=keep)
    sums, norms, _ = ghost(copy.deepcopy(model), inputs, target, bound, padding_mask=~keep)
    # The norms are every example's (masked ones included); the sums leave the masked out.
    assert_exact(sums, norms, expected, expected_norms, scales)


def test_tied_sums_equal_the_materialised_path_in_float32():
    # Float32, one bound that clips every example: the tied form against the old materialising form, run through
    # the same wrapper with the tied form switched off.
    torch.manual_seed(8)
    model = TiedLM(64, 8, padding_idx=0, head_bias=True)
    tokens = tokens_for(6, 10, 64, torch.Generator().manual_seed(8), 0)
    target = torch.randn(6, 10, 64)

    def run(tied: bool):
        lm = copy.deepcopy(model)
        clipper = PerSampleGradientClipper(list(lm.parameters()), 0.01)
        wrapped = GhostClippingModule(lm, clipper=clipper)
        original = ghost_backward.tied_uses
        ghost_backward.tied_uses = original if tied else (lambda uses, shared: None)
        try:
            example_loss(wrapped(tokens), target).mean().backward()
        finally:
            ghost_backward.tied_uses = original
        clipper.pre_step()
        return {n: p.grad for n, p in lm.named_parameters()}, wrapped.last_per_sample_norms

    (tied_sums, tied_norms), (old_sums, old_norms) = run(True), run(False)
    torch.testing.assert_close(tied_norms, old_norms, rtol=1e-5, atol=0)
    for name in old_sums:
        torch.testing.assert_close(tied_sums[name], old_sums[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_half_precision_norms_match_the_loop_on_the_rounded_model(dtype):
    # The factors stay in the model's dtype until the cross term, formed in float32 at least (as the norm forms):
    # the norms are as exact as the dtype's activations and gradients allow.
    torch.manual_seed(13)
    model = TiedLM(40, 8, padding_idx=0, head_bias=True).to(dtype)
    tokens = tokens_for(4, 6, 40, torch.Generator().manual_seed(13), 0)
    target = torch.randn(4, 6, 40, generator=torch.Generator().manual_seed(14))
    _, expected_norms, _ = reference(copy.deepcopy(model).double(), (tokens,), target.double(), float("inf"))
    _, norms, _ = ghost(model, (tokens,), target.to(dtype), 1.0)
    assert norms.dtype == torch.float32
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(norms.double(), expected_norms, rtol=tolerance, atol=0)


class CheckpointedTiedLM(TiedLM):
    """``TiedLM`` with a reentrant activation checkpoint around the middle layer (``inside="mix"``), or around the
    embedding plus features from ``mix`` (``inside="embed"``: a reentrant region needs an input that requires
    grad)."""

    def __init__(self, vocab: int, dim: int, inside: str) -> None:
        super().__init__(vocab, dim, padding_idx=0)
        self.inside = inside

    def forward(self, tokens, features):
        from torch.utils.checkpoint import checkpoint

        if self.inside == "mix":
            hidden = checkpoint(lambda x: torch.tanh(self.mix(x)), self.embed(tokens) + features, use_reentrant=True)
        else:
            hidden = checkpoint(
                lambda t, h: torch.tanh(self.embed(t) + h), tokens, self.mix(features), use_reentrant=True
            )
        return self.head(hidden)


def test_a_reentrant_checkpoint_between_the_uses_is_exact(monkeypatch):
    spy = _UsesOfTheTiedForm(monkeypatch)
    torch.manual_seed(15)
    generator = torch.Generator().manual_seed(15)
    tokens, features = tokens_for(4, 5, 21, generator, 0), torch.randn(4, 5, 4, generator=generator, dtype=DOUBLE)
    model, inputs, target = _case(CheckpointedTiedLM(21, 4, "mix"), (tokens, features))
    bound = _median_bound(model, inputs, target)
    expected, expected_norms, scales = reference(model, inputs, target, bound)
    sums, norms, _ = ghost(copy.deepcopy(model), inputs, target, bound)
    assert_exact(sums, norms, expected, expected_norms, scales)
    assert len(spy.tied) == 1


def test_a_tied_embedding_inside_a_reentrant_checkpoint_raises():
    # Its use appears only when the nested backward recomputes it, after the head was reduced alone: refused (as
    # for any shared parameter found that late), never clipped with a wrong norm.
    torch.manual_seed(16)
    # Per-example head gradients larger than twice its inputs and G (the default per_sample_memory_ratio): the head
    # is reduced to norms before the nested backward finds the embedding's use.
    generator = torch.Generator().manual_seed(16)
    tokens, features = tokens_for(4, 2, 21, generator, 0), torch.randn(4, 2, 16, generator=generator, dtype=DOUBLE)
    model, inputs, target = _case(CheckpointedTiedLM(21, 16, "embed"), (tokens, features))
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        ghost(model, inputs, target, 1.0)


# ---------------------------------------------------------------------------------------------- HF models
def _hf_causal_lm(family: str, vocab: int):
    transformers = pytest.importorskip("transformers")
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0,
            tie_word_embeddings=True,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    return model.double().train()


@pytest.mark.parametrize(
    ("family", "vocab", "length", "batch"), [("gpt2", 50, 8, 4), ("gpt2", 97, 5, 2), ("llama", 40, 6, 4)]
)
def test_hf_causal_lm_with_tied_embeddings_matches_the_per_example_loop(family, vocab, length, batch, monkeypatch):
    # Batches of a power of two: the HF per-example loss is scaled by the batch in float32 (test_hf_models), which
    # is exact only then.
    spy = _UsesOfTheTiedForm(monkeypatch)
    torch.manual_seed(9)
    model = _hf_causal_lm(family, vocab)
    generator = torch.Generator().manual_seed(10)
    ids = torch.randint(1, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, length - 2 :] = 0  # one padded example
    labels = ids.masked_fill(mask == 0, -100)
    per_sample = per_example_reference(
        model, [ids], lambda out, i: out.loss, kwargs={"attention_mask": mask, "labels": labels}
    )
    expected_norms = torch.sqrt(sum(g.flatten(1).square().sum(dim=1) for g in per_sample.values()))
    bound = float(expected_norms.median())
    factors = clip_factors(expected_norms, bound)
    expected = {name: torch.tensordot(factors, g, dims=1) for name, g in per_sample.items()}
    scales = {name: float(factors @ g.flatten(1).norm(dim=1)) for name, g in per_sample.items()}
    lm = copy.deepcopy(model)
    clipper = PerSampleGradientClipper([p for p in lm.parameters() if p.requires_grad], bound)
    wrapped = GhostClippingModule(lm, clipper=clipper)
    wrapped(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    clipper.pre_step()
    sums = {name: p.grad for name, p in lm.named_parameters() if p.requires_grad}
    assert_exact(sums, wrapped.last_per_sample_norms[:, 0], expected, expected_norms, scales)
    assert spy.tied == [frozenset({lm.lm_head.weight})]


# ---------------------------------------------------------------------------------------------- never formed
class _LargestAllocation(TorchDispatchMode):
    """The largest tensor any op returned while active (elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return result


def test_the_per_example_gradient_of_the_tied_weight_is_never_formed(monkeypatch):
    # B x V x d = 8 x 4096 x 32 = 1M elements; the largest tensor the step needs is the logits' gradient,
    # B x T x V = 128K. Nothing of the tied weight's per-example size may be allocated, in the pass nor by a
    # buffer kept for the next, and no materialised gradient reaches the pass.
    batch, vocab, dim, length = 8, 4096, 32, 4
    torch.manual_seed(11)
    model = TiedLM(vocab, dim, padding_idx=0)
    tokens = tokens_for(batch, length, vocab, torch.Generator().manual_seed(11), 0)
    target = torch.randn(batch, length, vocab)
    clipper = PerSampleGradientClipper(list(model.parameters()), 1.0)
    wrapped = GhostClippingModule(model, clipper=clipper)
    materialised = []
    original_add = BackwardPass.add_materialised
    monkeypatch.setattr(
        BackwardPass, "add_materialised", lambda self, p, r, g: (materialised.append(p), original_add(self, p, r, g))
    )
    for _ in range(2):
        loss = example_loss(wrapped(tokens), target).mean()
        with _LargestAllocation() as largest:
            loss.backward()
        assert largest.largest < batch * vocab * dim // 4, largest.largest
        assert model.embed.weight not in materialised
        assert model.embed.weight not in wrapped._passes.buffers
        clipper.pre_step()
        model.zero_grad(set_to_none=True)
    # The same model with the tied form switched off forms it (the bound above can fail).
    monkeypatch.setattr(ghost_backward, "tied_uses", lambda uses, shared: None)
    loss = example_loss(wrapped(tokens), target).mean()
    with _LargestAllocation() as largest:
        loss.backward()
    assert largest.largest >= batch * vocab * dim


def test_a_linear_layer_called_twice_keeps_the_materialising_path(monkeypatch):
    spy = _UsesOfTheTiedForm(monkeypatch)
    layer = nn.Linear(4, 4)
    model = nn.Sequential(layer, nn.Tanh(), layer)
    clipper = PerSampleGradientClipper(list(model.parameters()), 1.0)
    wrapped = GhostClippingModule(model, clipper=clipper)
    wrapped(torch.randn(3, 4)).square().sum().backward()
    assert spy.tied == [] and layer.weight in wrapped._passes.buffers


# ---------------------------------------------------------------------------------------------- hygiene
def test_nothing_of_the_pass_outlives_it(monkeypatch):
    spy = _UsesOfTheTiedForm(monkeypatch)
    torch.manual_seed(12)
    model = TiedLM(33, 6, padding_idx=0)
    tokens = tokens_for(4, 5, 33, torch.Generator().manual_seed(12), 0)
    clipper = PerSampleGradientClipper(list(model.parameters()), 1.0)
    wrapped = GhostClippingModule(model, clipper=clipper)
    seen = {}
    original_add_cross_terms = tied_module.TiedUses.add_cross_terms

    def add_cross_terms(self, squared):
        # At the end of the pass: the factors are still held here, dropped by the call.
        seen["factors_before"] = sum(len(v) for v in self._factors.values())
        original_add_cross_terms(self, squared)
        seen["factors_after"] = len(self._factors) + len(self._cross)

    monkeypatch.setattr(tied_module.TiedUses, "add_cross_terms", add_cross_terms)
    output = wrapped(tokens)
    example_loss(output, torch.randn_like(output)).mean().backward()
    del output
    gc.collect()
    assert seen == {"factors_before": 2, "factors_after": 0}
    assert wrapped._passes.current is None and not wrapped._passes.buffers
    assert len(spy.passes) == 1 and spy.passes[0]() is None  # the pass's tied state is gone with it
