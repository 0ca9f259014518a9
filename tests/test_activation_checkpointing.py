"""Activation checkpointing (issue 21): ``torch.utils.checkpoint`` (reentrant and non-reentrant),
``checkpoint_sequential`` and Hugging Face's ``gradient_checkpointing_enable()`` in hooks and ghost mode.

The recomputation of a forward during backward is told apart from a misuse by torch's own markers
(``privacy_engine.capture.recompute``). Each test compares against an independent reference: a float64
per-example loop, or the same model without checkpointing (equal bit for bit, or within 1e-12).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import RTOL, assert_matches_reference, per_example_reference
from test_hf_models import _assert_ghost_matches, _family, _hf_reference
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential
from torch.utils.data import DataLoader, TensorDataset

from privacy_engine import GhostClippingModule, GradSampleModule, PerSampleGradientClipper, PrivacyEngine

pytestmark = [
    pytest.mark.filterwarnings("ignore:poisson_sampling=False"),
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated"),
]

FEATURES, WIDTH, CLASSES, BATCH = 5, 8, 3, 6
KINDS = ["reentrant", "non_reentrant", "sequential_reentrant", "sequential_non_reentrant"]


def run_region(kind: str | None, blocks: nn.ModuleList, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` through ``blocks``, each block checkpointed as ``kind`` says (None: no checkpointing)."""
    if kind is None:
        for block in blocks:
            hidden = block(hidden)
        return hidden
    if kind.startswith("sequential"):
        return checkpoint_sequential(nn.Sequential(*blocks), 2, hidden, use_reentrant=kind == "sequential_reentrant")
    for block in blocks:
        hidden = checkpoint(block, hidden, use_reentrant=kind == "reentrant")
    return hidden


class Gain(nn.Module):
    """A per-feature gain: no grad sampler, so the ``torch.func`` fallback computes its per-sample gradients."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * self.weight


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.norm = nn.LayerNorm(2 * width)
        self.gain = Gain(2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(self.gain(torch.tanh(self.norm(self.up(hidden)))))


class TransformerBlock(nn.Module):
    """Pre-norm self-attention and MLP (``nn.MultiheadAttention``: the fallback in hooks mode, decomposed in
    ghost mode)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = MLPBlock(width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.norm1(hidden)
        hidden = hidden + self.attention(normed, normed, normed, need_weights=False)[0]
        return self.mlp(self.norm2(hidden))


class Net(nn.Module):
    """An input layer, three checkpointable blocks and a head; ``checkpointing`` picks the kind (None: off)."""

    def __init__(self, block: str, checkpointing: str | None = None) -> None:
        super().__init__()
        self.block, self.checkpointing = block, checkpointing
        self.embed = nn.Linear(FEATURES, WIDTH)
        make = MLPBlock if block == "mlp" else TransformerBlock
        self.blocks = nn.ModuleList([make(WIDTH) for _ in range(3)])
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = run_region(self.checkpointing, self.blocks, self.embed(x))
        return self.head(hidden.mean(dim=1) if hidden.dim() == 3 else hidden)


def make_net(block: str, checkpointing: str | None) -> Net:
    torch.manual_seed(0)
    return Net(block, checkpointing).double()


def make_data(block: str, num_examples: int = 24) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    shape = (num_examples, FEATURES) if block == "mlp" else (num_examples, 4, FEATURES)
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    return TensorDataset(x, torch.randint(0, CLASSES, (num_examples,), generator=generator))


def loss_of(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, y)


def released_after_steps(block: str, mode: str, checkpointing: str | None, steps: int = 2) -> list[torch.Tensor]:
    """The parameters after ``steps`` private steps (noise off, same seed, same batches)."""
    model = make_net(block, checkpointing)
    engine = PrivacyEngine(accountant="rdp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    wrapped, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(make_data(block), batch_size=BATCH),
        noise_multiplier=0.0, max_grad_norm=0.3, grad_sample_mode=mode, poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    batches = iter(loader)
    for _ in range(steps):
        x, y = next(batches)
        optimizer.zero_grad()
        loss_of(wrapped(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def assert_same(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected, strict=True):
        if not torch.equal(a, e):
            torch.testing.assert_close(a, e, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------- engine: released update
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("block", "mode"),
    # The transformer in hooks mode takes 3-4 s per kind on 2 cores: run with the slow tests.
    [("mlp", "hooks"), ("mlp", "ghost"), pytest.param("transformer", "hooks", marks=pytest.mark.slow), ("transformer", "ghost")],
)
def test_released_update_with_checkpointing_equals_the_run_without(block: str, mode: str, kind: str) -> None:
    expected = released_after_steps(block, mode, None)
    assert_same(released_after_steps(block, mode, kind), expected)
    assert not all(torch.equal(e, b) for e, b in zip(expected, make_net(block, None).parameters()))  # it trained


# ------------------------------------------------------------------------------- per-sample results
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", ["mlp", "transformer"])
def test_per_sample_gradients_with_checkpointing_exact(block: str, kind: str) -> None:
    x, y = make_data(block, BATCH).tensors
    plain = make_net(block, None)
    reference = per_example_reference(plain, [x], lambda out, i: loss_of(out, y[i : i + 1]))
    plain_wrapped = GradSampleModule(plain)  # the same model without checkpointing: equal bit for bit
    loss_of(plain_wrapped(x), y).backward()
    model = make_net(block, kind)
    wrapped = GradSampleModule(model)
    loss_of(wrapped(x), y).backward()
    assert_matches_reference(model, reference)
    # Equal, or within 1e-12: a reentrant checkpoint's nested backward may add the gradients reaching a
    # region's input in another order (torch's, not the wrapper's).
    assert_same([p.grad_sample for p in model.parameters()], [p.grad_sample for p in plain.parameters()])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", ["mlp", "transformer"])
def test_ghost_norms_and_clipped_sums_with_checkpointing_exact(block: str, kind: str) -> None:
    x, y = make_data(block, BATCH).tensors

    def clipped(checkpointing):
        model = make_net(block, checkpointing)
        clipper = PerSampleGradientClipper(list(model.parameters()), max_grad_norm=0.3)
        wrapped = GhostClippingModule(model, clipper=clipper)
        loss_of(wrapped(x), y).backward()
        clipper.pre_step()
        return [p.grad.clone() for p in model.parameters()], wrapped.last_per_sample_norms

    expected, expected_norms = clipped(None)
    sums, norms = clipped(kind)
    assert_same(sums, expected)
    assert_same([norms], [expected_norms])
    reference = per_example_reference(make_net(block, None), [x], lambda out, i: loss_of(out, y[i : i + 1]))
    flat = torch.cat([g.flatten(1) for g in reference.values()], dim=1)
    torch.testing.assert_close(norms.flatten(), flat.norm(dim=1), rtol=RTOL, atol=0)


# ------------------------------------------------------------------------------- Hugging Face
@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_decoder_with_gradient_checkpointing_exact(family: str, use_reentrant: bool) -> None:
    model, batch, kind = _family(family)
    reference = _hf_reference(model, batch, kind)
    ghost_model = copy.deepcopy(model)
    for m in (model, ghost_model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        m.train()
    assert model.transformer.h[0].gradient_checkpointing if family == "gpt2" else model.model.layers[0].gradient_checkpointing
    wrapped = GradSampleModule(model)
    wrapped(**batch).loss.backward()
    assert_matches_reference(model, reference)
    _assert_ghost_matches(ghost_model, lambda m: m(**batch).loss, reference)


# ------------------------------------------------------------------------------- what stays refused
@pytest.mark.parametrize("kind", ["reentrant", "non_reentrant"])
def test_a_direct_call_of_the_wrapped_model_is_still_refused(kind: str) -> None:
    model = make_net("mlp", kind)
    GradSampleModule(model)
    x, _ = make_data("mlp", BATCH).tensors
    with pytest.raises(RuntimeError, match="without going through its GradSampleModule"):
        model(x)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_forward_during_backward_that_is_not_a_recomputation_is_refused(mode: str) -> None:
    model = make_net("mlp", None)
    x, y = make_data("mlp", BATCH).tensors
    if mode == "hooks":
        wrapped = GradSampleModule(model)
    else:
        wrapped = GhostClippingModule(model, clipper=PerSampleGradientClipper(list(model.parameters()), max_grad_norm=1.0))
    output = wrapped(x)

    def run_a_block(grad: torch.Tensor) -> None:
        with torch.enable_grad():  # backward runs with gradients off: a training forward needs them on
            model.blocks[0](torch.randn(BATCH, WIDTH, dtype=torch.float64))

    output.register_hook(run_a_block)
    with pytest.raises(RuntimeError, match="during a backward pass, and not as torch.utils.checkpoint's recomputation"):
        loss_of(output, y).backward()


# ------------------------------------------------------------------------------- shared layers, fast clipping
class SharedBlocks(nn.Module):
    """One block applied twice: inside one checkpointed region (``within``) or in two regions (``across``)."""

    def __init__(self, layout: str, checkpointing: str | None) -> None:
        super().__init__()
        self.layout, self.checkpointing = layout, checkpointing
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.block = MLPBlock(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        twice = nn.Sequential(self.block, self.block)
        if self.checkpointing is None:
            hidden = twice(hidden)
        elif self.layout == "within":
            hidden = checkpoint(twice, hidden, use_reentrant=self.checkpointing == "reentrant")
        else:
            for _ in range(2):
                hidden = checkpoint(self.block, hidden, use_reentrant=self.checkpointing == "reentrant")
        return self.head(hidden)


def ghost_clipped_sums(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    clipper = PerSampleGradientClipper(list(model.parameters()), max_grad_norm=0.3)
    wrapped = GhostClippingModule(model, clipper=clipper)
    loss_of(wrapped(x), y).backward()
    clipper.pre_step()
    return [p.grad.clone() for p in model.parameters()]


def shared_model(layout: str, checkpointing: str | None) -> SharedBlocks:
    torch.manual_seed(0)
    return SharedBlocks(layout, checkpointing).double()


@pytest.mark.parametrize(("layout", "kind"), [("within", "reentrant"), ("within", "non_reentrant"), ("across", "non_reentrant")])
def test_ghost_layer_used_twice_under_checkpointing_exact(layout: str, kind: str) -> None:
    x, y = make_data("mlp", BATCH).tensors
    expected = ghost_clipped_sums(shared_model(layout, None), x, y)
    assert_same(ghost_clipped_sums(shared_model(layout, kind), x, y), expected)


def test_ghost_refuses_a_parameter_shared_across_reentrant_regions() -> None:
    # The second region's use is found only when the nested backward reaches it, after the first use's norm
    # was taken without the cross terms: refused, naming the way out.
    x, y = make_data("mlp", BATCH).tensors
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        ghost_clipped_sums(shared_model("across", "reentrant"), x, y)


# ------------------------------------------------------------------------------- only the blocks trainable
def released_with_frozen_ends(mode: str, checkpointing: str | None) -> list[torch.Tensor]:
    """Embedding and head frozen, the embedding's output made to require grad (as HF's
    ``enable_input_require_grads`` does for adapters): under a reentrant checkpoint no trainable layer runs
    with gradients in the forward itself, only in backward."""
    model = make_net("mlp", checkpointing)
    model.embed.requires_grad_(False)
    model.head.requires_grad_(False)
    model.embed.register_forward_hook(lambda module, args, output: output.requires_grad_(True))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    wrapped, optimizer, loader = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(make_data("mlp"), batch_size=BATCH),
        noise_multiplier=0.0, max_grad_norm=0.3, grad_sample_mode=mode, poisson_sampling=False,
    )  # fmt: skip
    for _, (x, y) in zip(range(2), loader):
        optimizer.zero_grad()
        loss_of(wrapped(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_only_checkpointed_layers_trainable(mode: str, kind: str) -> None:
    expected = released_with_frozen_ends(mode, None)
    assert_same(released_with_frozen_ends(mode, kind), expected)
    assert not torch.equal(expected[2], make_net("mlp", None).blocks[0].up.weight)  # the blocks trained
